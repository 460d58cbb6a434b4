"""Typed train settings: the schema's keys and defaults exactly, `auto` resolved once and recorded, and resume
and replay use the recorded resolution (a machine of another backend is refused plainly)."""

import dataclasses
import json
import shutil

import pytest

from conftest import shortest_pairs
from orpo.cli import main
from orpo.config import ConfigError, section_defaults
from orpo.io import sha256_file
from orpo.settings import as_dict, field_keys, schema_keys
from orpo.train.checkpoint import read_index
from orpo.train.settings import (DistributedSettings, EngineSettings, LoraSettings, Machine, TrainSettings,
                                 recorded_run, train_settings)
from orpo.train.step import resolve_engine
from orpo.train.trainer import replay, train


def test_the_dataclasses_hold_exactly_the_schemas_keys_and_no_defaults_of_their_own():
    assert field_keys(TrainSettings) == schema_keys("train")
    for cls in (TrainSettings, LoraSettings, EngineSettings, DistributedSettings):
        assert all(f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
                   for f in dataclasses.fields(cls)), cls
    s = train_settings({})
    assert as_dict(s) == section_defaults("train")  # every default is the schema's
    assert s.lambda_ == section_defaults("train")["lambda"] and isinstance(s.lora.alpha, float)
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.batch_size = 8


def test_a_bad_value_is_named_by_its_dotted_key():
    with pytest.raises(ConfigError, match=r"--settings: train.lora.rank: 0 is less than the minimum of 1"):
        train_settings({"lora": {"rank": 0}}, what="--settings")
    with pytest.raises(ConfigError, match=r"unknown key train.engine.heads"):
        train_settings({"engine": {"heads": "fused"}})
    assert train_settings({"lr": "1e-3", "lora": {"alpha": "16"}}).lr == 1e-3  # strings read as the schema says


def test_auto_is_decided_once_for_the_run():
    e = resolve_engine(train_settings({}).engine)
    assert e.resolved and e.compile is False and e.prefix_sharing is True and e.width_multiple == 0  # the CPU
    assert resolve_engine(train_settings({"engine": {"compile": True, "width_multiple": 24}}).engine).compile is True
    assert e.attention_backward == "fused"  # the CPU's backward sums in order; a GPU's auto is "ordered"
    assert e.gated_mlp is False  # slower on the CPU; CUDA's auto is on
    assert resolve_engine(train_settings({"engine": {"gated_mlp": True}}).engine).gated_mlp is True


def test_a_record_from_before_attention_backward_replays_as_it_ran(two_forward_run, tiny_base, short, tmp_path):
    """A run recorded without train.engine.attention_backward ran mx.fast's backward: it replays with that."""
    def older(record):
        del record["settings"]["engine"]["attention_backward"], record["resolved"]["settings"]["engine"]["attention_backward"]

    old = edit_record(two_forward_run, tmp_path, "older", older)
    assert recorded_run(old)[1].settings.engine.attention_backward == "fused"
    assert replay(old, tiny_base, short, "final", "zero")["equal"]


SHORT = {"batch_size": 2, "max_steps": 4, "checkpoint_every": 2, "log_every": 1, "lr": 0.003,
         "lora": {"rank": 4, "alpha": 8}, "engine": {"head": "fused"}}


@pytest.fixture(scope="module")
def short(tiny_rendered, tmp_path_factory):
    return shortest_pairs(tiny_rendered, tmp_path_factory.mktemp("settings") / "rendered", 8, 2)


@pytest.fixture(scope="module")
def two_forward_run(tiny_base, short, tmp_path_factory):
    """A run whose engine differs from what `auto` decides on this machine: two forwards, not prefix sharing."""
    out = tmp_path_factory.mktemp("two_forward") / "run"
    train(tiny_base, short, out, train_settings({**SHORT, "engine": {"head": "fused", "prefix_sharing": False}}))
    return out


def edit_record(run, tmp_path, name, edit):
    copy = tmp_path / name
    shutil.copytree(run, copy)
    record = json.loads((copy / "settings.json").read_text())
    edit(record)
    (copy / "settings.json").write_text(json.dumps(record))
    return copy


def as_if_auto(record):
    """The record of a run configured with `prefix_sharing: auto` on a machine where auto meant false."""
    record["settings"]["engine"]["prefix_sharing"] = "auto"
    assert record["resolved"]["settings"]["engine"]["prefix_sharing"] is False


