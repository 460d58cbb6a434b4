"""Read IFEval inputs and responses, score them strictly and loosely, summarise, write results."""

from __future__ import annotations

import functools
import os
from collections import defaultdict
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, Literal

from orpo.io import InputError, read_jsonl, write_json, write_jsonl

from .args import ArgumentError
from .instructions import REGISTRY, Checker, build_checker

Mode = Literal["strict", "loose"]
MODES: tuple[Mode, ...] = ("strict", "loose")


class MissingResponseError(ValueError):
    """An input prompt has no response."""


# Builds the error for one input row: (field, message) -> InputError naming where the row came from.
Locate = Callable[[str | None, str], InputError]


def _require(obj: dict, name: str, kind: type | tuple[type, ...], at: Locate) -> Any:
    if name not in obj:
        raise at(name, "missing")
    value = obj[name]
    if isinstance(value, bool) or not isinstance(value, kind):
        want = kind.__name__ if isinstance(kind, type) else "/".join(k.__name__ for k in kind)
        raise at(name, f"expected {want}, got {type(value).__name__}")
    return value


def check_input_row(obj: dict, at: Locate) -> dict:
    """One IFEval input row validated (known instruction ids, accepted kwargs); null kwargs dropped.

    Hub copies of IFEval store kwargs as one struct with every argument name, unused ones null; dropping
    them gives the reference's own rows (its checkers treat a missing argument and None alike).
    """
    key = _require(obj, "key", int, at)
    prompt = _require(obj, "prompt", str, at)
    ids = _require(obj, "instruction_id_list", list, at)
    kwargs = _require(obj, "kwargs", list, at)
    if len(kwargs) != len(ids):
        raise at("kwargs", f"has {len(kwargs)} entries for {len(ids)} instructions")
    for i, (inst, kw) in enumerate(zip(ids, kwargs, strict=True)):
        if not isinstance(inst, str) or inst not in REGISTRY:
            raise at(f"instruction_id_list[{i}]", f"unknown instruction id {inst!r}")
        try:
            build_checker(inst, kw, where=f"kwargs[{i}]")
        except ArgumentError as e:
            raise at(e.field, e.reason) from None
    kwargs = [{k: v for k, v in kw.items() if v is not None} for kw in kwargs]
    return {"key": key, "prompt": prompt, "instruction_id_list": ids, "kwargs": kwargs}


def check_inputs(rows: Iterable[tuple[str, Locate, dict]]) -> list[dict]:
    """Validate (where, locate, row) triples in order, keys unique; `where` ("line 3") names a row in messages."""
    out, first = [], {}
    for where, at, obj in rows:
        row = check_input_row(obj, at)
        if row["key"] in first:
            raise at("key", f"duplicate key {row['key']} (first on {first[row['key']]})")
        first[row["key"]] = where
        out.append(row)
    return out


def read_inputs(path: str | os.PathLike) -> list[dict]:
    """Read IFEval prompts (`key`, `prompt`, `instruction_id_list`, `kwargs`), validating every instruction."""
    return check_inputs((f"line {line}", functools.partial(InputError, path, line), obj)
                        for line, obj in read_jsonl(path))


def read_responses(path: str | os.PathLike) -> dict[str, str]:
    """Map prompt -> response from a jsonl of `prompt`, `response` (other fields ignored)."""
    out: dict[str, str] = {}
    first: dict[str, int] = {}
    for line, obj in read_jsonl(path):
        at = functools.partial(InputError, path, line)
        prompt = _require(obj, "prompt", str, at)
        response = _require(obj, "response", str, at)
        if prompt in out and out[prompt] != response:
            why = f"repeated with a different response (first on line {first[prompt]})"
            raise InputError(path, line, "prompt", why)
        out[prompt] = response
        first.setdefault(prompt, line)
    return out


def loose_variants(response: str) -> list[str]:
    """The eight versions loose mode tries: as is, without `*`, without first/last/both lines, and so on."""
    lines = response.split("\n")
    no_first = "\n".join(lines[1:]).strip()
    no_last = "\n".join(lines[:-1]).strip()
    no_both = "\n".join(lines[1:-1]).strip()
    variants = [response, response.replace("*", ""), no_first, no_last, no_both]
    return variants + [v.replace("*", "") for v in (no_first, no_last, no_both)]


def _followed(check: Checker, candidates: list[str]) -> bool:
    # A blank candidate never counts, as in the reference (it skips it before checking).
    return any(c.strip() and check(c) for c in candidates)


