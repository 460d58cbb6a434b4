"""The ORPO trainer on the tiny embedded stack: determinism, replay, resume, adapters mlx-lm loads, errors."""

import io
import json
import os
import re
import shutil
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
from orpo.train.checkpoint import kept_steps, read_index
from orpo.train.lora import load_adapter_weights
from orpo.train.progress import Progress
from orpo.train.settings import train_settings
from orpo.config import section_defaults
from orpo.train.trainer import TrainingError, build_session, replay, train

from conftest import TINY_TRAIN


@pytest.fixture(scope="module")
def run(tiny_base, tiny_rendered, tmp_path_factory):
    out = tmp_path_factory.mktemp("train") / "run"
    train(tiny_base, tiny_rendered, out, train_settings(TINY_TRAIN))
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


def test_same_settings_give_bit_identical_adapters(run, tiny_base, tiny_rendered, tmp_path, capsys):
    train(tiny_base, tiny_rendered, tmp_path / "again", train_settings(TINY_TRAIN))
    # Not a terminal: the dtype said once, then a line per log step (4, 8, 12) plus baseline and validations.
    err = capsys.readouterr().err.splitlines()
    assert re.fullmatch(r"model dtype: float32 \(auto on (cpu|gpu); checkpoint float32\)", err[0])
    steps = [re.match(r"step (\d+)/12  (loss|validation) ", x).groups() for x in err[1:] if x.startswith("step ")]
    assert [int(s) for s, kind in steps if kind == "loss"] == [4, 8, 12]
    assert [int(s) for s, kind in steps if kind == "validation"] == [0, 4, 8, 12]
    assert [x for x in err if x.startswith("step 12/12  loss")][0].endswith("eta 0:00")
    assert sha256_file(tmp_path / "again" / "adapters.safetensors") == sha256_file(run / "adapters.safetensors")
    other = {**TINY_TRAIN, "seed": 1}
    train(tiny_base, tiny_rendered, tmp_path / "seed1", train_settings(other))
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


def test_adapter_loads_in_mlx_lm_and_changes_the_model(run, tiny_base, tiny_rendered):
    base_model, tok = load(str(tiny_base))
    tuned, _ = load(str(tiny_base), adapter_path=str(run))
    ids = mx.array([tok.encode("<|im_start|>user\nTell me about the cat.<|im_end|>\n<|im_start|>assistant\n")])
    a, b = base_model(ids), tuned(ids)
    assert a.shape == b.shape
    assert float(mx.abs(a - b).max()) > 1e-4
    ours = build_session(tiny_base, tiny_rendered, train_settings(TINY_TRAIN))  # our layer, eval mode: mlx-lm's logits
    load_adapter_weights(ours.model, run)
    ours.model.eval()
    np.testing.assert_allclose(np.array(ours.model(ids)), np.array(b), rtol=1e-5, atol=1e-6)


