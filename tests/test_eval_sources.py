"""Eval prompt sources: local jsonl, HF-style dataset folders (how hub ids are tested offline), hub ids.

The folders are built in tmp from the real files in shared/data in the hubs' column layouts: google/IFEval
(key, prompt, instruction_id_list, kwargs; the parquet copy fills unused kwargs with nulls) and
HuggingFaceH4/mt_bench_prompts (prompt = the list of turns, category, reference, prompt_id = a hash).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from conftest import ROOT, SHARED
from orpo.config import ConfigError, validate_config
from orpo.eval.ifeval import evaluate, read_inputs, read_responses
from orpo.eval.ifeval.source import load_inputs, write_inputs
from orpo.eval.judge.questions import load_questions, mt_bench_rows
from orpo.eval.sources import load_dataset_rows, parse_source
from orpo.io import InputError

IFEVAL = SHARED / "data" / "ifeval"
INPUTS = IFEVAL / "input_data_gpt4_20231107_145030.jsonl"
RESPONSES = IFEVAL / "input_response_data_gpt4_20231107_145030.jsonl"
MT_BENCH = SHARED / "data" / "mt_bench" / "question.jsonl"

CARD = """---
license: apache-2.0
configs:
- config_name: default
  data_files:
  - split: train
    path: data/train-*
---
# A local copy in the hub's layout, for tests.
"""


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def _parquet_folder(folder: Path, rows: list[dict]) -> Path:
    """A dataset folder as the hub's parquet conversion stores one: a card and data/train-*.parquet."""
    (folder / "data").mkdir(parents=True)
    (folder / "README.md").write_text(CARD)
    # Arrow infers one struct over every kwargs name, so unused arguments become nulls, as on the hub.
    pq.write_table(pa.Table.from_pylist(rows), folder / "data" / "train-00000-of-00001.parquet")
    return folder


@pytest.fixture(autouse=True)
def _datasets_cache(tmp_path_factory, monkeypatch):
    """Keep the datasets cache of folder loads out of the user's home."""
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path_factory.getbasetemp() / "hf_datasets"))


@pytest.fixture(scope="module")
def reference_inputs() -> list[dict]:
    return read_inputs(INPUTS)


@pytest.fixture(scope="module")
def ifeval_parquet(tmp_path_factory) -> Path:
    return _parquet_folder(tmp_path_factory.mktemp("google_IFEval_parquet"), _jsonl(INPUTS))


@pytest.fixture(scope="module")
def ifeval_jsonl(tmp_path_factory) -> Path:
    """The layout google/IFEval's repo has: a README card and ifeval_input_data.jsonl."""
    folder = tmp_path_factory.mktemp("google_IFEval_jsonl")
    (folder / "README.md").write_text("---\nlicense: apache-2.0\n---\n# IFEval\n")
    (folder / "ifeval_input_data.jsonl").write_bytes(INPUTS.read_bytes())
    return folder


def _h4_rows() -> list[dict]:
    """MT-Bench in HuggingFaceH4/mt_bench_prompts' columns (prompt_id as its README says it was made)."""
    def prompt_id(turns: list[str]) -> int:
        return int(hashlib.sha256("".join(turns).encode()).hexdigest(), 16) % 10**8

    return [{"prompt": q["turns"], "prompt_id": prompt_id(q["turns"]), "category": q["category"],
             "reference": q.get("reference", [])} for q in _jsonl(MT_BENCH)]


@pytest.fixture(scope="module")
def mt_bench_h4(tmp_path_factory) -> Path:
    return _parquet_folder(tmp_path_factory.mktemp("mt_bench_prompts"), _h4_rows())


@pytest.mark.parametrize("layout", ["parquet", "jsonl"])
def test_ifeval_folder_in_the_hub_layout_gives_the_reference_rows(layout, ifeval_parquet, ifeval_jsonl,
                                                                   reference_inputs):
    folder = ifeval_parquet if layout == "parquet" else ifeval_jsonl
    raw = load_dataset_rows(parse_source(folder))
    assert raw.split == "train" and len(raw.rows) == 541
    if layout == "parquet":  # the nulls the normaliser must drop are really there
        assert raw.rows[0]["kwargs"][0]["num_words"] is None and len(raw.rows[0]["kwargs"][0]) == 24
    rows = load_inputs(folder)
    assert rows == reference_inputs
    assert all(None not in kw.values() for r in rows for kw in r["kwargs"])


def test_ifeval_from_a_folder_scores_gpt4_like_the_jsonl_and_the_reference(ifeval_parquet, reference_inputs):
    inputs = load_inputs(ifeval_parquet)
    assert inputs == reference_inputs  # so every score below is the jsonl path's too (scoring is a pure function)
    loose = evaluate(inputs, read_responses(RESPONSES), "loose")  # strict: the CLI test below
    reference = _jsonl(IFEVAL / "gpt4_eval_results_loose.jsonl")
    assert [r["follow_instruction_list"] for r in loose] == [r["follow_instruction_list"] for r in reference]


