"""Data-parallel ORPO: 2 real ring ranks on 127.0.0.1 against 1 process with the 2x batch; shard split; launcher."""

import itertools
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

from orpo.io import sha256_file
from orpo.train.checkpoint import read_index
from orpo.train.distributed import shard_micro_batches
from orpo.train.keys import DropoutKeys
from orpo.train.launch import wait_all
from orpo.train.settings import train_settings
from orpo.train.trainer import build_session, train

from conftest import TINY_TRAIN, shortest_pairs

# float32 on CPU: the runs differ only in summation order (the mean of 4 pairs vs the mean of two means of 2
# over all_sum) and padded widths (matmul blocking), ~1e-7 relative per step. Adam moves a weight by up to
# lr (3e-3) per step whatever its gradient's scale, so a near-zero gradient entry whose rounding differs
# can drift further: measured over 6 steps, max |diff| 4.8e-6 (6 of 8704 entries above 1e-6), per-tensor
# relative error <= 6e-6. Bounds 20x above that and 30x below one step's move; without the gradient
# all_sum the adapters differ by 0.09.
ADAPTER_ATOL, ADAPTER_RTOL = 1e-4, 1e-4
METRIC_RTOL, METRIC_ATOL = 1e-4, 1e-5
STEPS = 6
SETTINGS = {**TINY_TRAIN, "max_steps": STEPS, "epochs": 2, "checkpoint_every": 3, "log_every": 1}
TWO_RANKS = {**SETTINGS, "batch_size": 2, "distributed": {"processes": 2}}  # backend any: ring on CPU


def _orpo(*args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "orpo.cli", *args], check=False, capture_output=True, text=True, timeout=timeout)


def _train_cmd(base, rendered, out, settings) -> list[str]:
    return ["train", "--model", str(base), "--rendered", str(rendered), "--out", str(out),
            "--settings", json.dumps(settings)]


def _lines(run, split):
    return [x for x in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if x["split"] == split]


@pytest.fixture(scope="module")
def short(tiny_rendered, tmp_path_factory):
    return shortest_pairs(tiny_rendered, tmp_path_factory.mktemp("short") / "rendered", 16, 4)


@pytest.fixture(scope="module")
def one(tiny_base, short, tmp_path_factory):
    """The oracle: one process, batch 4 (= 2 ranks x 2), same seed and data order."""
    out = tmp_path_factory.mktemp("one") / "run"
    train(tiny_base, short, out, train_settings({**SETTINGS, "batch_size": 4}))
    return out


@pytest.fixture(scope="module")
def two(tiny_base, short, tmp_path_factory):
    """`orpo train` with train.distributed.processes 2: the CLI launches 2 ring ranks over 127.0.0.1."""
    out = tmp_path_factory.mktemp("two") / "run"
    done = _orpo(*_train_cmd(tiny_base, short, out, TWO_RANKS))
    assert done.returncode == 0, done.stderr
    return out, done


def test_shard_split_spreads_each_micro_batch_over_the_ranks():
    rows = list(range(100, 112))  # one global step: batch_size 2 x grad_accum 2 x 3 ranks
    shards = [shard_micro_batches(rows, 2, r, 3) for r in range(3)]
    assert shards[0] == [[100, 101], [106, 107]]
    assert shards[2] == [[104, 105], [110, 111]]
    # Micro-batch j over all ranks = micro-batch j of one process with batch_size * ranks.
    one_process = shard_micro_batches(rows, 6, 0, 1)
    for j in range(2):
        assert list(itertools.chain(*(s[j] for s in shards))) == one_process[j]
    assert sorted(itertools.chain(*itertools.chain(*shards))) == rows  # disjoint and complete
    assert shard_micro_batches(rows, 4, 0, 1) == [rows[:4], rows[4:8], rows[8:]]  # one rank: plain cut
    with pytest.raises(ValueError, match="does not split"):
        shard_micro_batches(rows, 5, 0, 2)


