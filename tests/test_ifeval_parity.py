"""Parity with Google's IFEval reference scorer on its 541 GPT-4 responses (shared/data/ifeval)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from orpo.eval.ifeval import REGISTRY, evaluate, read_inputs, read_responses, score_files, summarize

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "ifeval"
INPUTS = DATA / "input_data_gpt4_20231107_145030.jsonl"
RESPONSES = DATA / "input_response_data_gpt4_20231107_145030.jsonl"


def _reference(mode: str) -> list[dict]:
    with open(DATA / f"gpt4_eval_results_{mode}.jsonl", encoding="utf-8") as f:
        return [json.loads(line) for line in f]


@pytest.fixture(scope="module")
def inputs() -> list[dict]:
    assert INPUTS.exists(), f"IFEval reference data not found at {DATA}"
    return read_inputs(INPUTS)


@pytest.fixture(scope="module")
def responses() -> dict[str, str]:
    return read_responses(RESPONSES)


@pytest.fixture(scope="module")
def results(inputs, responses) -> dict[str, list[dict]]:
    return {mode: evaluate(inputs, responses, mode) for mode in ("strict", "loose")}


@pytest.fixture(scope="module")
def reference_summary() -> dict:
    return json.loads((DATA / "gpt4_summary.json").read_text(encoding="utf-8"))


def test_registry_covers_the_reference_instruction_ids(reference_summary):
    assert sorted(REGISTRY) == sorted(reference_summary["strict"]["by_instruction"])
    assert len(REGISTRY) == 25


@pytest.mark.parametrize("mode", ["strict", "loose"])
def test_every_instruction_matches_the_reference(mode, inputs, results):
    reference = _reference(mode)
    ours = results[mode]
    assert len(ours) == len(reference) == 541
    mismatches = []
    for inp, got, want in zip(inputs, ours, reference, strict=True):
        assert got["prompt"] == want["prompt"]
        assert got["instruction_id_list"] == want["instruction_id_list"]
        assert got["response"] == want["response"]
        if got["follow_instruction_list"] != want["follow_instruction_list"]:
            mismatches.append(
                (
                    inp["key"],
                    got["instruction_id_list"],
                    got["follow_instruction_list"],
                    want["follow_instruction_list"],
                )
            )
        assert got["follow_all_instructions"] == want["follow_all_instructions"]
    assert mismatches == []


def test_summary_matches_the_reference(results, reference_summary):
    summary = summarize(results["strict"], results["loose"])
    assert summary["prompts"] == 541
    assert summary["instructions"] == 834
    assert summary["prompt_level_strict_acc"] == reference_summary["strict"]["prompt_level_accuracy"]
    assert summary["inst_level_strict_acc"] == reference_summary["strict"]["instruction_level_accuracy"]
    assert summary["prompt_level_loose_acc"] == reference_summary["loose"]["prompt_level_accuracy"]
    assert summary["inst_level_loose_acc"] == reference_summary["loose"]["instruction_level_accuracy"]
    for mode in ("strict", "loose"):
        for field, value in reference_summary[mode].items():
            assert summary[mode][field] == value, (mode, field)


def test_score_files_writes_reference_results(tmp_path, results):
    summary = score_files(INPUTS, RESPONSES, tmp_path / "out")
    for mode in ("strict", "loose"):
        with open(tmp_path / "out" / f"eval_results_{mode}.jsonl", encoding="utf-8") as f:
            written = [json.loads(line) for line in f]
        assert written == results[mode]
        assert [list(row) for row in written[:1]] == [
            ["follow_all_instructions", "follow_instruction_list", "instruction_id_list", "prompt", "response"]
        ]
        assert [r["follow_instruction_list"] for r in written] == [
            r["follow_instruction_list"] for r in _reference(mode)
        ]
    assert json.loads((tmp_path / "out" / "summary.json").read_text(encoding="utf-8")) == summary
    assert summary["prompt_level_strict_acc"] == 417 / 541
    assert summary["inst_level_loose_acc"] == 714 / 834
