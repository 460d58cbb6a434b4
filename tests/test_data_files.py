"""Committed data files are exactly what their documented commands regenerate."""

from pathlib import Path

from orpo.data.synth import write_eval_prompts
from orpo.eval.ifeval import read_inputs

ROOT = Path(__file__).resolve().parents[1]


def test_embedded_eval_prompts_regenerate_byte_for_byte(tmp_path):
    committed = ROOT / "data" / "eval" / "ifeval_prompts.jsonl"
    assert write_eval_prompts(tmp_path / "p.jsonl", 300, 0) == 300
    assert (tmp_path / "p.jsonl").read_bytes() == committed.read_bytes()


def test_embedded_eval_prompts_are_valid_ifeval_inputs():
    rows = read_inputs(ROOT / "data" / "eval" / "ifeval_prompts.jsonl")
    assert len(rows) == 300
    assert len({r["prompt"] for r in rows}) == 300
    assert sum(len(r["instruction_id_list"]) for r in rows) > 300
