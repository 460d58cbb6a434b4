"""orpo.render.template against transformers' own apply_chat_template (the oracle), on real tokenizers."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import re
import subprocess
import sys
from datetime import datetime
from pathlib import Path

import jinja2
import pytest
from tokenizers import AddedToken, Tokenizer

from orpo.render.template import (
    ChatTemplate,
    ChatTemplateError,
    ModelSourceError,
    TemplateRaised,
    encode,
    encode_generation_prompt,
    find_templates,
    load_template,
    load_tokenizer,
    render_generation_prompt,
    resolve_model_dir,
)

transformers = pytest.importorskip("transformers")  # test-only dependency: the oracle
from transformers import AutoTokenizer, PreTrainedTokenizerFast
from transformers.utils import chat_template_utils

_spec = importlib.util.spec_from_file_location(
    "render_builders", Path(__file__).resolve().parent / "fixtures" / "templates" / "builders.py")
builders = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(builders)

SHARED = Path(__file__).resolve().parents[1].parent / "shared"
REAL_TEMPLATES = SHARED / "data" / "chat_templates" / "templates.jsonl"
DATE = {"date_string": "26 Jul 2024"}

CONVERSATIONS = {
    "system_multi_turn": [
        {"role": "system", "content": "You are a helpful assistant. Be brief."},
        {"role": "user", "content": "Hi there! How are you today?"},
        {"role": "assistant", "content": "I am fine, thank you."},
        {"role": "user", "content": "Tell me a joke about cats. 🙂 你好"},
    ],
    "single_user": [{"role": "user", "content": "What is the capital of France?"}],
    "multi_turn_no_system": [
        {"role": "user", "content": "Write a haiku about the sea."},
        {"role": "assistant",
         "content": "Waves fold into foam;\nsalt wind carries gull voices;\nthe tide keeps its time."},
        {"role": "user", "content": "  Now one about Köln, with spaces around.  "},
    ],
    "ends_with_assistant": [
        {"role": "system", "content": "Be kind."},
        {"role": "user", "content": "List three colors."},
        {"role": "assistant", "content": "red, green, blue"},
    ],
    "list_of_parts": [
        {"role": "user", "content": [{"type": "text", "text": "Why is the sky blue?"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "Rayleigh scattering."}]},
        {"role": "user", "content": [{"type": "text", "text": "In one sentence, please."}]},
    ],
}


def hf_wrap(tok: Tokenizer, template: str, tokens: dict) -> PreTrainedTokenizerFast:
    """transformers' fast tokenizer around the same `tokenizers` object."""
    return PreTrainedTokenizerFast(tokenizer_object=tok, chat_template=template, **tokens)


def compare(ours_template: ChatTemplate, ours_tok: Tokenizer, hf, conv: list, gen: bool, **kwargs) -> str:
    """Render and encode on both sides; return 'equal' or 'both raised'; fail on any difference."""
    try:
        ref_text = hf.apply_chat_template(conv, tokenize=False, add_generation_prompt=gen, **kwargs)
        ref_ids = hf.apply_chat_template(conv, tokenize=True, return_dict=False, add_generation_prompt=gen, **kwargs)
    except Exception as e:  # transformers itself refuses: we must refuse too
        with pytest.raises(ChatTemplateError):
            ours_template.render(conv, add_generation_prompt=gen, **kwargs)
        return f"both raised ({type(e).__name__})"
    text = ours_template.render(conv, add_generation_prompt=gen, **kwargs)
    assert text == ref_text
    assert encode(ours_tok, text) == list(ref_ids)
    return "equal"


# ---------------------------------------------------------------------------------------------------
# Five template families, written as fixtures, loaded from model folders stored five different ways