def test_killed_run_resumes_to_the_same_adapter(run, tiny_base, tiny_rendered, tmp_path):
    out = tmp_path / "run"
    settings = json.dumps(TINY_TRAIN)
    cmd = [sys.executable, "-m", "orpo.cli", "train", "--model", str(tiny_base), "--rendered", str(tiny_rendered),
           "--out", str(out), "--settings", settings]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    index = tmp_path / "run.partial" / "index.json"

    def resumable() -> bool:  # a resume takes only the checkpoints index.json lists
        try:
            return "4" in json.loads(index.read_text())["checkpoints"]
        except (OSError, ValueError, KeyError):
            return False

    deadline = time.time() + 120
    while not resumable() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    assert resumable(), "the first checkpoint never appeared in index.json"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    if out.exists():
        pytest.skip("the run finished before it could be killed")
    done = subprocess.run(cmd, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert re.search(r"^resumed from step (4|8)/12 \(its checkpoint\)$", done.stderr, re.MULTILINE)
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
        train(broken, tiny_rendered, tmp_path / "run", train_settings(TINY_TRAIN))
    assert not (tmp_path / "run").exists()


def test_divergence_stops_training_and_keeps_the_last_good_checkpoint(tiny_base, tiny_rendered, tmp_path):
    """lr 1e4 drives the adapter to a near-uniform model: the validation after it stops the run (exit non-zero
    from the CLI), with no checkpoint of the diverged weights; with the rule off, the same run completes."""
    settings = {**TINY_TRAIN, "lr": 1e4, "warmup": 0, "checkpoint_every": 2, "max_steps": 8}
    with pytest.raises(TrainingError, match=r"training diverged at step \d+: validation (loss|NLL)") as err:
        train(tiny_base, tiny_rendered, tmp_path / "run", train_settings(settings))
    work = tmp_path / "run.partial"
    assert not (tmp_path / "run").exists() and work.exists()
    step = int(str(err.value).split("at step ")[1].split(":")[0])
    index = read_index(work)
    assert all(int(k) < step for k in index["checkpoints"]) and all(k < step for k in kept_steps(work))
    train(tiny_base, tiny_rendered, tmp_path / "off", train_settings({**settings, "divergence_ratio": 0}))
    final = read_index(tmp_path / "off")
    assert final["checkpoints"][str(final["final_step"])]["validation"]["nll"] > 0.98 * np.log(512)  # uniform


def test_diverged_rules():
    from orpo.train.trainer import diverged
    start = {"loss": 0.55, "nll": 0.5}
    assert diverged({"loss": 7.0, "nll": 6.9}, start, 1024, 3.0).startswith("validation loss 7.0000 is over 3x")
    assert diverged({"loss": 1.0, "nll": 0.9}, start, 1024, 3.0) is None
    assert diverged({"loss": 7.0, "nll": 6.9}, start, 1024, 0) is None
    near_uniform = {"loss": 7.0, "nll": 6.9}  # ln 1024 = 6.93: a model that starts there is not flagged by NLL
    assert diverged({"loss": 7.1, "nll": 6.92}, near_uniform, 1024, 3.0) is None
    assert "uniform" in diverged({"loss": 1.6, "nll": 6.8}, {"loss": 0.6, "nll": 3.0}, 1024, 3.0)


def test_second_trainer_on_the_same_folder_is_refused(tiny_base, tiny_rendered, tmp_path):
    """Two runs after an unlocked Snakemake must not share one .partial folder: the second fails at once."""
    import fcntl
    out = tmp_path / "run"
    with open(tmp_path / "run.lock", "a+") as held:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)  # as a running `orpo train` holds it
        held.write("4242\n")
        held.flush()
        with pytest.raises(TrainingError, match="another orpo train is writing it .*pid 4242"):
            train(tiny_base, tiny_rendered, out, train_settings(TINY_TRAIN))
    assert not (tmp_path / "run.partial").exists()
    train(tiny_base, tiny_rendered, out, train_settings({**TINY_TRAIN, "max_steps": 2, "checkpoint_every": 0}))
    assert (out / "complete.json").is_file() and not (tmp_path / "run.lock").exists()


def test_pairs_with_nothing_to_prefer_are_refused(tiny_base, tiny_rendered, tmp_path):
    import polars as pl
    same = tmp_path / "rendered"
    same.mkdir()
    for split in ("train", "validation"):
        df = pl.read_parquet(tiny_rendered / f"{split}.parquet")
        df.with_columns(rejected_ids=pl.col("chosen_ids"), rejected_mask=pl.col("chosen_mask")).write_parquet(
            same / f"{split}.parquet")
    with pytest.raises(TrainingError, match="every pair's chosen and rejected tokens are identical"):
        train(tiny_base, same, tmp_path / "run", train_settings(TINY_TRAIN))