def test_dropout_keys_are_per_piece_of_the_global_step():
    plain, alone = DropoutKeys(7), DropoutKeys(7, rank=0, size=1)
    plain.at(3, 1)
    alone.at(3, 1)
    assert np.array_equal(np.array(plain.key(5)), np.array(alone.key(5)))  # one rank: the single-process keys
    ranks = [DropoutKeys(7, rank=r, size=2) for r in range(2)]
    for k in ranks:
        k.at(3, 1)
    keys = [np.array(k.key(5)).tolist() for k in ranks]
    assert keys[0] != keys[1]
    plain.at(3, 1 * 2 + 1)  # rank 1's micro-batch 1 is piece 3 of the step
    assert keys[1] == np.array(plain.key(5)).tolist()


def test_two_ranks_equal_one_process_with_twice_the_batch(one, two):
    run, _ = two
    a, b = mx.load(str(one / "adapters.safetensors")), mx.load(str(run / "adapters.safetensors"))
    assert sorted(a) == sorted(b)
    for k in a:
        diff = float(mx.abs(a[k] - b[k]).max())
        rel = float(mx.linalg.norm((a[k] - b[k]).flatten()) / mx.linalg.norm(a[k].flatten()))
        assert diff <= ADAPTER_ATOL and rel <= ADAPTER_RTOL, (k, diff, rel)
    moved = max(float(mx.abs(b[k]).max()) for k in b if k.endswith("lora_b"))  # B starts at 0
    assert moved > 100 * ADAPTER_ATOL, moved
    t1, t2 = _lines(one, "train"), _lines(run, "train")
    assert [x["step"] for x in t2] == list(range(1, STEPS + 1))
    for x, y in zip(t1, t2):
        assert x["tokens"] == y["tokens"]  # summed over ranks: the global batch's tokens
        for k in ("loss", "nll", "or_loss", "log_odds", "accuracy", "margin", "grad_norm", "lr"):
            np.testing.assert_allclose(y[k], x[k], rtol=METRIC_RTOL, atol=METRIC_ATOL, err_msg=f"step {x['step']} {k}")
    v1, v2 = _lines(one, "validation"), _lines(run, "validation")
    assert [x["step"] for x in v2] == [3, 6]
    for x, y in zip(v1, v2):
        for k in ("loss", "accuracy", "margin"):
            np.testing.assert_allclose(y[k], x[k], rtol=METRIC_RTOL, atol=METRIC_ATOL)
    i1, i2 = read_index(one), read_index(run)
    assert sorted(i2["checkpoints"]) == sorted(i1["checkpoints"]) and i2["final_step"] == STEPS
    assert json.loads((run / "settings.json").read_text())["settings"]["distributed"]["processes"] == 2


def test_only_rank_0_writes_and_logs(two):
    run, done = two
    assert sorted(p.name for p in run.parent.iterdir()) == ["run"]  # no .partial, no second folder
    assert json.loads(done.stdout)["final_step"] == STEPS  # one result printed, by rank 0
    logged = [m.groups() for m in map(re.compile(rf"^step (\d+)/{STEPS}  (loss|validation) ").match,
                                      done.stderr.splitlines()) if m]
    assert [int(s) for s, kind in logged if kind == "loss"] == list(range(1, STEPS + 1))  # each step once
    assert [int(s) for s, kind in logged if kind == "validation"] == [0, 3, 6]
    assert done.stderr.count("model dtype: ") == 1  # said by rank 0 alone


def test_distributed_run_replays_bit_for_bit_on_two_ranks(tiny_base, short, two, tmp_path):
    run, _ = two
    out = tmp_path / "replay.json"
    done = _orpo("replay", "--run", str(run), "--model", str(tiny_base), "--rendered", str(short),
                 "--checkpoint", str(STEPS), "--from", "previous", "--out", str(out))
    assert done.returncode == 0, done.stderr
    record = json.loads(out.read_text())
    assert record["equal"] and record["processes"] == 2 and record["from_step"] == 3, record