@pytest.mark.parametrize("family", sorted(builders.FAMILIES))
def test_family_matches_transformers_text_and_ids(tmp_path: Path, family: str) -> None:
    folder = builders.family_model(tmp_path / family, family)
    template, tok = load_template(folder), load_tokenizer(folder)
    assert template.text == builders.family_template(family)
    fam = builders.FAMILIES[family]
    oracles = [hf_wrap(Tokenizer.from_file(str(folder / "tokenizer.json")), template.text, fam["tokens"]),
               AutoTokenizer.from_pretrained(str(folder))]  # also checks our folder loading against theirs
    outcomes = [compare(template, tok, hf, conv, gen, **DATE)
                for hf in oracles for conv in CONVERSATIONS.values() for gen in (True, False)]
    # Mistral and Gemma reject nothing here but Mistral has no list-of-parts support: most must render.
    assert outcomes.count("equal") >= 16, outcomes
    with_gen = template.render(CONVERSATIONS["single_user"], add_generation_prompt=True, **DATE)
    without = template.render(CONVERSATIONS["single_user"], add_generation_prompt=False, **DATE)
    if family != "mistral":  # Mistral's [INST] template has no generation prompt
        assert with_gen != without and with_gen.startswith(without)


def test_family_rejections_match(tmp_path: Path) -> None:
    folder = builders.family_model(tmp_path / "mistral", "mistral")
    template, tok = load_template(folder), load_tokenizer(folder)
    hf = AutoTokenizer.from_pretrained(str(folder))
    bad = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    assert compare(template, tok, hf, bad, True).startswith("both raised")
    with pytest.raises(ChatTemplateError, match="Conversation roles must alternate") as info:
        template.render(bad)
    assert str(folder / "tokenizer_config.json") in str(info.value)
    assert isinstance(info.value.__cause__, TemplateRaised)
    assert isinstance(info.value.__cause__, jinja2.exceptions.TemplateError)


# ---------------------------------------------------------------------------------------------------
# The 18 real templates in ../shared


def _real_templates() -> list[dict]:
    if not REAL_TEMPLATES.exists():
        return []
    return [json.loads(line) for line in REAL_TEMPLATES.read_text(encoding="utf-8").splitlines() if line.strip()]


REAL = _real_templates()
# Control-token-looking strings a real template writes: they become special tokens of its test tokenizer.
SPECIAL_RE = re.compile(
    r"<\|[^|<>\s]+\|>|<｜[^｜]+｜>|<(?:start|end)_of_turn>|\[/?(?:INST|TOOL_CALLS|AVAILABLE_TOOLS)\]")


@pytest.fixture(scope="module")
def base_bytelevel() -> Tokenizer:
    return builders.train_bpe("bytelevel", [])


def _real_model(tmp_path: Path, base: Tokenizer, entry: dict) -> tuple[Path, dict]:
    tokens = {k: v for k, v in entry.items() if k.endswith("_token") and isinstance(v, str)}
    specials = sorted(set(tokens.values()) | set(SPECIAL_RE.findall(entry["chat_template"])))
    tok = Tokenizer.from_str(base.to_str())
    tok.add_special_tokens([AddedToken(s, special=True) for s in specials])
    return builders.write_model(tmp_path, tok, tokens, entry["chat_template"]), tokens


@pytest.mark.skipif(not REAL, reason=f"{REAL_TEMPLATES} not present")
@pytest.mark.parametrize("entry", REAL, ids=[e["name"].split(" ")[0] for e in REAL])
def test_real_template_matches_transformers(tmp_path: Path, base_bytelevel: Tokenizer, entry: dict) -> None:
    folder, tokens = _real_model(tmp_path, base_bytelevel, entry)
    template, tok = load_template(folder), load_tokenizer(folder)
    assert template.sha256 == entry["chat_template_sha256"]
    hf = hf_wrap(Tokenizer.from_file(str(folder / "tokenizer.json")), entry["chat_template"], tokens)
    outcomes = [compare(template, tok, hf, conv, gen, **DATE)
                for conv in CONVERSATIONS.values() for gen in (True, False)]
    # Every template renders most shapes; the ones it refuses, transformers refuses as well.
    assert outcomes.count("equal") >= 4, outcomes