def test_replay_refuses_an_incomplete_run_folder(run, tiny_base, tiny_rendered, tmp_path):
    partial = tmp_path / "run"
    shutil.copytree(run, partial)
    (partial / "complete.json").unlink()  # as left by a job that died after the folder was emptied or rewritten
    with pytest.raises(ValueError, match="incomplete training run: no complete.json"):
        replay(partial, tiny_base, tiny_rendered, 4, "zero")


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


# Every new knob away from its default at once: LoRA+, keyed dropout, accumulation, retention, warm start, the
# margin objective with the λ controller (its state carried through checkpoints).
SINK = {
    **TINY_TRAIN, "batch_size": 2, "grad_accum": 2, "max_steps": 8, "checkpoint_every": 2, "keep_last": 2,
    "seed": 3, "lambda": 0.2, "schedule": "linear", "warmup": 2, "grad_clip": 0.5, "weight_decay": 0.01,
    "group_by_length": True, "lora": {"rank": 4, "alpha": 8, "dropout": 0.1, "plus_ratio": 4.0},
    "objective": "orpo_margin", "gamma": 0.5, "lambda_schedule": "controller",
    "controller": {"kp": 3.0, "ki": 0.5, "kd": 1.0, "window": 2, "target_drift": 0.0},
}


@pytest.fixture(scope="module")
def sink(run, tiny_base, tiny_rendered, tmp_path_factory):
    out = tmp_path_factory.mktemp("sink") / "run"
    train(tiny_base, tiny_rendered, out, train_settings({**SINK, "init_adapter": str(run)}))
    return out


def test_the_controller_moves_lambda_and_its_checkpoints_keep_its_state(sink):
    lams = [m["lambda"] for m in map(json.loads, (sink / "metrics.jsonl").read_text().splitlines())
            if m["split"] == "train"]
    assert lams[:2] == [0.2, 0.2] and len(set(lams[2:])) > 1  # held for the first window, then moved
    state = json.loads((sink / "checkpoints" / "step-000006" / "state.json").read_text())["lambda_controller"]
    assert state["lambda"] == pytest.approx(lams[6], abs=1e-6) and len(state["nlls"]) == 2  # the log rounds


def test_keep_last_prunes_folders_but_the_index_keeps_every_hash(sink):
    index = read_index(sink)
    assert sorted(map(int, index["checkpoints"])) == [2, 4, 6, 8]
    best = {index["best_margin_step"], index["best_loss_step"]}
    assert kept_steps(sink) == sorted({6, 8} | best)
    assert set(kept_steps(sink)) < {2, 4, 6, 8}, "nothing was pruned: this test needs other settings"
    for step in kept_steps(sink):
        d = sink / "checkpoints" / f"step-{step:06d}"
        assert sha256_file(d / "adapters.safetensors") == index["checkpoints"][str(step)]["sha256"]


def test_a_pruned_step_replays_bit_exactly_from_the_nearest_kept_one(sink, tiny_base, tiny_rendered):
    pruned = sorted({2, 4, 6, 8} - set(kept_steps(sink)))
    for step in pruned:
        record = replay(sink, tiny_base, tiny_rendered, step, "previous")
        assert record["equal"], record
        assert record["from_step"] == max([k for k in kept_steps(sink) if k < step], default=0)
    assert replay(sink, tiny_base, tiny_rendered, "final", "zero")["equal"]