def evaluate(inputs: list[dict], responses: dict[str, str], mode: Mode) -> list[dict]:
    """Score each input's response: one reference-format result dict per input, in input order."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    results = []
    for inp in inputs:
        prompt = inp["prompt"]
        if prompt not in responses:
            raise MissingResponseError(f"no response for prompt key {inp['key']}: {prompt[:80]!r}")
        response = responses[prompt]
        candidates = [response] if mode == "strict" else loose_variants(response)
        follows = []
        for i, (inst, kw) in enumerate(zip(inp["instruction_id_list"], inp["kwargs"], strict=True)):
            try:
                check = build_checker(inst, kw, where=f"kwargs[{i}]")
            except ArgumentError as e:
                raise ValueError(f"prompt key {inp['key']}: {e}") from None
            follows.append(_followed(check, candidates))
        results.append(
            {
                "follow_all_instructions": all(follows),
                "follow_instruction_list": follows,
                "instruction_id_list": list(inp["instruction_id_list"]),
                "prompt": prompt,
                "response": response,
            }
        )
    return results


def _ratio(correct: int, total: int) -> dict[str, Any]:
    return {"correct": correct, "total": total, "accuracy": correct / total if total else None}


def breakdown(results: list[dict]) -> dict[str, Any]:
    """Prompt- and instruction-level counts and accuracies, per category and per instruction id."""
    if not results:
        raise ValueError("no results to summarise")
    by_id: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    by_cat: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for r in results:
        for inst, ok in zip(r["instruction_id_list"], r["follow_instruction_list"], strict=True):
            for table, name in ((by_id, inst), (by_cat, inst.split(":", 1)[0])):
                table[name][0] += bool(ok)
                table[name][1] += 1
    prompt_correct = sum(bool(r["follow_all_instructions"]) for r in results)
    inst_correct = sum(c for c, _ in by_id.values())
    inst_total = sum(t for _, t in by_id.values())
    return {
        "prompt_correct": prompt_correct,
        "prompt_total": len(results),
        "prompt_level_accuracy": prompt_correct / len(results),
        "instruction_correct": inst_correct,
        "instruction_total": inst_total,
        "instruction_level_accuracy": inst_correct / inst_total if inst_total else None,
        "by_category": {k: _ratio(*by_cat[k]) for k in sorted(by_cat)},
        "by_instruction": {k: _ratio(*by_id[k]) for k in sorted(by_id)},
    }


def check_paired(strict: list[dict], loose: list[dict]) -> None:
    """Raise ValueError unless strict and loose results cover the same prompts in the same order."""
    if len(strict) != len(loose) or any(s["prompt"] != lo["prompt"] for s, lo in zip(strict, loose, strict=True)):
        raise ValueError("strict and loose results must cover the same prompts in the same order")


def summarize(strict: list[dict], loose: list[dict]) -> dict[str, Any]:
    """The four IFEval metrics, prompt and instruction counts, and per-mode breakdowns."""
    check_paired(strict, loose)
    s, lo = breakdown(strict), breakdown(loose)
    return {
        "prompt_level_strict_acc": s["prompt_level_accuracy"],
        "inst_level_strict_acc": s["instruction_level_accuracy"],
        "prompt_level_loose_acc": lo["prompt_level_accuracy"],
        "inst_level_loose_acc": lo["instruction_level_accuracy"],
        "prompts": s["prompt_total"],
        "instructions": s["instruction_total"],
        "strict": s,
        "loose": lo,
    }


def score_to_dir(inputs: list[dict], responses: dict[str, str], out_dir: str | os.PathLike) -> tuple[list[dict], list[dict], dict]:
    """Score responses in both modes; write both result files and summary.json; return (strict, loose, summary)."""
    strict = evaluate(inputs, responses, "strict")
    loose = evaluate(inputs, responses, "loose")
    summary = summarize(strict, loose)
    out = Path(out_dir)
    write_jsonl(out / "eval_results_strict.jsonl", strict)
    write_jsonl(out / "eval_results_loose.jsonl", loose)
    write_json(out / "summary.json", summary)
    return strict, loose, summary


def score_files(inputs_path: str | os.PathLike, responses_path: str | os.PathLike, out_dir: str | os.PathLike) -> dict:
    """Score a responses file against an inputs file; write both result files and summary.json."""
    return score_to_dir(read_inputs(inputs_path), read_responses(responses_path), out_dir)[2]