@pytest.mark.skipif(not REAL, reason=f"{REAL_TEMPLATES} not present")
def test_known_behaviours_of_real_templates() -> None:
    by_name = {e["name"].split(" ")[0]: e for e in REAL}
    tokens = lambda e: {k: v for k, v in e.items() if k.endswith("_token") and isinstance(v, str)}
    gemma2 = ChatTemplate(by_name["gemma-2"]["chat_template"], "gemma-2", tokens(by_name["gemma-2"]))
    with pytest.raises(ChatTemplateError, match="System role not supported"):
        gemma2.render(CONVERSATIONS["system_multi_turn"])
    llama3 = by_name["llama-3-8b-instruct-original"]
    t = ChatTemplate(llama3["chat_template"], "llama3-original", tokens(llama3))
    assert t.render(CONVERSATIONS["single_user"], add_generation_prompt=False).endswith(
        "<|start_header_id|>assistant<|end_header_id|>\n\n")  # always appends the header
    pixtral = by_name["mistral-pixtral-12b"]
    t = ChatTemplate(pixtral["chat_template"], "pixtral", tokens(pixtral))
    with pytest.raises(ChatTemplateError):
        t.render(CONVERSATIONS["ends_with_assistant"][1:])  # plain-string assistant content


@pytest.mark.skipif(not REAL, reason=f"{REAL_TEMPLATES} not present")
def test_strftime_now_frozen_on_both_sides_llama32() -> None:
    entry = next(e for e in REAL if e["name"].startswith("llama-3.2"))
    fixed = datetime(2031, 3, 5, 12, 0, 0)
    ours = ChatTemplate(entry["chat_template"], "llama-3.2", {"bos_token": entry["bos_token"]}, clock=lambda: fixed)
    compiled = chat_template_utils._compile_jinja_template(entry["chat_template"])
    saved = compiled.environment.globals["strftime_now"]
    compiled.environment.globals["strftime_now"] = lambda fmt: fixed.strftime(fmt)
    try:
        ref = chat_template_utils.render_jinja_template(
            [CONVERSATIONS["single_user"]], chat_template=entry["chat_template"], add_generation_prompt=True,
            bos_token=entry["bos_token"])[0][0]
    finally:
        compiled.environment.globals["strftime_now"] = saved
    text = ours.render(CONVERSATIONS["single_user"], add_generation_prompt=True)
    assert text == ref and "Today Date: 05 Mar 2031" in text
    # Unfrozen, it is today's date (the real clock, as transformers).
    before = datetime.now().strftime("%d %b %Y")
    live = dataclasses.replace(ours, clock=None).render(CONVERSATIONS["single_user"])
    after = datetime.now().strftime("%d %b %Y")
    assert f"Today Date: {before}" in live or f"Today Date: {after}" in live


# ---------------------------------------------------------------------------------------------------
# Jinja environment semantics


@pytest.fixture(scope="module")
def small_tok() -> Tokenizer:
    return builders.train_bpe("bytelevel", ["<s>", "</s>", "<img>"])


def _both(tok: Tokenizer, template: str, tokens: dict | None = None, conv: list | None = None,
          **kwargs) -> tuple[str, str]:
    """(ours, transformers' apply_chat_template) renders of one template."""
    conv = conv or CONVERSATIONS["single_user"]
    ref = hf_wrap(tok, template, tokens or {}).apply_chat_template(conv, tokenize=False, **kwargs)
    ours = ChatTemplate(template, "inline", tokens or {}).render(conv, **kwargs)
    return ours, ref