def test_the_run_records_its_resolution_and_machine(two_forward_run):
    record = json.loads((two_forward_run / "settings.json").read_text())
    here = dataclasses.asdict(Machine.here())
    assert record["resolved"]["machine"] == here and here["backend"] == "cpu" and here["mlx"]
    engine = record["resolved"]["settings"]["engine"]
    assert engine["compile"] is False and engine["prefix_sharing"] is False and record["resolved"]["tight_rows"] is True
    assert record["settings"]["engine"]["compile"] == "auto"  # as configured, beside what it became


def test_replay_uses_the_recorded_resolution_not_this_machines(two_forward_run, tiny_base, short, tmp_path):
    recorded = edit_record(two_forward_run, tmp_path, "recorded", as_if_auto)
    assert replay(recorded, tiny_base, short, "final", "zero")["equal"]
    # Control: resolved as this machine decides auto (prefix sharing on), the same steps give other bits.
    def here(record):
        as_if_auto(record)
        record["resolved"]["settings"]["engine"]["prefix_sharing"] = True

    assert not replay(edit_record(two_forward_run, tmp_path, "here", here), tiny_base, short, "final", "zero")["equal"]


def test_resume_uses_the_recorded_resolution(two_forward_run, tiny_base, short, tmp_path, capsys):
    out = tmp_path / "run"
    work = edit_record(two_forward_run, tmp_path, "run.partial", as_if_auto)  # interrupted after step 2
    shutil.rmtree(work / "checkpoints" / "step-000004")
    index = read_index(work)
    del index["checkpoints"]["4"]
    (work / "index.json").write_text(json.dumps(index))
    settings = train_settings({**SHORT, "engine": {"head": "fused", "prefix_sharing": "auto"}})
    train(tiny_base, short, out, settings)
    assert "resumed from step 2/4" in capsys.readouterr().err
    assert sha256_file(out / "adapters.safetensors") == sha256_file(two_forward_run / "adapters.safetensors")
    assert json.loads((out / "settings.json").read_text())["resolved"]["settings"]["engine"]["prefix_sharing"] is False


def on_an_h200(record):
    record["resolved"]["machine"] = {"backend": "cuda", "device": "NVIDIA H200", "mlx": "0.32.4"}
    record["resolved"]["settings"]["engine"].update(compile=True, width_multiple=128)


def test_replay_on_another_backend_fails_early_saying_why(two_forward_run, tiny_base, short, tmp_path, capsys,
                                                         monkeypatch):
    cuda = edit_record(two_forward_run, tmp_path, "cuda", on_an_h200)
    want = (r"cannot replay .*cuda on this machine: the run was resolved on cuda \(NVIDIA H200, mlx 0.32.4\) "
            r"\(engine: compile True, width_multiple 128, .*\); this machine is cpu \(.*\): a bit-exact replay "
            r"needs the same backend \(cuda\)")
    with pytest.raises(ValueError, match=want):
        replay(cuda, tiny_base, short, "final", "zero")
    monkeypatch.setenv("_ORPO_BLAS_DONE", "1")  # in this process, as it is
    with pytest.raises(SystemExit) as stop:  # the command stops before loading anything, no hash compared
        main(["replay", "--run", str(cuda), "--model", str(tiny_base), "--rendered", str(short),
              "--out", str(tmp_path / "replay.json")])
    assert stop.value.code == 1
    err = capsys.readouterr().err
    assert "orpo replay: error: cannot replay" in err and "same backend (cuda)" in err and "sha256" not in err
    assert not (tmp_path / "replay.json").exists() and not (tmp_path / "replay.mismatch.json").exists()


def test_resume_on_another_backend_starts_again(two_forward_run, tiny_base, short, tmp_path, capsys):
    out = tmp_path / "run"
    edit_record(two_forward_run, tmp_path, "run.partial", on_an_h200)
    train(tiny_base, short, out, train_settings({**SHORT, "engine": {"head": "fused", "prefix_sharing": False}}))
    err = capsys.readouterr().err
    assert "not resuming" in err and "same backend (cuda)" in err and "resumed from step" not in err
    assert sha256_file(out / "adapters.safetensors") == sha256_file(two_forward_run / "adapters.safetensors")
    assert json.loads((out / "settings.json").read_text())["resolved"]["machine"]["backend"] == "cpu"