def test_normalised_ifeval_file_is_the_reference_input_file(ifeval_parquet, tmp_path):
    out = tmp_path / "prompts.jsonl"
    record = write_inputs(ifeval_parquet, out)
    assert record["prompts"] == 541 and record["kind"] == "folder"
    assert _jsonl(out) == _jsonl(INPUTS)  # same rows, same order, no null kwargs
    assert read_inputs(out) == read_inputs(INPUTS)


def test_mt_bench_hub_layout_normalises_to_fastchats(mt_bench_h4, tmp_path):
    fastchat = _jsonl(MT_BENCH)
    rows = mt_bench_rows(mt_bench_h4)
    assert [r["turns"] for r in rows] == [q["turns"] for q in fastchat]
    assert [r["category"] for r in rows] == [q["category"] for q in fastchat]
    assert [r["question_id"] for r in rows] == [h["prompt_id"] for h in _h4_rows()]
    assert all(set(r) == {"question_id", "category", "turns"} for r in rows)
    qs, skipped = load_questions("mt_bench", mt_bench_h4)
    assert skipped == {} and [q.text for q in qs] == [q["turns"][0] for q in fastchat]

    folder = tmp_path / "fastchat"  # FastChat's own layout as a dataset folder
    folder.mkdir()
    (folder / "question.jsonl").write_bytes(MT_BENCH.read_bytes())
    from_folder = mt_bench_rows(folder)
    assert from_folder == [{k: q[k] for k in ("question_id", "category", "turns")} for q in fastchat]
    assert from_folder == mt_bench_rows(MT_BENCH)


def _bad_ifeval(tmp_path: Path, row_3: dict) -> Path:
    rows = _jsonl(INPUTS)[:4]
    rows[2] = {**rows[2], **row_3}
    return _parquet_folder(tmp_path / "bad", rows)


@pytest.mark.parametrize(
    "change, field",
    [
        ({"instruction_id_list": ["keywords:nonsense"], "kwargs": [{}]}, "instruction_id_list[0]"),
        ({"instruction_id_list": ["length_constraints:number_words"], "kwargs": [{"relation": "at least"}]},
         "kwargs[0].num_words"),
        ({"key": None}, "key"),
    ],
)
def test_a_bad_ifeval_row_names_source_split_row_and_field(tmp_path, change, field):
    folder = _bad_ifeval(tmp_path, change)
    with pytest.raises(InputError) as err:
        load_inputs(folder)
    assert f"{folder} (split train), row 3, field '{field}'" in str(err.value)


def test_a_folder_is_read_afresh_after_an_edit(tmp_path):
    # datasets caches a carded folder by its card alone; a stale read here would score the wrong prompts.
    rows = _jsonl(INPUTS)[:3]
    folder = _parquet_folder(tmp_path / "edited", rows)
    assert [r["key"] for r in load_inputs(folder)] == [r["key"] for r in rows]
    pq.write_table(pa.Table.from_pylist(rows[:1]), folder / "data" / "train-00000-of-00001.parquet")
    assert [r["key"] for r in load_inputs(folder)] == [rows[0]["key"]]


def test_missing_columns_and_bad_mt_bench_rows_are_named(tmp_path):
    rows = [{k: v for k, v in r.items() if k != "kwargs"} for r in _jsonl(INPUTS)[:3]]
    folder = _parquet_folder(tmp_path / "no_kwargs", rows)
    with pytest.raises(InputError, match=r"field 'kwargs': no such column .*google/IFEval's key, prompt"):
        load_inputs(folder)

    h4 = _h4_rows()[:3]
    h4[1]["prompt"] = []
    with pytest.raises(InputError, match=r"\(split train\), row 2, field 'prompt': missing, empty"):
        mt_bench_rows(_parquet_folder(tmp_path / "empty_turns", h4))
    h4 = _h4_rows()[:3]
    h4[2]["prompt_id"] = h4[0]["prompt_id"]
    with pytest.raises(InputError, match=r"row 3, field 'prompt_id': duplicate id .* \(first on row 1\)"):
        mt_bench_rows(_parquet_folder(tmp_path / "dup", h4))


def test_source_forms_and_their_errors(tmp_path):
    s = parse_source("hub:google/IFEval@0123abc:train")
    assert (s.kind, s.name, s.revision, s.split) == ("hub", "google/IFEval", "0123abc", "train")
    s = parse_source("hub:HuggingFaceH4/mt_bench_prompts")
    assert (s.kind, s.name, s.revision, s.split) == ("hub", "HuggingFaceH4/mt_bench_prompts", None, None)
    for bad in ("hub:IFEval", "hub:google/IFEval:", "hub:google/IF Eval"):
        with pytest.raises(InputError, match="not a hub dataset id: expected hub:OWNER/NAME"):
            parse_source(bad)
    with pytest.raises(InputError, match="no such file or folder"):
        parse_source(tmp_path / "google/IFEval")
    (tmp_path / "p.csv").write_text("key\n1\n")
    with pytest.raises(InputError, match="unsupported file type '.csv'"):
        parse_source(tmp_path / "p.csv")

    folder = tmp_path / "two_splits"  # no train split, two others: which one is not guessed
    folder.mkdir()
    for split in ("test", "validation"):
        (folder / f"{split}.jsonl").write_text(INPUTS.read_text().splitlines()[0] + "\n")
    with pytest.raises(InputError, match=r"several splits and none is 'train' \(test, validation\)"):
        load_inputs(folder)
    (folder / "validation.jsonl").unlink()
    assert len(load_inputs(folder)) == 1  # the only split