def test_tojson_semantics(small_tok: Tokenizer) -> None:
    tpl = ("{{ tools | tojson }}|{{ tools | tojson(indent=2) }}|"
           "{{ documents | tojson(separators=(',', ':'), sort_keys=true) }}|{{ extra | tojson(ensure_ascii=true) }}")
    tools = [{"name": "f<&>", "description": "café ✓", "parameters": {"b": 1, "a": [1, 2]}}]
    docs = [{"title": "T", "text": "x < y", "a": None}]
    ours, ref = _both(small_tok, tpl, tools=tools, documents=docs, extra={"k": "é"})
    assert ours == ref
    assert '"f<&>"' in ours and "café ✓" in ours and '{"a":null,"text":"x < y","title":"T"}' in ours
    assert '"\\u00e9"' in ours


def test_variables_tools_documents_kwargs_and_special_tokens(small_tok: Tokenizer) -> None:
    tpl = ("{{ bos_token }}|{{ eos_token }}|{{ image_token }}|{{ tools is none }}|{{ documents | length }}|"
           "{{ custom }}|{{ add_generation_prompt }}|{{ unk_token is defined }}|{% if pad_token %}P{% endif %}")
    tokens = {"bos_token": "<s>", "eos_token": "</s>", "image_token": "<img>"}
    ours, ref = _both(small_tok, tpl, tokens, documents=[{"title": "a", "text": "b"}], custom=7,
                      add_generation_prompt=True)
    assert ours == ref == "<s>|</s>|<img>|True|1|7|True|False|"
    # caller kwargs win over special tokens, as in transformers' apply_chat_template
    hf = hf_wrap(small_tok, "{{ eos_token }}", tokens)
    ref = hf.apply_chat_template(CONVERSATIONS["single_user"], tokenize=False, eos_token="<override>")
    ours = ChatTemplate("{{ eos_token }}", "inline", tokens).render(
        CONVERSATIONS["single_user"], eos_token="<override>")
    assert ours == ref == "<override>"


