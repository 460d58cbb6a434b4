"""The ORPO loop: one step function shared by training, resume and replay, so all three agree bit for bit."""

from __future__ import annotations

import contextlib
import fcntl
import json
import math
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator

import mlx.core as mx

from orpo.device import cuda_pool_memory
from orpo.folders import mark_complete, require_complete
from orpo.io import atomic_path, write_json
from orpo.train.checkpoint import (kept_steps, load_checkpoint, prune_checkpoints, read_index, resolve_step,
                                   save_checkpoint, save_weights, step_dir)
from orpo.train.data import load_pairs
from orpo.train.footprint import memory_warning, predict_memory
from orpo.train.full import is_full, keeps_optimizer, publish_model
from orpo.train.memory import CachePolicy, cache_policy
from orpo.train.progress import Progress
from orpo.settings import as_dict
from orpo.train.session import Session, TrainingError, build_session
from orpo.train.settings import ResolvedRun, TrainSettings, recorded_run
from orpo.train.tracking import Trackers, require

__all__ = ["Session", "TrainingError", "build_session", "replay", "train"]


def _checkpoint_steps(s: TrainSettings, total: int, per_epoch: int) -> list[int]:
    """Every checkpoint_every-th step, each epoch's last step with checkpoint_each_epoch, and the last step."""
    every = s.checkpoint_every
    steps = set(range(every, total + 1, every)) if every > 0 else set()
    if s.checkpoint_each_epoch:
        steps |= set(range(per_epoch, total + 1, per_epoch))
    return sorted(steps | {total})


def train(base_dir: str | Path, rendered_dir: str | Path, out_dir: str | Path,
          settings: TrainSettings, dtype: str = "auto") -> dict[str, Any] | None:
    """Train an adapter (or, with method full, the model) on the base model in `dtype`; write the run folder.

    Work happens in `<out_dir>.partial` (rank 0 holding `<out_dir>.lock`): a killed run resumes there from its
    last checkpoint when started again with the same settings; it is renamed to `out_dir` when complete. Only rank
    0 evaluates, logs, writes and returns the index. A non-finite step or a diverged validation stops the run
    with TrainingError. The `auto` settings are decided once (resuming: read back from settings.json).
    """
    out_dir = Path(out_dir)
    work = out_dir.with_name(out_dir.name + ".partial")
    require(settings.report_to)  # a missing tracking library fails before the model loads
    sess = build_session(base_dir, rendered_dir, settings, _resumable(work, settings, base_dir, rendered_dir), dtype)
    record = {"settings": as_dict(settings), "resolved": sess.resolved.to_json(), "base": str(base_dir),
              "rendered": str(rendered_dir), "total_steps": sess.total_steps, "init_adapter": sess.init_adapter,
              "precision": sess.precision.record()}
    with work_lock(out_dir) if sess.shard.is_main else contextlib.nullcontext():
        return _train(sess, record, rendered_dir, out_dir, work)


def _resumable(work: Path, settings: TrainSettings, base_dir: str | Path,
               rendered_dir: str | Path) -> ResolvedRun | None:
    """The resolved settings an interrupted run of the same settings and inputs recorded in `work`, or None; one
    resolved on another backend is not continued (its steps would not replay on either)."""
    try:
        record = json.loads((work / "settings.json").read_text())
        same = (record["settings"] == json.loads(json.dumps(as_dict(settings))) and record["base"] == str(base_dir)
                and record["rendered"] == str(rendered_dir))
        resolved = ResolvedRun.from_json(record["resolved"]) if same else None
    except (OSError, ValueError, KeyError, TypeError):
        return None
    why = resolved and resolved.reproducible_here()
    if why:
        print(f"orpo train: warning: not resuming {work}, starting again: {why}", file=sys.stderr)
        return None
    return resolved


@contextlib.contextmanager
def work_lock(out_dir: Path) -> Iterator[None]:
    """Hold `<out_dir>.lock` exclusively while training: a second `orpo train` on the same folder fails at once
    instead of adopting the same `.partial` folder. The file goes when the run ends."""
    path = out_dir.with_name(out_dir.name + ".lock")
    path.parent.mkdir(parents=True, exist_ok=True)
    while True:
        f = open(path, "a+", encoding="utf-8")
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            holder = f.read().strip() or "?"
            f.close()
            raise TrainingError(f"{out_dir}: another orpo train is writing it (lock {path} held by pid {holder}); "
                                "wait for it or stop it") from None
        if path.exists() and os.stat(path).st_ino == os.fstat(f.fileno()).st_ino:
            break
        f.close()  # the run before removed the file between our open and our lock: lock the new one
    try:
        f.truncate(0)
        f.write(f"{os.getpid()}\n")
        f.flush()
        yield
    finally:
        path.unlink(missing_ok=True)  # while still locked: whoever opens it next locks a new file
        f.close()


