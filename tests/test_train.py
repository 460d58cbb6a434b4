"""The ORPO trainer on the tiny embedded stack: determinism, replay, resume, adapters mlx-lm loads, errors."""

import json
import os
import signal
import subprocess
import sys
import time

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm import load

from orpo.batching import batch_schedule, pad_rows
from orpo.io import sha256_file
from orpo.train.checkpoint import read_index
from orpo.train.trainer import TrainingError, replay, train

from conftest import TINY_TRAIN


@pytest.fixture(scope="module")
def run(tiny_base, tiny_rendered, tmp_path_factory):
    out = tmp_path_factory.mktemp("train") / "run"
    train(tiny_base, tiny_rendered, out, TINY_TRAIN)
    return out


def test_run_folder_and_index(run):
    index = read_index(run)
    assert sorted(map(int, index["checkpoints"])) == [4, 8, 12]
    assert index["final_step"] == 12
    for step, entry in index["checkpoints"].items():
        d = run / "checkpoints" / f"step-{int(step):06d}"
        assert sha256_file(d / "adapters.safetensors") == entry["sha256"]
        assert {"loss", "nll", "or_loss", "log_odds", "accuracy", "margin"} <= set(entry["validation"])
    assert index["best_margin_step"] in (4, 8, 12) and index["best_loss_step"] in (4, 8, 12)
    assert sha256_file(run / "adapters.safetensors") == index["checkpoints"]["12"]["sha256"]
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    train_lines = [x for x in lines if x["split"] == "train"]
    assert [x["step"] for x in train_lines] == list(range(1, 13))
    assert all(np.isfinite(x["loss"]) and x["loss"] > 0 for x in train_lines)
    assert len([x for x in lines if x["split"] == "validation"]) == 3
    assert not (run.parent / "run.partial").exists()


def test_same_settings_give_bit_identical_adapters(run, tiny_base, tiny_rendered, tmp_path):
    train(tiny_base, tiny_rendered, tmp_path / "again", TINY_TRAIN)
    assert sha256_file(tmp_path / "again" / "adapters.safetensors") == sha256_file(run / "adapters.safetensors")
    other = {**TINY_TRAIN, "seed": 1}
    train(tiny_base, tiny_rendered, tmp_path / "seed1", other)
    assert sha256_file(tmp_path / "seed1" / "adapters.safetensors") != sha256_file(run / "adapters.safetensors")


@pytest.mark.parametrize("start", ["zero", "previous"])
def test_replay_reproduces_a_checkpoint(run, tiny_base, tiny_rendered, start):
    record = replay(run, tiny_base, tiny_rendered, 8, start)
    assert record["equal"], record
    assert record["from_step"] == (0 if start == "zero" else 4)
    assert record["replayed_sha256"] == read_index(run)["checkpoints"]["8"]["sha256"]


def test_replay_detects_a_tampered_checkpoint(run, tiny_base, tiny_rendered, tmp_path):
    import shutil

    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    index = json.loads((copy / "index.json").read_text())
    index["checkpoints"]["8"]["sha256"] = "0" * 64
    (copy / "index.json").write_text(json.dumps(index))
    assert not replay(copy, tiny_base, tiny_rendered, 8, "previous")["equal"]


def test_adapter_loads_in_mlx_lm_and_changes_the_model(run, tiny_base):
    base_model, tok = load(str(tiny_base))
    tuned, _ = load(str(tiny_base), adapter_path=str(run))
    ids = mx.array([tok.encode("<|im_start|>user\nTell me about the cat.<|im_end|>\n<|im_start|>assistant\n")])
    a, b = base_model(ids), tuned(ids)
    assert a.shape == b.shape
    assert float(mx.abs(a - b).max()) > 1e-4


def test_killed_run_resumes_to_the_same_adapter(run, tiny_base, tiny_rendered, tmp_path):
    out = tmp_path / "run"
    settings = json.dumps(TINY_TRAIN)
    cmd = [sys.executable, "-m", "orpo.cli", "train", "--model", str(tiny_base), "--rendered", str(tiny_rendered),
           "--out", str(out), "--settings", settings]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    ckpt = tmp_path / "run.partial" / "checkpoints" / "step-000004" / "state.json"
    deadline = time.time() + 120
    while not ckpt.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    assert ckpt.exists(), "the first checkpoint never appeared"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    if out.exists():
        pytest.skip("the run finished before it could be killed")
    done = subprocess.run(cmd, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert '"resumed_from_step"' in done.stderr
    assert sha256_file(out / "adapters.safetensors") == sha256_file(run / "adapters.safetensors")


def test_non_finite_loss_stops_with_a_clear_error(tiny_base, tiny_rendered, tmp_path):
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(tiny_base, broken)
    weights = mx.load(str(broken / "model.safetensors"))
    w = np.array(weights["model.layers.1.mlp.down_proj.weight"])
    w[0, 0] = np.nan
    weights["model.layers.1.mlp.down_proj.weight"] = mx.array(w)
    mx.save_safetensors(str(broken / "model.safetensors"), weights)
    with pytest.raises(TrainingError, match="non-finite loss or gradient at step 1"):
        train(broken, tiny_rendered, tmp_path / "run", TINY_TRAIN)
    assert not (tmp_path / "run").exists()


def test_batch_schedule_is_seeded_complete_and_groups_lengths():
    rng = np.random.default_rng(0)
    lengths = rng.integers(10, 400, size=203).tolist()
    a = batch_schedule(lengths, 8, 2, seed=3)
    assert a == batch_schedule(lengths, 8, 2, seed=3)
    assert a != batch_schedule(lengths, 8, 2, seed=4)
    assert len(a) == 2 * (203 // 8) and all(len(b) == 8 for b in a)
    for epoch in (a[:25], a[25:]):
        rows = [r for b in epoch for r in b]
        assert len(rows) == len(set(rows)) == 200
    assert batch_schedule(lengths, 8, 5, seed=3, max_steps=30) == batch_schedule(lengths, 8, 5, seed=3)[:30]

    def fill(schedule):
        real = sum(lengths[r] for b in schedule for r in b)
        padded = sum(pad_rows([[0] * lengths[r] for r in b], 0).size for b in schedule)
        return real / padded

    assert fill(a) > 0.9 > fill(batch_schedule(lengths, 8, 2, seed=3, window=1)) + 0.1