def test_list_of_parts_none_keys_and_reasoning_alias(small_tok: Tokenizer) -> None:
    tpl = ("{% for m in messages %}{{ m.role }}:{% if m.content is string %}{{ m.content }}{% else %}"
           "{% for p in m.content %}[{{ p.type }}={{ p.text }}]{% endfor %}{% endif %}"
           "{{ '+name' if m.name is defined }}{{ '|' + m.reasoning_content if m.reasoning_content }}"
           "{{ '|' + m.thinking if m.thinking }};{% endfor %}")
    conv = [{"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "image"}], "name": None},
            {"role": "assistant", "content": "ok", "reasoning": "because"}]
    ours, ref = _both(small_tok, tpl, conv=conv)
    assert ours == ref == "user:[text=hi][image=];assistant:ok|because|because;"


def test_generation_tag_loopcontrols_trim_lstrip(small_tok: Tokenizer) -> None:
    tpl = ("{%- for m in messages %}\n  {%- if loop.index > 1 %}{% break %}{% endif %}\n"
           "    {% generation %}{{ m.content }}{% endgeneration %}\n{% endfor %}\n  END")
    ours, ref = _both(small_tok, tpl, conv=CONVERSATIONS["multi_turn_no_system"])
    assert ours == ref and ours.startswith("Write a haiku")


def test_sandbox_and_namespace_guards() -> None:
    for tpl in ("{% set ns = namespace(_x=1) %}{{ ns._x }}", "{{ messages.append(1) }}",
                "{{ ''.__class__.__mro__[1].__subclasses__() }}"):
        try:
            ref = chat_template_utils.render_jinja_template([CONVERSATIONS["single_user"]], chat_template=tpl)[0][0]
        except Exception:
            with pytest.raises(ChatTemplateError):
                ChatTemplate(tpl, "inline").render(CONVERSATIONS["single_user"])
        else:
            assert ChatTemplate(tpl, "inline").render(CONVERSATIONS["single_user"]) == ref


def test_missing_special_token_is_a_clear_error(small_tok: Tokenizer) -> None:
    tpl = "{{ bos_token }}{% for m in messages %}{{ m.content }}{% endfor %}"
    with pytest.raises(ChatTemplateError, match="bos_token") as info:
        ChatTemplate(tpl, "my/template.jinja", {"eos_token": "</s>"}).render(CONVERSATIONS["single_user"])
    assert "my/template.jinja" in str(info.value)
    # Only printing it fails: testing it works as in transformers.
    guarded = "{% if bos_token is defined %}{{ bos_token }}{% endif %}{% if not unk_token %}-{% endif %}x"
    assert _both(small_tok, guarded)[0] == _both(small_tok, guarded)[1] == "-x"


def test_empty_conversation_and_syntax_error() -> None:
    with pytest.raises(ChatTemplateError, match="non-empty"):
        ChatTemplate("{{ messages }}", "inline").render([])
    with pytest.raises(ChatTemplateError, match=r"broken\.jinja.*line 2"):
        ChatTemplate("ok\n{% if %}", "broken.jinja")


# ---------------------------------------------------------------------------------------------------
# Loading model folders


@pytest.fixture()
def chatml_tok() -> Tokenizer:
    fam = builders.FAMILIES["chatml"]
    return builders.train_bpe(fam["kind"], fam["specials"])


def test_named_templates_and_jinja_files(tmp_path: Path, chatml_tok: Tokenizer) -> None:
    tokens = builders.FAMILIES["chatml"]["tokens"]
    folder = builders.write_model(tmp_path / "m", chatml_tok, tokens, "DEFAULT", "named_list")
    assert load_template(folder).text == "DEFAULT"
    assert load_template(folder, name="tool_use").text.startswith("{{ raise_exception")
    assert load_template(folder).source.endswith("tokenizer_config.json:chat_template[default]")
    with pytest.raises(ChatTemplateError, match="available: \\['default', 'tool_use'\\]"):
        load_template(folder, name="nope")
    # chat_template.jinja wins over tokenizer_config.json; additional_chat_templates/*.jinja add named ones
    (folder / "chat_template.jinja").write_text("FROM FILE", encoding="utf-8")
    (folder / "additional_chat_templates").mkdir()
    (folder / "additional_chat_templates" / "rag.jinja").write_text("RAG", encoding="utf-8")
    assert load_template(folder).text == "FROM FILE"
    assert set(find_templates(folder)) == {"default", "rag"}
    hf = AutoTokenizer.from_pretrained(str(folder))
    assert hf.chat_template == {"default": "FROM FILE", "rag": "RAG"}


def test_override_file_and_added_token_dicts(tmp_path: Path, chatml_tok: Tokenizer) -> None:
    tokens = {"eos_token": "<|im_end|>", "bos_token": "<|endoftext|>"}
    folder = builders.write_model(tmp_path / "m", chatml_tok, tokens, "{{ bos_token }}MODEL", "added_token_dicts")
    assert load_template(folder).render(CONVERSATIONS["single_user"]) == "<|endoftext|>MODEL"
    override = builders.HERE / "chatml_clean.jinja"
    t = load_template(folder, override=override)
    assert t.source == f"{override} (override)" and t.special_tokens["eos_token"] == "<|im_end|>"
    hf = AutoTokenizer.from_pretrained(str(folder))
    assert t.render(CONVERSATIONS["single_user"], add_generation_prompt=True) == hf.apply_chat_template(
        CONVERSATIONS["single_user"], chat_template=override.read_text(), tokenize=False, add_generation_prompt=True)
    with pytest.raises(ChatTemplateError, match="cannot read the override"):
        load_template(folder, override=tmp_path / "missing.jinja")


def test_no_template_and_missing_model(tmp_path: Path, chatml_tok: Tokenizer) -> None:
    folder = builders.write_model(tmp_path / "m", chatml_tok, {"eos_token": "<|im_end|>"}, None)
    with pytest.raises(ChatTemplateError, match="no chat template"):
        load_template(folder)
    with pytest.raises(ModelSourceError, match="no such folder"):
        resolve_model_dir(tmp_path / "nope" / "deeper" / "x")


def test_hub_id_offline_fails_naming_the_id(tmp_path: Path) -> None:
    code = ("import sys\nfrom orpo.render.template import resolve_model_dir, ModelSourceError\n"
            "try:\n    resolve_model_dir('someorg/some-model-that-is-not-here')\n"
            "except ModelSourceError as e:\n    print('ERR', e); sys.exit(3)\n")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf"),
           "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60, check=False,
                         cwd=tmp_path)
    assert out.returncode == 3, out.stderr
    assert "someorg/some-model-that-is-not-here" in out.stdout and "Hub" in out.stdout