def test_killed_distributed_run_resumes_on_every_rank(tiny_base, short, two, tmp_path):
    run, _ = two
    out = tmp_path / "run"
    partial = tmp_path / "run.partial"
    shutil.copytree(run, partial)  # as if killed after step 3's checkpoint: step 6's is missing
    shutil.rmtree(partial / "checkpoints" / "step-000006")
    done = _orpo(*_train_cmd(tiny_base, short, out, TWO_RANKS))
    assert done.returncode == 0, done.stderr
    assert "resumed from step 3/" in done.stderr
    # Rank 1 must have loaded step 3 too: had it restarted from the init, the averaged gradients would differ.
    assert sha256_file(out / "adapters.safetensors") == sha256_file(run / "adapters.safetensors")


def test_a_failing_rank_stops_the_others():
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    failer = subprocess.Popen([sys.executable, "-c", "import sys; sys.exit(3)"])
    t0 = time.time()
    assert wait_all([sleeper, failer]) == 3
    assert sleeper.poll() is not None and time.time() - t0 < 15


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux-only")
def test_a_rank_dies_with_its_launcher():
    # The launcher spawns a rank and is then SIGKILLed (no chance to clean up): the rank must not live on.
    code = ("import sys; from orpo.train.launch import spawn; "
            "p = spawn([sys.executable, '-c', 'import time; time.sleep(60)'], {}); print(p.pid, flush=True); "
            "import time; time.sleep(60)")
    launcher = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    rank = int(launcher.stdout.readline())
    os.kill(launcher.pid, signal.SIGKILL)
    launcher.wait()
    deadline = time.time() + 10
    while time.time() < deadline and _alive(rank):
        time.sleep(0.05)
    assert not _alive(rank)


def _alive(pid: int) -> bool:
    try:
        state = open(f"/proc/{pid}/stat").read().split()[2]
    except FileNotFoundError:
        return False
    return state != "Z"  # a zombie has exited


def test_processes_without_a_launcher_is_a_clear_error(tiny_base, short):
    with pytest.raises(ValueError, match="train.distributed.processes is 2"):
        build_session(tiny_base, short, train_settings(TWO_RANKS))


def test_two_ranks_with_the_cuda_default_engine_equal_one_process(tiny_base, short, tmp_path):
    """The engine as CUDA runs it by default (fused head, widths of 128, prefix sharing, compiled, pairs packed in
    rows, each rank packing its own), here on the CPU: 2 ranks equal one process with twice the batch, and the run
    replays bit for bit."""
    engine = {"head": "fused", "width_multiple": 128, "prefix_sharing": True, "compile": True, "pack_width": 256}
    one = tmp_path / "one"
    train(tiny_base, short, one, train_settings({**SETTINGS, "batch_size": 4, "engine": engine}))
    two = tmp_path / "two"
    done = _orpo(*_train_cmd(tiny_base, short, two, {**TWO_RANKS, "engine": engine}))
    assert done.returncode == 0, done.stderr
    a, b = mx.load(str(one / "adapters.safetensors")), mx.load(str(two / "adapters.safetensors"))
    for k in a:
        rel = float(mx.linalg.norm((a[k] - b[k]).flatten()) / mx.linalg.norm(a[k].flatten()))
        assert float(mx.abs(a[k] - b[k]).max()) <= ADAPTER_ATOL and rel <= ADAPTER_RTOL, (k, rel)
    recorded = json.loads((two / "settings.json").read_text())["resolved"]["settings"]["engine"]
    assert recorded["compile"] is True and recorded["pack_width"] == 256 and recorded["pack_rows"] >= 1
    out = tmp_path / "replay.json"
    done = _orpo("replay", "--run", str(two), "--model", str(tiny_base), "--rendered", str(short),
                 "--checkpoint", str(STEPS), "--from", "previous", "--out", str(out))
    assert done.returncode == 0, done.stderr
    assert json.loads(out.read_text())["equal"]
