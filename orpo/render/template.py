"""Load a model's chat template and tokenizer, and render chats the way Hugging Face transformers does.

transformers (5.x, `utils/chat_template_utils.py`, `tokenization_utils_base.apply_chat_template`) is the
oracle; this module re-implements the parts that decide the rendered text and the token ids, without
importing it. Known, deliberate differences are listed in `ChatTemplate.render`.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

import jinja2
import jinja2.exceptions
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Tokenizer

# The named special tokens transformers always hands a template (its SPECIAL_TOKENS_ATTRIBUTES).
STANDARD_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# Files a render needs from a hub snapshot (weights are the base stage's business).
HUB_FILES = [
    "config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
    "chat_template.jinja", "chat_template.json", "additional_chat_templates/*.jinja",
]
# What training and generation need beyond the tokenizer (mlx-lm's own list, plus generation config).
WEIGHT_FILES = ["*.safetensors", "*.safetensors.index.json", "generation_config.json", "*.py", "*.tiktoken", "*.txt"]
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*/[\w.\-]+$")

if tuple(int(p) for p in jinja2.__version__.split(".")[:3] if p.isdigit()) < (3, 1, 6):
    # Older jinja2 has known sandbox escapes, and chat templates are untrusted code.
    raise ImportError(f"orpo.render needs jinja2>=3.1.6, found {jinja2.__version__}")


class ChatTemplateError(ValueError):
    """A chat template could not be loaded or rendered; the message names the template source (and row)."""

    def __init__(self, source: str, message: str, row_id: str | None = None):
        self.source, self.reason, self.row_id = source, message, row_id
        where = (f"row {row_id!r}: " if row_id is not None else "") + f"chat template {source}"
        super().__init__(f"{where}: {message}")


class TemplateRaised(jinja2.exceptions.TemplateError):
    """Raised by a template's own `raise_exception(message)`."""


class ModelSourceError(FileNotFoundError):
    """The model folder is missing, incomplete, or a hub id could not be fetched."""


# ---------------------------------------------------------------------------------------------------
# Model folder and hub ids


def resolve_model_dir(model: str | os.PathLike, weights: bool = False) -> Path:
    """Return a local folder for `model`: an existing path, or a hub id ("org/name") fetched when online.

    A hub id fetches the tokenizer and template files, and the config and weights too with `weights`.
    """
    path = Path(model).expanduser()
    if path.exists():
        if not path.is_dir():
            raise ModelSourceError(f"model {str(model)!r}: not a folder")
        return path
    text = str(model)
    if not _HUB_ID.match(text):
        raise ModelSourceError(f"model {text!r}: no such folder (and not a hub id of the form 'org/name')")
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(repo_id=text, allow_patterns=HUB_FILES + (WEIGHT_FILES if weights else [])))
    except Exception as e:  # offline, unknown repo, gated repo, ...: one clear message naming the id
        raise ModelSourceError(
            f"model {text!r}: not a local folder, and fetching it from the Hugging Face Hub failed "
            f"(offline or unknown id?): {type(e).__name__}: {e}"
        ) from e


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ModelSourceError(f"{path}: cannot read JSON ({e})") from e
    if not isinstance(data, dict):
        raise ModelSourceError(f"{path}: expected a JSON object")
    return data


def read_tokenizer_config(model_dir: Path) -> dict:
    """tokenizer_config.json of a model folder ({} when absent)."""
    path = model_dir / "tokenizer_config.json"
    return _read_json(path) if path.exists() else {}


def _token_str(value: Any) -> str | None:
    # Special tokens are saved as strings or AddedToken dicts ({"__type": "AddedToken", "content": ...}).
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def special_tokens_from_config(config: Mapping, model_dir: Path | None = None) -> dict[str, str]:
    """The named special tokens transformers passes to a template: bos/eos/unk/... and any other `*_token`."""
    config = dict(config)
    # Legacy special_tokens_map.json counts only when the config has no added_tokens_decoder (as in transformers).
    legacy = model_dir / "special_tokens_map.json" if model_dir is not None else None
    if legacy is not None and legacy.exists() and "added_tokens_decoder" not in config:
        config.update(_read_json(legacy))
    tokens: dict[str, str] = {}
    for key, value in config.items():
        if key.endswith("_token") and (text := _token_str(value)) is not None:
            tokens[key] = text
    named_extra = config.get("extra_special_tokens") or config.get("additional_special_tokens")
    if isinstance(named_extra, Mapping):
        tokens.update({k: t for k, v in named_extra.items() if (t := _token_str(v)) is not None})
    return tokens