def _orpo(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "orpo.cli", *args], capture_output=True, text=True, timeout=300,
                          env={**os.environ, **(env or {})}, cwd=ROOT)


def test_a_hub_id_offline_is_one_clear_error(tmp_path):
    env = {"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}  # empty cache: nothing to fall back on
    out = _orpo("ifeval", "prompts", "--source", "hub:google/IFEval", "--out", str(tmp_path / "p.jsonl"), env=env)
    assert out.returncode == 1 and not (tmp_path / "p.jsonl").exists()
    assert "cannot load hub dataset 'google/IFEval': offline (HF_HUB_OFFLINE" in out.stderr
    assert "Traceback" not in out.stderr


def test_cli_scores_responses_against_a_dataset_folder(ifeval_parquet, tmp_path):
    env = {"HF_HOME": str(tmp_path / "hf")}
    out = _orpo("ifeval", "score", "--inputs", str(ifeval_parquet), "--responses", str(RESPONSES),
                "--out", str(tmp_path / "scores"), env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    summary = json.loads(out.stdout)
    assert summary["prompt_level_strict_acc"] == 417 / 541 and summary["inst_level_loose_acc"] == 714 / 834
    strict = _jsonl(tmp_path / "scores" / "eval_results_strict.jsonl")
    assert [r["follow_instruction_list"] for r in strict] == [
        r["follow_instruction_list"] for r in _jsonl(IFEVAL / "gpt4_eval_results_strict.jsonl")]


def test_config_takes_hub_ids_and_folders_and_names_a_malformed_one(ifeval_parquet):
    config = validate_config({"eval": {"prompts": "hub:google/IFEval"},
                              "judge": {"prompt_set": "mt_bench", "questions": "hub:HuggingFaceH4/mt_bench_prompts"}})
    assert config["eval"]["prompts"] == "hub:google/IFEval"
    assert config["judge"]["questions"] == "hub:HuggingFaceH4/mt_bench_prompts"
    assert validate_config({"eval": {"prompts": str(ifeval_parquet)}})["eval"]["prompts"] == str(ifeval_parquet)
    with pytest.raises(ConfigError, match=r"eval.prompts: 'hub:IFEval' does not match"):
        validate_config({"eval": {"prompts": "hub:IFEval"}})
    with pytest.raises(ConfigError, match="eval.prompts: no/such/prompts.jsonl does not exist"):
        validate_config({"eval": {"prompts": "no/such/prompts.jsonl"}})


def _snakemake(workdir: Path, config: dict, *args: str) -> subprocess.CompletedProcess:
    workdir.mkdir(exist_ok=True)
    (workdir / "sources.yaml").write_text(yaml.safe_dump(config))
    cmd = [sys.executable, "-m", "snakemake", "--snakefile", str(ROOT / "Snakefile"), "--directory", str(workdir),
           "--configfile", str(workdir / "sources.yaml"), "--cores", "1", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "HF_HOME": str(workdir / "hf")})


def _planned(result: subprocess.CompletedProcess) -> set[str]:
    text = result.stdout + result.stderr
    if "Nothing to be done" in text:
        return set()
    table = text.split("Job stats:", 1)[1]
    return {m.group(1) for m in re.finditer(r"^(\w+)\s+\d+$", table, re.MULTILINE)} - {"total", "job"}


def test_workflow_normalises_folder_sources_once_and_every_rule_reads_the_result(ifeval_parquet, mt_bench_h4,
                                                                                 tmp_path):
    config = {"eval": {"prompts": str(ifeval_parquet)},
              "judge": {"prompt_set": "mt_bench", "questions": str(mt_bench_h4), "model": "m"}}
    targets = ("results/eval/ifeval_prompts.jsonl", "results/judge/mt_bench_questions.jsonl")
    plan = _planned(_snakemake(tmp_path, config, "-n", "results/ifeval.json", "results/judge/summary.json"))
    assert {"eval_prompts", "mt_bench_questions", "curate", "generate_base", "ifeval", "judge_prompts"} <= plan
    result = _snakemake(tmp_path, config, *targets)
    assert result.returncode == 0, result.stderr[-3000:]
    assert _jsonl(tmp_path / targets[0]) == _jsonl(INPUTS)
    assert _jsonl(tmp_path / targets[1]) == mt_bench_rows(mt_bench_h4)
    after = _planned(_snakemake(tmp_path, config, "-n", "results/ifeval.json", "results/judge/summary.json"))
    assert after == plan - {"eval_prompts", "mt_bench_questions"}  # cached: the rest reads the normalised files

    hub = {"eval": {"prompts": "hub:google/IFEval"}}  # no network needed to plan; the rule has no file input
    assert "eval_prompts" in _planned(_snakemake(tmp_path / "hub", hub, "-n", "results/ifeval.json"))
