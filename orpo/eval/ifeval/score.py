"""Read IFEval inputs and responses, score them strictly and loosely, summarise, write results."""

from __future__ import annotations

import os
from collections import defaultdict
from pathlib import Path
from typing import Any, Literal

from orpo.io import InputError, read_jsonl, write_json, write_jsonl

from .args import ArgumentError
from .instructions import REGISTRY, Checker, build_checker

Mode = Literal["strict", "loose"]
MODES: tuple[Mode, ...] = ("strict", "loose")


class MissingResponseError(ValueError):
    """An input prompt has no response."""


def _require(obj: dict, name: str, kind: type | tuple[type, ...], path: Any, line: int) -> Any:
    if name not in obj:
        raise InputError(path, line, name, "missing")
    value = obj[name]
    if isinstance(value, bool) or not isinstance(value, kind):
        want = kind.__name__ if isinstance(kind, type) else "/".join(k.__name__ for k in kind)
        raise InputError(path, line, name, f"expected {want}, got {type(value).__name__}")
    return value


def read_inputs(path: str | os.PathLike) -> list[dict]:
    """Read IFEval prompts (`key`, `prompt`, `instruction_id_list`, `kwargs`), validating every instruction."""
    rows, keys = [], {}
    for line, obj in read_jsonl(path):
        key = _require(obj, "key", int, path, line)
        prompt = _require(obj, "prompt", str, path, line)
        ids = _require(obj, "instruction_id_list", list, path, line)
        kwargs = _require(obj, "kwargs", list, path, line)
        if key in keys:
            raise InputError(path, line, "key", f"duplicate key {key} (first on line {keys[key]})")
        keys[key] = line
        if len(kwargs) != len(ids):
            raise InputError(path, line, "kwargs", f"has {len(kwargs)} entries for {len(ids)} instructions")
        for i, (inst, kw) in enumerate(zip(ids, kwargs, strict=True)):
            if not isinstance(inst, str) or inst not in REGISTRY:
                raise InputError(path, line, f"instruction_id_list[{i}]", f"unknown instruction id {inst!r}")
            try:
                build_checker(inst, kw, where=f"kwargs[{i}]")
            except ArgumentError as e:
                raise InputError(path, line, e.field, e.reason) from None
        rows.append({"key": key, "prompt": prompt, "instruction_id_list": ids, "kwargs": kwargs})
    return rows


def read_responses(path: str | os.PathLike) -> dict[str, str]:
    """Map prompt -> response from a jsonl of `prompt`, `response` (other fields ignored)."""
    out: dict[str, str] = {}
    first: dict[str, int] = {}
    for line, obj in read_jsonl(path):
        prompt = _require(obj, "prompt", str, path, line)
        response = _require(obj, "response", str, path, line)
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