# ---------------------------------------------------------------------------------------------------
# Template discovery


def find_templates(model_dir: Path, config: Mapping | None = None) -> dict[str, tuple[str, str]]:
    """All chat templates of a model folder: name -> (template text, source description).

    Precedence follows transformers: `chat_template.jinja` (+ `additional_chat_templates/*.jinja`) replace the
    `chat_template` entry of tokenizer_config.json (a string, or a list of {"name", "template"}).
    A processor-style `chat_template.json` is the last resort.
    """
    config = read_tokenizer_config(model_dir) if config is None else config
    found: dict[str, tuple[str, str]] = {}
    jinja_file = model_dir / "chat_template.jinja"
    if jinja_file.exists():
        found["default"] = (jinja_file.read_text(encoding="utf-8"), str(jinja_file))
    extra_dir = model_dir / "additional_chat_templates"
    if extra_dir.is_dir():
        for f in sorted(extra_dir.glob("*.jinja")):
            found[f.name.removesuffix(".jinja")] = (f.read_text(encoding="utf-8"), str(f))
    if found:
        return found
    cfg_path = model_dir / "tokenizer_config.json"
    entry = config.get("chat_template")
    if isinstance(entry, str):
        return {"default": (entry, f"{cfg_path}:chat_template")}
    if isinstance(entry, list):
        for i, item in enumerate(entry):
            if not (isinstance(item, Mapping) and isinstance(item.get("name"), str)
                    and isinstance(item.get("template"), str)):
                raise ChatTemplateError(f"{cfg_path}:chat_template[{i}]", "expected {'name': str, 'template': str}")
            found[item["name"]] = (item["template"], f"{cfg_path}:chat_template[{item['name']}]")
        return found
    processor_file = model_dir / "chat_template.json"
    if processor_file.exists() and isinstance(text := _read_json(processor_file).get("chat_template"), str):
        return {"default": (text, f"{processor_file}:chat_template")}
    return {}


def load_template(
    model: str | os.PathLike,
    override: str | os.PathLike | None = None,
    name: str | None = None,
) -> ChatTemplate:
    """Load the chat template of `model` (folder or hub id), or the `override` .jinja file with the model's tokens."""
    model_dir = resolve_model_dir(model)
    config = read_tokenizer_config(model_dir)
    tokens = special_tokens_from_config(config, model_dir)
    if override is not None:
        path = Path(override)
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as e:
            raise ChatTemplateError(str(path), f"cannot read the override template ({e})") from e
        return ChatTemplate(text, f"{path} (override)", tokens)
    templates = find_templates(model_dir, config)
    if not templates:
        raise ChatTemplateError(
            str(model_dir), "no chat template: no chat_template.jinja, no 'chat_template' in tokenizer_config.json; "
            "pass a template override file")
    chosen = name or "default"
    if chosen not in templates:
        raise ChatTemplateError(
            str(model_dir), f"no template named {chosen!r}; available: {sorted(templates)}")
    text, source = templates[chosen]
    return ChatTemplate(text, source, tokens)


# ---------------------------------------------------------------------------------------------------
# The jinja environment (transformers' semantics)


def _raise_exception(message: Any) -> None:
    raise TemplateRaised(str(message))


def _tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    # Jinja's own tojson HTML-escapes; transformers' is plain json.dumps with these options.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class _Dict:
    # `dict` in templates: construction and fromkeys only, no class attribute access.
    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _Namespace(jinja2.utils.Namespace):
    # Refuse underscore attributes, so a template cannot reach CPython internals through a namespace.
    def __init__(*args: Any, **kwargs: Any) -> None:
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for key in attrs:
            _Namespace._check(key)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, key: str, value: Any) -> None:
        _Namespace._check(key)
        jinja2.utils.Namespace.__setitem__(self, key, value)

    @staticmethod
    def _check(key: Any) -> None:
        if isinstance(key, str) and key.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"namespace attribute {key!r} starts with an underscore")


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (transformers' assistant-mask marker): renders its body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        # A call block, like transformers', so `set` inside keeps the same (inner) scope.
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Callable[[], str]) -> str:
        return caller()


class _MissingSpecialToken(jinja2.Undefined):
    # transformers prints "" for a special token the tokenizer lacks; we fail when one is printed or joined,
    # but keep `is defined`, `if tok` and `is none` working as they do there.
    def __str__(self) -> str:
        self._fail_with_undefined_error()
        return ""