@contextlib.contextmanager
def bounded_memory(sess: Session, predicted: dict[str, Any] | None = None) -> Iterator[CachePolicy]:
    """The optimizer attached (its state resident before the first step) and MLX's cache and memory bounded by
    the run's policy (orpo.train.memory) beside its predicted peak, for training and its replay alike."""
    predicted = predicted or sess.plan or predict_memory(sess)
    with cache_policy(sess.engine.cache_limit_gb) as cache:
        sess.update_fn()
        cache.start(predicted["bytes"]["peak"])
        yield cache


def _train(sess: Session, record: dict[str, Any], rendered_dir: str | Path, out_dir: Path,
           work: Path) -> dict[str, Any] | None:
    s = sess.s
    start, resumed = _prepare_workdir(work, record, sess) if sess.shard.is_main else (0, False)
    start = sess.shard.broadcast_int(start)  # a barrier too: rank 0 has cleaned or resumed the folder
    if not sess.shard.is_main:
        return _follow(sess, work, start)
    progress = Progress(sess.total_steps, start, s.log_every)
    if resumed:
        progress.event({"resumed_from_step": start})
    # Printed before the first step; index.json's run.memory_predicted keeps it.
    predicted = sess.plan or predict_memory(sess)  # the plan's prediction is the run's (its budget beside)
    pool = cuda_pool_memory() or {}
    outside = pool["device_used"] - pool["pool_reserved"] if "device_used" in pool else 0
    warning = memory_warning(predicted, outside)
    progress.event({"predicted_memory_gb": predicted, **({"warning": warning} if warning else {})})
    val = load_pairs(Path(rendered_dir) / "validation.parquet")
    index = read_index(work)
    if not len(val):
        print("orpo train: note: no validation pairs (curate.validation_fraction 0: every pair trains): no "
              "validation, no divergence check on it, no best_margin/best_loss checkpoints; replay and generate "
              "take final or a step number", file=sys.stderr)
    elif start == 0:
        index["baseline"] = sess.evaluate(val)
        progress.event({"step": 0, "validation": index["baseline"]})

    # Each step takes the global batch; the remainder sits the epoch out (batch_schedule).
    per_epoch = max(1, len(sess.train) // (s.batch_size * s.grad_accum * sess.shard.size))
    ckpt_steps = set(_checkpoint_steps(s, sess.total_steps, per_epoch))
    compiles = sess.engine.compile and not sess.engine.plain  # the plain path never compiles
    with bounded_memory(sess, predicted) as cache, \
            open(work / "metrics.jsonl", "a", encoding="utf-8") as metrics_file, \
            Trackers(s.report_to, work, record, start) as trackers:
        if start == 0 and index.get("baseline"):
            trackers.log(index["baseline"], 0, "validation")
        rate = Throughput()
        batches = sess.prepare(start + 1) if start < sess.total_steps else []
        for step in range(start + 1, sess.total_steps + 1):
            started = sess.run(step, batches)
            # The host builds the next step's rows while the device runs this one; then it waits for the step.
            batches = sess.prepare(step + 1) if step < sess.total_steps else []
            m = started.read()
            cache.update(step)
            m = {"step": step, "split": "train", **{k: round(v, 6) for k, v in m.items()}, **rate.add(m),
                 "shapes": len(sess.signatures),
                 "active_memory_mb": round(mx.get_active_memory() / 2**20, 3),
                 "cache_memory_mb": round(mx.get_cache_memory() / 2**20, 3),
                 "peak_memory_mb": round(mx.get_peak_memory() / 2**20, 3)}
            if (pool := cuda_pool_memory()) is not None:  # what CUDA's pool holds beyond MLX's counts
                m |= {f"{k}_mb": round(v / 2**20, 3) for k, v in pool.items()}
            metrics_file.write(json.dumps(m) + "\n")
            trackers.log(m, step, "train")
            progress.step(m)
            if step % s.log_every == 0:
                metrics_file.flush()
            if step in ckpt_steps:
                v = sess.evaluate(val) if len(val) else None
                if v is not None:
                    metrics_file.write(json.dumps({"step": step, "split": "validation", **v}) + "\n")
                    trackers.log(v, step, "validation")
                metrics_file.flush()
                trackers.flush()
                why = v and diverged(v, index["baseline"], sess.model.args.vocab_size, s.divergence_ratio)
                if why:
                    kept = [k for k in kept_steps(work) if str(k) in index["checkpoints"]]
                    raise TrainingError(f"training diverged at step {step}: {why}; no checkpoint saved for it, "
                                        f"the last good one is {f'step {kept[-1]}' if kept else 'none (the start)'} "
                                        f"in {work} (lower train.lr, or set train.divergence_ratio: 0 to go on)")
                sha = save_checkpoint(work, step, sess.model, sess.opt, sess.adapter_config,
                                      {"epoch_of_step": (step - 1) // per_epoch, "seed": s.seed, **sess.loop_state()},
                                      keeps_optimizer(sess.adapter_config, step, sess.total_steps))
                index["checkpoints"][str(step)] = {"sha256": sha, "validation": v}
                _update_best(index)
                index["run"] = {**rate.summary(), "shapes": len(sess.signatures),
                                "traces": len(sess.signatures) if compiles else 0, "memory": cache.record(),
                                "memory_predicted": predicted}
                write_json(work / "index.json", index)
                # Prune only after index.json holds the new hash: a crash here leaves extra folders, never a gap.
                prune_checkpoints(work, index, s.keep_last)
                progress.event({"step": step, "validation": v, "sha256": sha[:16]})
        progress.event({"peak_memory_gb": {"predicted": predicted["peak"], "measured": cache.record()["peak_gb"]}})
    progress.close()

    index["final_step"] = sess.total_steps
    write_json(work / "index.json", index)
    final = step_dir(work, sess.total_steps)
    if is_full(sess.adapter_config):
        publish_model(final, work / "model")  # `orpo generate --model <run>/model`
    else:
        shutil.copy2(final / "adapters.safetensors", work / "adapters.safetensors")
        shutil.copy2(final / "adapter_config.json", work / "adapter_config.json")
    mark_complete(work, "train")
    if out_dir.exists():
        shutil.rmtree(out_dir)
    work.rename(out_dir)
    sess.shard.barrier()  # every rank returns only once the run folder is complete
    return index


def diverged(v: dict[str, float], start: dict[str, float], vocab: int, ratio: float) -> str | None:
    """Why validation metrics `v` count as diverged from the run's start, or None (ratio 0: never): the loss above
    `ratio` times the start's, or the NLL reaching ln(vocab) (a uniform model's) from below."""
    if ratio <= 0:
        return None
    if start["loss"] > 0 and v["loss"] > ratio * start["loss"]:
        return f"validation loss {v['loss']:.4f} is over {ratio:g}x the start's {start['loss']:.4f}"
    uniform = math.log(vocab)
    if v["nll"] >= UNIFORM_SHARE * uniform > start["nll"]:
        return (f"validation NLL {v['nll']:.4f} reached ln(vocab {vocab}) = {uniform:.4f}, a uniform model's "
                f"(it started at {start['nll']:.4f})")
    return None


# The share of ln(vocab) at which a validation NLL counts as a uniform model's.
UNIFORM_SHARE = 0.98


class Throughput:
    """Tokens per second since the loop started, by each count a step reports, and the padding fraction."""

    COUNTS = ("tokens", "row_tokens", "two_forward_tokens", "positions")

    def __init__(self) -> None:
        self.t0 = time.time()
        self.totals = dict.fromkeys(self.COUNTS, 0)

    def add(self, m: dict[str, float]) -> dict[str, float]:
        """This step's counts added; the rates since the start and the step's padding fraction."""
        for k in self.COUNTS:
            self.totals[k] += int(m[k])
        elapsed, rates = self._rates()
        return {"elapsed_s": round(elapsed, 3), **rates, "padding": _padding(m)}

    def _rates(self) -> tuple[float, dict[str, float]]:
        elapsed = max(time.time() - self.t0, 1e-9)
        return elapsed, {f"{k}_per_s": round(self.totals[k] / elapsed, 1) for k in self.COUNTS[:3]}

    def summary(self) -> dict[str, float]:
        """The whole loop's rates and padding (what index.json keeps)."""
        elapsed, rates = self._rates()
        return {"seconds": round(elapsed, 2), **rates, "padding": _padding(self.totals)}


def _padding(counts: dict[str, float]) -> float:
    """The share of the positions computed that held no pair's token."""
    return round(1 - counts["row_tokens"] / max(counts["positions"], 1), 4)


def _follow(sess: Session, work: Path, start: int) -> None:
    """A rank other than 0: from rank 0's resume point, compute every step's shard; write nothing."""
    if start:
        sess.restore(load_checkpoint(work, start, sess.model, sess.opt))
    for step in range(start + 1, sess.total_steps + 1):
        sess.step(step)
    sess.shard.barrier()


def _update_best(index: dict[str, Any]) -> None:
    ck = {int(k): v["validation"] for k, v in index["checkpoints"].items() if v["validation"]}
    if not ck:  # no validation split: nothing to choose by
        return
    index["best_margin_step"] = max(sorted(ck), key=lambda k: ck[k]["margin"])
    index["best_loss_step"] = min(sorted(ck), key=lambda k: ck[k]["loss"])


def _prepare_workdir(work: Path, record: dict[str, Any], sess: Session) -> tuple[int, bool]:
    """(the step to continue after, whether it resumed): the last checkpoint of an interrupted run with the same
    settings, else a clean start."""
    settings_path = work / "settings.json"
    if settings_path.exists() and json.loads(settings_path.read_text()) == json.loads(json.dumps(record)):
        index = read_index(work)
        # A checkpoint written just before a kill may be missing from index.json: resume from one that is in it.
        steps = [k for k in kept_steps(work) if str(k) in index["checkpoints"]]
        if steps:
            last = steps[-1]
            sess.restore(load_checkpoint(work, last, sess.model, sess.opt))
            _truncate_metrics(work / "metrics.jsonl", last)
            index["checkpoints"] = {k: v for k, v in index["checkpoints"].items() if int(k) <= last}
            write_json(work / "index.json", index)
            return last, True
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    write_json(settings_path, record)
    return 0, False


def _truncate_metrics(path: Path, last: int) -> None:
    if not path.exists():
        return
    keep = [ln for ln in path.read_text().splitlines() if ln.strip() and json.loads(ln)["step"] <= last]
    with atomic_path(path) as tmp:
        tmp.write_text("".join(ln + "\n" for ln in keep))


def replay(run_dir: str | Path, base_dir: str | Path, rendered_dir: str | Path, which: str | int = "best_margin",
           from_: str = "previous") -> dict[str, Any] | None:
    """Re-run training to a checkpoint step and compare the sha256 of its weights with the run's index.

    The run's settings.json drives it: its resolved settings (another backend is refused, `recorded_run`) and
    dtype; a run of N processes replays on N ranks, and only rank 0 returns the record. `from_="previous"` starts
    at the latest checkpoint on disk before the target (optimizer and loop state restored); "zero" at step 0.
    """
    run_dir = require_complete(run_dir, "training run")
    settings, resolved, record = recorded_run(run_dir)
    index = read_index(run_dir)
    target = resolve_step(index, which)
    # The dtype the run computed in, whatever this machine's auto would choose: the same numbers.
    sess = build_session(base_dir, rendered_dir, settings, resolved, record.get("precision", {}).get("dtype", "auto"))
    if record.get("init_adapter") and sess.init_adapter["sha256"] != record["init_adapter"]["sha256"]:
        raise ValueError(f"init_adapter {sess.init_adapter['path']} changed since the run (sha256 "
                         f"{sess.init_adapter['sha256'][:16]}, the run started from {record['init_adapter']['sha256'][:16]})")
    earlier = [k for k in kept_steps(run_dir) if k < target] if from_ == "previous" else []
    start = earlier[-1] if earlier else 0
    if start:
        sess.restore(load_checkpoint(run_dir, start, sess.model, sess.opt))
    t0 = time.time()
    with bounded_memory(sess) as cache:  # as the run trained
        for step in range(start + 1, target + 1):
            sess.step(step)
            cache.update(step)
    if not sess.shard.is_main:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        replayed = save_weights(sess.model, sess.adapter_config, Path(tmp))
    expected = index["checkpoints"][str(target)]["sha256"]
    return {
        "checkpoint": str(which), "step": target, "from_step": start, "steps_replayed": target - start,
        "expected_sha256": expected, "replayed_sha256": replayed, "equal": expected == replayed,
        "processes": sess.shard.size, "dtype": sess.precision.dtype, "seconds": round(time.time() - t0, 1),
    }