def test_resume_is_bit_identical_with_every_knob_on(sink, tiny_base, tiny_rendered, tmp_path, capsys):
    out = tmp_path / "run"
    work = tmp_path / "run.partial"
    shutil.copytree(sink, work)  # an interrupted run: the last checkpoint never got written
    shutil.rmtree(work / "checkpoints" / "step-000008")
    index = read_index(work)
    del index["checkpoints"]["8"]
    (work / "index.json").write_text(json.dumps(index))
    (work / "adapters.safetensors").unlink()
    train(tiny_base, tiny_rendered, out, train_settings(json.loads((sink / "settings.json").read_text())["settings"]))
    assert "resumed from step 6/" in capsys.readouterr().err
    assert sha256_file(out / "adapters.safetensors") == sha256_file(sink / "adapters.safetensors")
    assert read_index(out)["checkpoints"] == read_index(sink)["checkpoints"]
    steps = [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == [json.loads(x)["step"] for x in (sink / "metrics.jsonl").read_text().splitlines()]


def test_every_setting_reaches_settings_json_and_adapter_config(sink, run):
    record = json.loads((sink / "settings.json").read_text())
    config = json.loads((sink / "adapter_config.json").read_text())
    s, defaults = record["settings"], section_defaults("train")
    assert set(defaults) == set(s) and set(defaults["lora"]) == set(s["lora"])
    assert config["orpo_train"] == record["resolved"]["settings"]  # what the run used, every auto decided
    assert s["engine"]["compile"] == "auto" and record["resolved"]["settings"]["engine"]["compile"] in (True, False)
    for key, value in SINK.items():
        assert s[key] == ({**defaults[key], **value} if key in ("lora", "controller") else value), key
    assert config["lora_parameters"] == {"rank": 4, "scale": 2.0, "dropout": 0.1,
                                         "keys": config["lora_parameters"]["keys"]}
    assert config["fine_tune_type"] == "lora" and config["num_layers"] == 2
    assert record["init_adapter"]["sha256"] == sha256_file(run / "adapters.safetensors")


def test_replay_refuses_a_changed_init_adapter(sink, tiny_base, tiny_rendered, tmp_path):
    copy = tmp_path / "run"
    shutil.copytree(sink, copy)
    record = json.loads((copy / "settings.json").read_text())
    record["init_adapter"]["sha256"] = "0" * 64
    (copy / "settings.json").write_text(json.dumps(record))
    with pytest.raises(ValueError, match="init_adapter .* changed since the run"):
        replay(copy, tiny_base, tiny_rendered, "final", "previous")


def _metrics(step):
    return {"step": step, "loss": 1.5, "nll": 1.4, "or_loss": 0.7, "accuracy": 0.5, "margin": 0.1, "lr": 1e-3,
            "tokens_per_s": 1234.5, "active_memory_mb": 12.5}


def test_progress_is_log_lines_off_a_terminal_and_a_bar_on_one():
    plain, now = io.StringIO(), [100.0]
    p = Progress(total=10, start=0, log_every=4, stream=plain, clock=lambda: now[0])
    assert not p.tty
    for step in range(1, 11):
        now[0] = 100.0 + 7.5 * step  # 7.5 s a step
        p.step(_metrics(step))
    p.event({"step": 10, "validation": {"loss": 1.0, "accuracy": 0.75, "margin": -0.25}, "sha256": "3fa9c1d2"})
    p.close()
    lines = plain.getvalue().splitlines()
    assert lines[0] == ("step 4/10  loss 1.5000  acc 0.50  margin +0.100  lr 1.00e-03  mem 12 MB  1,234 tok/s  "
                        "elapsed 0:30  eta 0:45")  # 4 steps in 30 s: 6 more take 45 s
    assert [int(re.match(r"step (\d+)/10  ", x).group(1)) for x in lines] == [4, 8, 10, 10]
    assert lines[2].endswith("elapsed 1:15  eta 0:00")
    assert lines[3] == "step 10/10  validation  loss 1.0000  accuracy 0.7500  margin -0.2500  checkpoint 3fa9c1d2"

    term = io.StringIO()
    bar = Progress(total=10, start=2, log_every=4, stream=term, tty=True)
    for step in range(3, 11):
        bar.step(_metrics(step))
    bar.event({"resumed_from_step": 2})
    bar.close()
    out = term.getvalue()
    assert "10/10" in out and "loss=1.5000" in out and "tok/s=1234" in out and "mem=12MB" in out
    assert "resumed from step 2/10 (its checkpoint)" in out and "\r" in out
