"""Preference rows -> token ids with a score mask (the render stage core).

Per row, with the model's chat template T and its tokenizer:
  prompt text P = T(prompt, add_generation_prompt=True)                 what generation feeds the model
  full text   F = T(prompt + [assistant: response], add_generation_prompt=False), for chosen and rejected
  response      = F[len(P):], the template's continuation: content, end-of-turn token, trailing template text.

Decisions (see the functions for details):
- Prefix mismatch (P is not a prefix of F): the training sequence stays F; the seam moves to the longest
  common prefix of P and both F's (TRL's choice), moved back so it never enters the response content nor
  splits a special token. Counted (`prompt_prefix_mismatch`).
- Seam merges (F's tokens cross the seam): prompt_ids = tokens of P; the response is tokenized on its own
  after an anchoring special token. Counted (`seam_merges`).
- Mask: 1 from the seam through the first special token after the content (the end-of-turn token);
  0 for template text after it. After a prefix mismatch the mask starts at the content.
- BOS (`add_bos`): the ids the tokenizer's post-processor puts before a text (auto), the BOS token (true) or
  none (false) start the prompt, unless the template wrote them already (never a second BOS).
- Length (`over_length`): drop = the prompt is left-truncated (a leading BOS kept); responses are never cut;
  a row whose longer response leaves no room for a prompt token is dropped (`response_too_long`).
  truncate = the ORPO authors' code: a row whose prompt is over max_prompt_length is dropped
  (`prompt_too_long`; they filter prompts by length, they never cut one), then prompt + response is
  right-truncated to max_length (`truncated_responses`), as `tokenizer(text, max_length, truncation=True)`.
- Degenerate rows are dropped and counted: nothing before the response (`empty_prompt`), no response token
  (`nothing_to_score`), chosen and rejected rendered to the same tokens (`identical_responses`). Drops and a
  response text the rendering does not contain (`content_not_located`) are printed as warnings; a render
  that leaves no training pair fails.
"""

from __future__ import annotations

import json
import os
import re
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import polars as pl
from tokenizers import Tokenizer

from orpo.folders import mark_complete
from orpo.io import InputError, atomic_path, sha256_file, write_json, write_text
from orpo.render.settings import RenderSettings, resolve_prompting, resolve_settings
from orpo.render.template import (
    ChatTemplate,
    ChatTemplateError,
    calls_strftime_now,
    encode,
    leading_ids,
    resolve_model_dir,
    with_leading,
)
from orpo.settings import as_dict

SPLITS = ("train", "validation")
# Stands in for the response to find where the template puts content; private-use characters, no whitespace,
# so no template trims or splits it.
SENTINEL = "\U000f5e00orpo\U000f5e01"
EXAMPLES = 5
CHUNK = 256

OUTPUT_SCHEMA = {
    "id": pl.String, "prompt_ids": pl.List(pl.Int32), "chosen_ids": pl.List(pl.Int32),
    "rejected_ids": pl.List(pl.Int32), "chosen_mask": pl.List(pl.Int8), "rejected_mask": pl.List(pl.Int8),
    "prompt_len": pl.Int32, "chosen_len": pl.Int32, "rejected_len": pl.Int32,
}


# ---------------------------------------------------------------------------------------------------
# One row


@dataclass
class Response:
    """One tokenized response: ids after the prompt, 1 = scored, and how it was obtained."""

    ids: list[int]
    mask: list[int]
    seam_merged: bool = False  # the full string's tokens crossed the seam; re-tokenized separately
    located: bool = True  # the response content was found in the rendered text
    ended: bool = True  # an end-of-turn (special) token follows the content
    cut: bool = False  # right-truncated to the length limit (over_length: truncate)


@dataclass
class EncodedPair:
    """A rendered, tokenized preference row (before length handling)."""

    id: str
    prompt_ids: list[int]
    chosen: Response
    rejected: Response
    prompt_text: str
    prefix_mismatch: bool = False  # the generation prompt is not a prefix of the full render
    truncated: bool = False


@dataclass
class _Rendered:
    id: str
    cut: int  # where the prompt ends in each full text
    fulls: tuple[str, str]
    spans: tuple[tuple[int, int] | None, tuple[int, int] | None]  # content span in each full text
    prefix_mismatch: bool