def test_tokenizer_loading_matches_transformers(tmp_path: Path, chatml_tok: Tokenizer) -> None:
    # tokenizer.json with truncation baked in, a special token only tokenizer_config knows, split_special_tokens
    chatml_tok.enable_truncation(max_length=4)
    tokens = {"eos_token": "<|im_end|>", "sep_token": "<|sep|>"}
    conv = CONVERSATIONS["system_multi_turn"]
    for extra in ({}, {"split_special_tokens": True}):
        folder = builders.write_model(tmp_path / f"m{len(extra)}", chatml_tok, tokens,
                                      builders.family_template("chatml") + "{{ sep_token }}", extra_config=extra)
        template, tok = load_template(folder), load_tokenizer(folder)
        hf = AutoTokenizer.from_pretrained(str(folder))
        assert compare(template, tok, hf, conv, True) == "equal"
        ids = encode(tok, template.render(conv))
        assert len(ids) > 4
        assert (tok.token_to_id("<|sep|>") in ids) is not bool(extra)


def test_generation_prompt_helpers_match_transformers(tmp_path: Path) -> None:
    folder = builders.family_model(tmp_path / "llama3", "llama3")
    template, tok = load_template(folder), load_tokenizer(folder)
    hf = AutoTokenizer.from_pretrained(str(folder))
    conv = CONVERSATIONS["system_multi_turn"]
    assert render_generation_prompt(template, conv, **DATE) == hf.apply_chat_template(
        conv, tokenize=False, add_generation_prompt=True, **DATE)
    assert encode_generation_prompt(template, tok, conv, **DATE) == list(hf.apply_chat_template(
        conv, tokenize=True, return_dict=False, add_generation_prompt=True, **DATE))


def test_legacy_special_tokens_map_and_added_tokens_decoder(tmp_path: Path, chatml_tok: Tokenizer) -> None:
    template = "{{ bos_token }}" + builders.family_template("chatml_clean") + "{{ '<|tool|>' }}"
    conv = CONVERSATIONS["multi_turn_no_system"]
    # No added_tokens_decoder: special_tokens_map.json supplies the bos token (transformers' legacy path).
    legacy = builders.write_model(tmp_path / "legacy", chatml_tok, {"eos_token": "<|im_end|>"}, template)
    (legacy / "special_tokens_map.json").write_text(json.dumps({"bos_token": "<|endoftext|>"}))
    # added_tokens_decoder names a token tokenizer.json lacks: it is added, as transformers adds it on load.
    n = chatml_tok.get_vocab_size()
    decoder = {str(n): {"content": "<|tool|>", "special": True, "lstrip": False, "rstrip": False,
                        "normalized": False, "single_word": False}}
    tokens = {"eos_token": "<|im_end|>", "bos_token": "<|endoftext|>"}
    added = builders.write_model(tmp_path / "added", chatml_tok, tokens, template,
                                 extra_config={"added_tokens_decoder": decoder})
    for folder in (legacy, added):
        ours, tok = load_template(folder), load_tokenizer(folder)
        assert ours.special_tokens["bos_token"] == "<|endoftext|>"
        assert compare(ours, tok, AutoTokenizer.from_pretrained(str(folder)), conv, True) == "equal"
    assert load_tokenizer(added).token_to_id("<|tool|>") == n
    assert load_tokenizer(legacy).token_to_id("<|tool|>") is None