@lru_cache(maxsize=64)
def _compile(text: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    env.globals["dict"] = _Dict()
    env.globals["namespace"] = _Namespace
    return env.from_string(text)


def template_variables(text: str) -> frozenset[str]:
    """Every name a template reads (variables, globals such as strftime_now, loop variables)."""
    ast = _compile(text).environment.parse(text)
    return frozenset(node.name for node in ast.find_all(jinja2.nodes.Name) if node.ctx == "load")


def _plain(value: Any) -> Any:
    # Templates only ever see JSON-like data (as in transformers): rich objects become "<TypeName>".
    if value is None or type(value) in (str, int, float, bool):
        return value
    for base in (str, bool, int, float):
        if isinstance(value, base):
            return base(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    if type(value).__module__ == "numpy" and callable(getattr(value, "item", None)):
        return _plain(value.item())
    return f"<{type(value).__name__}>"


_REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")


def _normalize_messages(messages: Any) -> list[dict]:
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError("messages must be a non-empty list of {'role', 'content'} dicts")
    out = []
    for message in _plain(list(messages)):
        if not isinstance(message, dict):
            raise TypeError(f"a message must be a dict, got {message!r}")
        message = {k: v for k, v in message.items() if v is not None}  # None keys are dropped, not printed
        reasoning = next((message[k] for k in _REASONING_KEYS if k in message), None)
        if reasoning is not None:  # one reasoning field, readable under every name templates use
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(message)
    return out


@dataclass(frozen=True)
class ChatTemplate:
    """A chat template with the special tokens it is rendered with, and where it came from."""

    text: str
    source: str
    special_tokens: Mapping[str, str] = field(default_factory=dict)
    clock: Callable[[], datetime] | None = None  # None: the real clock, as transformers' strftime_now

    def __post_init__(self) -> None:
        try:
            _compile(self.text)
        except jinja2.exceptions.TemplateSyntaxError as e:
            raise ChatTemplateError(self.source, f"template syntax error, line {e.lineno}: {e.message}") from e

    @property
    def sha256(self) -> str:
        """Hex sha256 of the template text (UTF-8)."""
        return hashlib.sha256(self.text.encode("utf-8")).hexdigest()

    @property
    def variables(self) -> frozenset[str]:
        """Every name the template reads."""
        return template_variables(self.text)

    def render(
        self,
        messages: list[dict],
        *,
        add_generation_prompt: bool = False,
        tools: list[dict] | None = None,
        documents: list[dict] | None = None,
        **kwargs: Any,
    ) -> str:
        """Render `messages` exactly as transformers' apply_chat_template(tokenize=False) would.

        Differences, on purpose: printing a standard special token the tokenizer config lacks raises
        (transformers prints ""); tools must be JSON schemas (no function-to-schema conversion);
        no continue_final_message.
        """
        try:
            chat = _normalize_messages(messages)
            for name, group in (("tools", tools), ("documents", documents)):
                if group is not None and not all(isinstance(x, Mapping) for x in group):
                    raise TypeError(f"{name} must be a list of dicts (JSON schemas / documents)")
            context: dict[str, Any] = {
                name: _MissingSpecialToken(
                    name=name, hint=f"the template prints '{name}', which the tokenizer config does not set")
                for name in STANDARD_SPECIAL_TOKENS
            }
            context.update(self.special_tokens)
            context.update(_plain(kwargs))  # caller's kwargs win over special tokens, as in transformers
            if self.clock is not None:
                clock = self.clock
                context["strftime_now"] = lambda fmt: clock().strftime(fmt)
            context.update(messages=chat, tools=_plain(tools), documents=_plain(documents),
                           add_generation_prompt=bool(add_generation_prompt))
            return _compile(self.text).render(**context)
        except ChatTemplateError:
            raise
        except TemplateRaised as e:
            raise ChatTemplateError(self.source, f"the template raised: {e.message}") from e
        except Exception as e:  # any jinja/sandbox/type error: same message shape, original chained
            raise ChatTemplateError(self.source, f"{type(e).__name__}: {e}") from e


def pin_date(template: ChatTemplate, date: str) -> ChatTemplate:
    """`template` with strftime_now reading `date` (YYYY-MM-DD, midnight) instead of the clock."""
    try:
        fixed = datetime.strptime(date, "%Y-%m-%d")
    except (TypeError, ValueError):
        raise ValueError(f"render settings: date must be YYYY-MM-DD or null, got {date!r}") from None
    return replace(template, clock=lambda: fixed)


def calls_strftime_now(template: ChatTemplate) -> bool:
    """Whether the template can print the date (it reads strftime_now)."""
    return "strftime_now" in template.variables


# ---------------------------------------------------------------------------------------------------
# Tokenizer


def load_tokenizer(model: str | os.PathLike) -> Tokenizer:
    """The model's `tokenizers` Tokenizer, set up as transformers sets up its fast tokenizer for chat encoding.

    No truncation or padding from tokenizer.json; special tokens named in tokenizer_config.json (and its
    added_tokens_decoder) that tokenizer.json lacks are added, as transformers adds them on load;
    `split_special_tokens` is honoured.
    """
    model_dir = resolve_model_dir(model)
    path = model_dir / "tokenizer.json"
    if not path.exists():
        raise ModelSourceError(f"{model_dir}: no tokenizer.json (only fast tokenizers are supported)")
    tok = Tokenizer.from_file(str(path))
    tok.no_truncation()
    tok.no_padding()
    config = read_tokenizer_config(model_dir)
    present = {t.content for t in tok.get_added_tokens_decoder().values()}
    decoder = config.get("added_tokens_decoder") or {}
    for _, spec in sorted(decoder.items(), key=lambda kv: int(kv[0])):
        if isinstance(spec, Mapping) and isinstance(spec.get("content"), str) and spec["content"] not in present:
            flags = {k: bool(spec[k]) for k in ("single_word", "lstrip", "rstrip", "normalized") if k in spec}
            added = AddedToken(spec["content"], special=bool(spec.get("special", False)), **flags)
            (tok.add_special_tokens if added.special else tok.add_tokens)([added])
            present.add(spec["content"])
    named = list(special_tokens_from_config(config, model_dir).values())
    extra = config.get("extra_special_tokens") or config.get("additional_special_tokens")
    if isinstance(extra, list):
        named += [t for v in extra if (t := _token_str(v)) is not None]
    for text in named:
        if text not in present:
            tok.add_special_tokens([AddedToken(text, special=True)])
            present.add(text)
    if config.get("split_special_tokens"):
        tok.encode_special_tokens = True
    return tok


def encode(tokenizer: Tokenizer, text: str) -> list[int]:
    """Token ids of rendered chat text: no special tokens added (the template wrote them), as transformers."""
    return tokenizer.encode(text, add_special_tokens=False).ids


def leading_ids(tokenizer: Tokenizer, template: ChatTemplate, add_bos: str | bool) -> list[int]:
    """The ids every rendered sequence must start with (`render.add_bos`), added unless the text already has them.

    auto: those `tokenizer(text)` puts before a text, i.e. its post-processor's (Mistral's and Llama 2's BOS;
    none for byte-level tokenizers without one), as the ORPO authors' code tokenizes; mlx-lm's generate adds
    them likewise unless the prompt starts with BOS. true: the BOS token (tokenizer_config's bos_token, else the
    post-processor's), whatever the post-processor does. false: none, the template's text only.
    """
    if add_bos is False:
        return []
    probe = "a"
    plain = tokenizer.encode(probe, add_special_tokens=False).ids
    processed = tokenizer.encode(probe, add_special_tokens=True).ids
    lead = next((processed[:k] for k in range(len(processed) - len(plain) + 1)
                 if processed[k: k + len(plain)] == plain), [])
    if add_bos == "auto":
        return lead
    bos = template.special_tokens.get("bos_token")
    bos_id = tokenizer.token_to_id(bos) if bos else None
    if bos_id is not None:
        return [bos_id]
    if lead:
        return lead
    raise ChatTemplateError(template.source, "render.add_bos is true, but the tokenizer names no BOS token "
                            "(bos_token in tokenizer_config.json) and its post-processor adds none; use auto or false")


def with_leading(ids: list[int], lead: list[int]) -> list[int]:
    """`ids` starting with `lead`: prepended unless already there (a template that writes BOS gets no second one)."""
    return list(ids) if ids[: len(lead)] == lead else list(lead) + list(ids)


def render_generation_prompt(template: ChatTemplate, messages: list[dict], **kwargs: Any) -> str:
    """The prompt text generation feeds the model: the same rendering as training's prompt side."""
    return template.render(messages, add_generation_prompt=True, **kwargs)


def encode_generation_prompt(
    template: ChatTemplate, tokenizer: Tokenizer, messages: list[dict], **kwargs: Any
) -> list[int]:
    """Token ids of the generation prompt: a training row's untruncated prompt_ids, unless the row's render
    had a prompt prefix mismatch (then training used a shorter prefix of this prompt)."""
    return encode(tokenizer, render_generation_prompt(template, messages, **kwargs))