class PairEncoder:
    """Renders and tokenizes preference rows with one template and tokenizer."""

    def __init__(self, template: ChatTemplate, tokenizer: Tokenizer, template_kwargs: Mapping[str, Any] | None = None,
                 lead: Sequence[int] | None = None):
        """`lead`: the ids every prompt starts with (Prompting.lead); None: the tokenizer's own (add_bos auto)."""
        self.template, self.tokenizer = template, tokenizer
        self.kwargs = dict(template_kwargs or {})
        # Control tokens: special added tokens, the named special tokens, and (transformers' heuristic for
        # control tokens) non-special added tokens that the template writes literally.
        specials = {t.content for t in tokenizer.get_added_tokens_decoder().values()
                    if t.special or (t.content in template.text and not t.content.isspace())}
        specials |= {v for v in template.special_tokens.values() if v}
        self.special_strings = sorted(specials, key=len, reverse=True)
        self._special_re = re.compile("|".join(map(re.escape, self.special_strings)) or "(?!)")
        bos = template.special_tokens.get("bos_token")
        self.bos_id = tokenizer.token_to_id(bos) if bos else None
        self.lead = list(leading_ids(tokenizer, template, "auto") if lead is None else lead)
        if len(self.lead) == 1:  # what left-truncation keeps first
            self.bos_id = self.lead[0]
        self._newline_ids = encode(tokenizer, "\n")
        self._anchor = self._pick_anchor()

    # -- rendering -----------------------------------------------------------------------------------

    def _render(self, row_id: str, messages: list[dict], generation: bool) -> str:
        try:
            return self.template.render(messages, add_generation_prompt=generation, **self.kwargs)
        except ChatTemplateError as e:
            raise ChatTemplateError(e.source, e.reason, row_id=row_id) from e.__cause__

    def render(self, row_id: str, prompt: list[dict], chosen: str, rejected: str) -> _Rendered:
        """Render one row's texts and decide the prompt/response seam (no tokenization)."""
        p = self._render(row_id, prompt, True)
        fulls = tuple(self._render(row_id, prompt + [{"role": "assistant", "content": r}], False)
                      for r in (chosen, rejected))
        try:
            frame = self._render(row_id, prompt + [{"role": "assistant", "content": SENTINEL}], False)
        except ChatTemplateError:  # a template that inspects content may refuse the stand-in: search instead
            frame = ""
        at = frame.find(SENTINEL)
        pre, post = (frame[:at], frame[at + len(SENTINEL):]) if at >= 0 else (None, None)
        spans = tuple(_content_span(f, r, pre, post) for f, r in zip(fulls, (chosen, rejected)))
        if all(f.startswith(p) for f in fulls):
            return _Rendered(row_id, len(p), fulls, spans, False)
        # The template renders the turn before the response differently with and without a following
        # assistant message. The training sequence stays the full render (the template's own picture of a
        # finished conversation); the prompt is its longest prefix shared with the generation prompt and both
        # full renders, never reaching into response content nor splitting a special token.
        cut = len(os.path.commonprefix([p, *fulls]))
        cut = min([cut] + [s[0] for s in spans if s is not None])
        cut = self._safe_cut(fulls[0], cut)
        return _Rendered(row_id, cut, fulls, spans, True)

    def _safe_cut(self, text: str, cut: int) -> int:
        moved = True
        while moved:
            moved = False
            for s in self.special_strings:
                for start in range(max(0, cut - len(s) + 1), cut):
                    if text.startswith(s, start):
                        cut, moved = start, True
                        break
        return cut

    # -- tokenization --------------------------------------------------------------------------------

    def encode(self, row_id: str, prompt: list[dict], chosen: str, rejected: str) -> EncodedPair:
        """Render and tokenize one row."""
        return self.encode_many([(row_id, prompt, chosen, rejected)])[0]

    def encode_many(self, rows: Iterable[tuple[str, list[dict], str, str]]) -> list[EncodedPair]:
        """Render and tokenize rows; tokenization is batched (the tokenizer runs it in parallel)."""
        rendered = [self.render(*row) for row in rows]
        texts = [t for r in rendered for t in (r.fulls[0][: r.cut], *r.fulls)]
        encs = self.tokenizer.encode_batch(texts, add_special_tokens=False) if texts else []
        out = []
        for i, r in enumerate(rendered):
            prompt_enc, *full_encs = encs[3 * i: 3 * i + 3]
            prompt_ids = prompt_enc.ids
            sides = [self._response(prompt_ids, r.cut, f, enc, span, not r.prefix_mismatch)
                     for f, enc, span in zip(r.fulls, full_encs, r.spans)]
            # The leading ids go before the prompt only now: the seam above is found in the template's own tokens.
            out.append(EncodedPair(r.id, with_leading(prompt_ids, self.lead), sides[0], sides[1], r.fulls[0][: r.cut],
                                   prefix_mismatch=r.prefix_mismatch))
        return out

    def _response(self, prompt_ids: list[int], cut: int, full: str, enc: Any,
                  span: tuple[int, int] | None, from_seam: bool) -> Response:
        n = len(prompt_ids)
        cont = full[cut:]
        if enc.ids[:n] == prompt_ids:
            # The usual case: the full string's own tokens, split at the seam.
            ids, offsets, merged = enc.ids[n:], [(s - cut, e - cut) for s, e in enc.offsets[n:]], False
        else:
            # Tokens merge across the seam (e.g. the prompt's trailing "\n" with the response's first
            # characters). Generation feeds exactly prompt_ids, so the response is tokenized on its own
            # and appended: prompt_ids stay a prefix, and the response tokens decode to the same text.
            ids, offsets = self._encode_continuation(cont)
            merged = True
        rel = None if span is None else (max(0, span[0] - cut), max(0, span[1] - cut))
        mask, ended = self._mask(offsets, cont, rel, from_seam)
        return Response(list(ids), mask, seam_merged=merged, located=span is not None, ended=ended)

    def _pick_anchor(self) -> tuple[str, int] | None:
        # A special token to encode a continuation after: added tokens are split off before the model runs,
        # so nothing merges with it, and the text after it is a fresh segment (no SentencePiece "first"
        # prefix space), exactly as text after a special token inside a rendered chat.
        if self.tokenizer.encode_special_tokens:
            return None
        eos = self.template.special_tokens.get("eos_token")
        for text in ([eos] if eos else []) + self.special_strings:
            ids = encode(self.tokenizer, text)
            if len(ids) == 1:
                return text, ids[0]
        return None

    def _encode_continuation(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """Tokenize a response on its own, as if it started a segment; offsets relative to `text`."""
        if self._anchor is not None:
            anchor, anchor_id = self._anchor
            enc = self.tokenizer.encode(anchor + text, add_special_tokens=False)
            if enc.ids[:1] == [anchor_id]:
                k = len(anchor)
                return enc.ids[1:], [(max(0, s - k), max(0, e - k)) for s, e in enc.offsets[1:]]
        # No usable special token: after a "\n" that is then removed (transformers' trick for the same
        # problem), else plain.
        nl = self._newline_ids
        enc = self.tokenizer.encode("\n" + text, add_special_tokens=False)
        if nl and enc.ids[: len(nl)] == nl:
            return enc.ids[len(nl):], [(max(0, s - 1), max(0, e - 1)) for s, e in enc.offsets[len(nl):]]
        enc = self.tokenizer.encode(text, add_special_tokens=False)
        return enc.ids, list(enc.offsets)

    def _mask(self, offsets: list[tuple[int, int]], cont: str, span: tuple[int, int] | None,
              from_seam: bool) -> tuple[list[int], bool]:
        # Scored: every token the model has to generate after the prompt, through the end-of-turn token,
        # i.e. the characters from the seam (or, after a prefix mismatch, from where the response content
        # starts: the text before it is then template text, possibly a whole user turn) to the end of the
        # first special token after the response content. Template text after that token (ChatML's "\n", a
        # second header) is never generated, so never scored. Without an end-of-turn token, everything up
        # to the last non-whitespace character is scored. A token is scored when it overlaps that range.
        content_start, content_end = span if span is not None else (0, 0)
        start = 0 if from_seam else content_start
        m = self._special_re.search(cont, content_end)
        ended = m is not None
        stop = m.end() if ended else max(content_end, len(cont.rstrip()))
        mask = []
        for s, e in offsets:
            hit = (s < stop and e > start) if e > s else (start <= s < stop)
            mask.append(1 if hit else 0)
        return mask, ended


def _content_span(full: str, response: str, pre: str | None, post: str | None) -> tuple[int, int] | None:
    """Where the response content sits in the full render, or None when it can't be told."""
    if pre is not None and post is not None and len(pre) + len(post) <= len(full) \
            and full.startswith(pre) and full.endswith(post):
        return len(pre), len(full) - len(post)
    for needle in (response, response.strip()):
        if needle and (at := full.rfind(needle)) >= 0:
            return at, at + len(needle)
    return None


# ---------------------------------------------------------------------------------------------------
# Length


def fit_length(pair: EncodedPair, max_length: int, max_prompt_length: int, bos_id: int | None = None,
               over_length: str = "drop") -> str | None:
    """Fit the pair to the limits in place (`over_length` says how); return a drop reason when it can't.

    drop: both responses stay whole and share the prompt; the prompt keeps its end (the latest turns and the
    generation header) and its leading BOS token (the model expects it first) when at least one more
    prompt token fits. A row is dropped as `response_too_long` when the longer response leaves no room
    for a single prompt token (it is never trained with a cut response or without a prompt).
    truncate (the ORPO authors' code): a prompt over max_prompt_length drops the row (`prompt_too_long`);
    otherwise each response is cut so prompt + response is at most max_length tokens, its mask with it.
    """
    if over_length == "truncate":
        if len(pair.prompt_ids) > max_prompt_length:
            return "prompt_too_long"
        room = max(0, max_length - len(pair.prompt_ids))
        for side in (pair.chosen, pair.rejected):
            if len(side.ids) > room:
                side.ids, side.mask, side.cut = side.ids[:room], side.mask[:room], True
        return None
    longest = max(len(pair.chosen.ids), len(pair.rejected.ids))
    budget = min(max_prompt_length, max_length - longest)
    if budget < 1:
        return "response_too_long"
    if len(pair.prompt_ids) > budget:
        head = 1 if bos_id is not None and pair.prompt_ids[:1] == [bos_id] and budget > 1 else 0
        keep = budget - head
        pair.prompt_ids = pair.prompt_ids[:head] + pair.prompt_ids[len(pair.prompt_ids) - keep:]
        pair.truncated = True
    return None


# ---------------------------------------------------------------------------------------------------
# The stage


class _Tally:
    def __init__(self) -> None:
        self.counts: dict[str, dict] = {}

    def add(self, reason: str, row_id: str) -> None:
        entry = self.counts.setdefault(reason, {"count": 0, "examples": []})
        entry["count"] += 1
        if len(entry["examples"]) < EXAMPLES:
            entry["examples"].append(row_id)

    def get(self, reason: str) -> dict:
        return self.counts.get(reason, {"count": 0, "examples": []})

    def total(self) -> int:
        return sum(v["count"] for v in self.counts.values())


def _read_split(path: Path) -> list[tuple[str, list[dict], str, str]]:
    if not path.exists():
        raise InputError(path, None, None, "missing (the curate stage writes train.parquet and validation.parquet)")
    schema = pl.scan_parquet(path).collect_schema()
    missing = [c for c in ("id", "prompt", "chosen", "rejected") if c not in schema]
    if missing:
        raise InputError(path, None, None, f"missing columns {missing}")
    rows = []
    df = pl.read_parquet(path, columns=["id", "prompt", "chosen", "rejected"])
    for n, row in enumerate(df.iter_rows(named=True), start=1):
        row_id = row["id"]
        if not isinstance(row_id, str) or not row_id:
            raise InputError(path, n, "id", f"row {n}: expected a non-empty string, got {row_id!r}")
        prompt = row["prompt"]
        if not isinstance(prompt, list) or not prompt:
            raise InputError(path, n, "prompt", f"row {row_id!r}: expected a non-empty list of messages")
        for m in prompt:
            if not (isinstance(m, dict) and isinstance(m.get("role"), str)
                    and isinstance(m.get("content"), (str, list))):
                raise InputError(path, n, "prompt", f"row {row_id!r}: each message needs a role and content")
        for key in ("chosen", "rejected"):
            if not isinstance(row[key], str):
                raise InputError(path, n, key, f"row {row_id!r}: expected a string, got {type(row[key]).__name__}")
        rows.append((row_id, prompt, row["chosen"], row["rejected"]))
    return rows


def _vocab_size(model_dir: Path) -> int | None:
    path = model_dir / "config.json"
    if not path.exists():
        return None
    config = json.loads(path.read_text(encoding="utf-8"))
    size = config.get("vocab_size") or (config.get("text_config") or {}).get("vocab_size")
    return size if isinstance(size, int) else None


def _sample(pair: EncodedPair, tokenizer: Tokenizer, index: int) -> str:
    def show(ids: list[int]) -> str:
        return tokenizer.decode(ids, skip_special_tokens=False) if ids else ""

    notes = (" (left-truncated)" if pair.truncated else "") + (
        " (response right-truncated)" if pair.chosen.cut or pair.rejected.cut else "") + (
        "  PROMPT PREFIX MISMATCH" if pair.prefix_mismatch else "")
    lines = [f"#### {index}  id={pair.id}  prompt_len={len(pair.prompt_ids)}{notes}",
             "[prompt]", show(pair.prompt_ids) + "⟦SEAM⟧"]
    for name, r in (("chosen", pair.chosen), ("rejected", pair.rejected)):
        on = [i for i, m in enumerate(r.mask) if m]
        a, b = (on[0], on[-1] + 1) if on else (len(r.ids), len(r.ids))
        flags = [f for f, bad in (("seam merge", r.seam_merged), ("content not located", not r.located),
                                   ("no end-of-turn token", not r.ended)) if bad]
        head = f"[{name}] {len(r.ids)} tokens, {sum(r.mask)} scored (inside «»)"
        tokens = " ".join(f"{tokenizer.id_to_token(t)!r}{'*' if m else ''}" for t, m in zip(r.ids, r.mask))
        lines += [head + ("; " + ", ".join(flags) if flags else ""),
                  "⟦SEAM⟧" + show(r.ids[:a]) + "«" + show(r.ids[a:b]) + "»" + show(r.ids[b:]),
                  "tokens: " + tokens]
    return "\n".join(lines) + "\n"


def _drop_reason(pair: EncodedPair, s: RenderSettings, bos_id: int | None) -> str | None:
    """Fit the row to the length limits; the reason it can't be used, if any."""
    reason = fit_length(pair, s.max_length, s.max_prompt_length, bos_id, s.over_length)
    if reason is None and not pair.prompt_ids:
        reason = "empty_prompt"  # the template rendered nothing before the response
    if reason is None and not (any(pair.chosen.mask) and any(pair.rejected.mask)):
        reason = "nothing_to_score"  # the template rendered no response tokens
    if reason is None and pair.chosen.ids == pair.rejected.ids:
        # Nothing to prefer: a template that drops the assistant's content renders every pair so.
        reason = "identical_responses"
    return reason


def _write_split(path: Path, pairs: list[EncodedPair]) -> None:
    frame = pl.DataFrame({
        "id": [p.id for p in pairs],
        "prompt_ids": [p.prompt_ids for p in pairs],
        "chosen_ids": [p.chosen.ids for p in pairs],
        "rejected_ids": [p.rejected.ids for p in pairs],
        "chosen_mask": [p.chosen.mask for p in pairs],
        "rejected_mask": [p.rejected.mask for p in pairs],
        "prompt_len": [len(p.prompt_ids) for p in pairs],
        "chosen_len": [len(p.chosen.ids) for p in pairs],
        "rejected_len": [len(p.rejected.ids) for p in pairs],
    }, schema=OUTPUT_SCHEMA)
    with atomic_path(path) as tmp:
        frame.write_parquet(tmp)


def render_pairs(model_dir: str | os.PathLike, curated_dir: str | os.PathLike, out_dir: str | os.PathLike,
                 settings: RenderSettings | Mapping[str, Any] | None = None) -> dict:
    """Render curated preference pairs into token ids and score masks; write the rendered artifact.

    Writes `train.parquet`, `validation.parquet`, `samples.txt`, `manifest.json` under `out_dir` and
    returns the manifest. `settings`: the render section (RenderSettings, or a mapping built as the command line
    builds it); the manifest records them as given and, under `resolved`, what add_bos and date were decided to.
    """
    s = resolve_settings(settings)
    model_path = resolve_model_dir(model_dir)
    prompting = resolve_prompting(model_path, s.prompt)
    template, tokenizer = prompting.template, prompting.tokenizer
    encoder = PairEncoder(template, tokenizer, prompting.template_kwargs, prompting.lead)
    vocab_size = _vocab_size(model_path)
    curated, out = Path(curated_dir), Path(out_dir)

    dropped, stats = _Tally(), _Tally()
    splits: dict[str, dict] = {}
    outputs: dict[str, list[EncodedPair]] = {}
    lengths: dict[str, list[int]] = {"prompt": [], "chosen": [], "rejected": []}
    for split in SPLITS:
        rows = _read_split(curated / f"{split}.parquet")
        split_dropped, kept = _Tally(), []
        for start in range(0, len(rows), CHUNK):
            for pair in encoder.encode_many(rows[start: start + CHUNK]):
                reason = _drop_reason(pair, s, encoder.bos_id)
                if reason is not None:
                    dropped.add(reason, pair.id)
                    split_dropped.add(reason, pair.id)
                    continue
                sides = (pair.chosen, pair.rejected)
                for flag, bad in (("seam_merges", any(s.seam_merged for s in sides)),
                                  ("prompt_prefix_mismatch", pair.prefix_mismatch),
                                  ("truncated_prompts", pair.truncated),
                                  ("truncated_responses", any(s.cut for s in sides)),
                                  ("content_not_located", not all(s.located for s in sides)),
                                  ("no_end_of_turn", not all(s.ended for s in sides))):
                    if bad:
                        stats.add(flag, pair.id)
                if vocab_size is not None:
                    top = max(pair.prompt_ids + pair.chosen.ids + pair.rejected.ids)
                    if top >= vocab_size:
                        raise ChatTemplateError(
                            template.source, f"token id {top} ({tokenizer.id_to_token(top)!r}) is outside the "
                            f"model's vocabulary (config.json vocab_size {vocab_size})", row_id=pair.id)
                kept.append(pair)
                for key, ids in (("prompt", pair.prompt_ids), ("chosen", pair.chosen.ids),
                                 ("rejected", pair.rejected.ids)):
                    lengths[key].append(len(ids))
        outputs[split] = kept
        splits[split] = {"input_rows": len(rows), "output_rows": len(kept), "dropped": split_dropped.counts}

    input_rows = sum(s["input_rows"] for s in splits.values())
    warnings, notes = [], []
    dated = prompting.date is not None
    if dated and s.date is None:
        warnings.append(f"the template calls strftime_now and render.date is null: rendered text holds today's "
                        f"date ({prompting.date}), so this render changes with the day; set render.date "
                        "(YYYY-MM-DD) to pin it")
    elif dated:
        notes.append(f"the template calls strftime_now: it prints render.date {s.date}, not today's date")
    if stats.get("content_not_located")["count"]:
        warnings.append(f"{stats.get('content_not_located')['count']} pairs' response text was not found in the "
                        "template's rendering (does the template write the assistant's content?)")
    if dropped.total():
        warnings.append(f"dropped {dropped.total()} of {input_rows} pairs: "
                        + ", ".join(f"{k} {v['count']}" for k, v in sorted(dropped.counts.items())))
    for line in notes:
        print(f"orpo render: note: {line}", file=sys.stderr)
    for line in warnings:
        print(f"orpo render: warning: {line}", file=sys.stderr)
    if input_rows and not outputs["train"]:
        raise ValueError(f"render: no training pair left of {splits['train']['input_rows']} "
                         f"(dropped: {splits['train']['dropped']}); template {template.source}")
    manifest = {
        "input_rows": input_rows,
        "output_rows": sum(s["output_rows"] for s in splits.values()),
        "dropped": dropped.counts,
        "splits": splits,
        **{k: stats.get(k) for k in ("seam_merges", "prompt_prefix_mismatch", "truncated_prompts",
                                     "truncated_responses", "content_not_located", "no_end_of_turn")},
        "tokens": {k: {"max": max(v, default=0), "mean": round(sum(v) / len(v), 2) if v else 0}
                   for k, v in lengths.items()},
        "template": {"source": template.source, "sha256": template.sha256,
                     "date": s.date if dated else None, "calls_strftime_now": calls_strftime_now(template)},
        "tokenizer": {"sha256": sha256_file(model_path / "tokenizer.json"), "vocab_size": vocab_size},
        "model": str(model_dir),
        "settings": as_dict(s),
        "resolved": prompting.record(),
        "warnings": warnings,
        "notes": notes,
    }
    assert manifest["input_rows"] == manifest["output_rows"] + dropped.total()
    picked = (outputs["train"] + outputs["validation"])[: s.samples]
    header = (f"# {len(picked)} rendered rows. ⟦SEAM⟧ = where the prompt ends; «» = scored tokens "
              f"(mask 1); token strings marked * are scored.\n# template: {template.source}\n\n")
    with atomic_path(out) as tmp:  # the folder whole or not at all (orpo.folders)
        tmp.mkdir()
        for split, pairs in outputs.items():
            _write_split(tmp / f"{split}.parquet", pairs)
        write_text(tmp / "samples.txt", header + "\n".join(_sample(p, tokenizer, i + 1) for i, p in enumerate(picked)))
        write_json(tmp / "manifest.json", manifest)
        mark_complete(tmp, "render")
    return manifest
