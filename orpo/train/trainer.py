"""The ORPO loop: one step function shared by training, resume and replay, so all three agree bit for bit."""

from __future__ import annotations

import json
import math
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
from mlx_lm.utils import load_model

from orpo.config import section_defaults
from orpo.io import atomic_path, sha256_file, write_json
from orpo.optim import lr_schedule, warmup_steps_for
from orpo.train.checkpoint import kept_steps, load_checkpoint, read_index, save_checkpoint, step_dir
from orpo.batching import batch_schedule
from orpo.train.data import Pairs, load_pairs, pair_batch, pair_lengths
from orpo.train.head import response_mean_logps
from orpo.train.lora import apply_lora, save_adapter
from orpo.train.loss import orpo_loss

DEFAULTS: dict[str, Any] = section_defaults("train")


class TrainingError(RuntimeError):
    """Training cannot go on (non-finite loss or gradients)."""


def resolve_settings(settings: dict[str, Any]) -> dict[str, Any]:
    """Defaults overlaid with the given settings (one level deep for `lora`)."""
    s = {**DEFAULTS, **settings}
    s["lora"] = {**DEFAULTS["lora"], **settings.get("lora", {})}
    return s


@dataclass
class Session:
    """Everything a step needs: model with LoRA, optimizer, data and the step order."""

    s: dict[str, Any]
    model: nn.Module
    opt: optim.Optimizer
    adapter_config: dict[str, Any]
    train: Pairs
    schedule: list[list[int]]
    loss_and_grad: Any = field(repr=False, default=None)

    @property
    def total_steps(self) -> int:
        return len(self.schedule)

    def step(self, step: int) -> dict[str, float]:
        """Run optimizer step `step` (1-based) and return its metrics as floats."""
        # Per-step seed: LoRA dropout masks depend only on (seed, step), so replay and resume reproduce them.
        mx.random.seed(self.s["seed"] * 1_000_003 + step)
        rows = self.schedule[step - 1]
        tokens, mask = pair_batch(self.train, rows)
        (_, metrics), grads = self.loss_and_grad(self.model, tokens, mask, len(rows), self.s["lambda"])
        if self.s["grad_clip"] > 0:
            grads, grad_norm = optim.clip_grad_norm(grads, self.s["grad_clip"])
        else:
            grad_norm = mx.sqrt(sum((g * g).sum() for g in _leaves(grads)))
        metrics["grad_norm"] = grad_norm
        mx.eval(metrics)
        out = {k: v.item() for k, v in metrics.items()}
        if not all(math.isfinite(v) for v in out.values()):
            raise TrainingError(f"non-finite loss or gradient at step {step}: {out}")
        self.opt.update(self.model, grads)
        mx.eval(self.model.trainable_parameters(), self.opt.state)
        out["lr"] = self.opt.learning_rate.item()  # the rate this update used
        out["tokens"] = int(mask.sum().item())
        return out

    def evaluate(self, pairs: Pairs) -> dict[str, float]:
        """ORPO metrics over a whole split (exact means over rows, batched forwards)."""
        lw, lr = [], []
        bs = self.s["batch_size"]
        by_length = sorted(range(len(pairs)), key=pair_lengths(pairs).__getitem__)
        for i in range(0, len(pairs), bs):
            rows = by_length[i : i + bs]
            tokens, mask = pair_batch(pairs, rows)
            logps = response_mean_logps(self.model, tokens, mask)
            mx.eval(logps)
            lw.append(logps[: len(rows)])
            lr.append(logps[len(rows):])
        _, metrics = orpo_loss(mx.concatenate(lw), mx.concatenate(lr), self.s["lambda"])
        mx.eval(metrics)
        return {k: round(v.item(), 6) for k, v in metrics.items()}


def _leaves(tree: Any) -> list[mx.array]:
    from mlx.utils import tree_flatten
    return [v for _, v in tree_flatten(tree)]


def _pair_loss(model: nn.Module, tokens: mx.array, mask: mx.array, n: int, lam: float):
    logps = response_mean_logps(model, tokens, mask)
    return orpo_loss(logps[:n], logps[n:], lam)


def build_session(base_dir: str | Path, rendered_dir: str | Path, settings: dict[str, Any]) -> Session:
    """Load the base model, add LoRA, and set up the optimizer and the step order from the settings."""
    s = resolve_settings(settings)
    model, _ = load_model(Path(base_dir))
    adapter_config = apply_lora(model, s["lora"], s["seed"])
    train = load_pairs(Path(rendered_dir) / "train.parquet")
    # Grouping by length saves padding but makes batches homogeneous; on the embedded data it slowed
    # learning more than it sped up steps (bench numbers in docs/architecture.md), so it is opt-in.
    window = 32 if s["group_by_length"] else 1
    schedule = batch_schedule(pair_lengths(train), s["batch_size"], s["epochs"], s["seed"], s["max_steps"], window)
    lr = lr_schedule(s["schedule"], s["lr"], len(schedule), warmup_steps_for(len(schedule), s["warmup"]))
    opt = optim.AdamW(learning_rate=lr, weight_decay=s["weight_decay"])
    return Session(s, model, opt, adapter_config, train, schedule, nn.value_and_grad(model, _pair_loss))


def _checkpoint_steps(s: dict[str, Any], total: int) -> list[int]:
    every = s["checkpoint_every"]
    steps = list(range(every, total + 1, every)) if every > 0 else []
    return steps if steps and steps[-1] == total else steps + [total]


def _log(line: dict[str, Any]) -> None:
    print(json.dumps(line), file=sys.stderr, flush=True)


def train(base_dir: str | Path, rendered_dir: str | Path, out_dir: str | Path, settings: dict[str, Any]) -> dict[str, Any]:
    """Train an ORPO LoRA adapter; write the run folder (adapter, checkpoints, index, metrics).

    Work happens in `<out_dir>.partial`; a run killed midway resumes there from its last checkpoint when
    started again with the same settings, and the folder is renamed to `out_dir` when the run completes.
    """
    out_dir = Path(out_dir)
    work = out_dir.with_name(out_dir.name + ".partial")
    sess = build_session(base_dir, rendered_dir, settings)
    s = sess.s
    record = {"settings": s, "base": str(base_dir), "rendered": str(rendered_dir), "total_steps": sess.total_steps}
    start = _prepare_workdir(work, record, sess)
    val = load_pairs(Path(rendered_dir) / "validation.parquet")
    index = read_index(work)
    if start == 0:
        index["baseline"] = sess.evaluate(val)
        _log({"step": 0, "validation": index["baseline"]})

    ckpt_steps = set(_checkpoint_steps(s, sess.total_steps))
    t0, tokens = time.time(), 0
    with open(work / "metrics.jsonl", "a", encoding="utf-8") as metrics_file:
        for step in range(start + 1, sess.total_steps + 1):
            m = sess.step(step)
            tokens += m["tokens"]
            m = {"step": step, "split": "train", **{k: round(v, 6) for k, v in m.items()},
                 "tokens_per_s": round(tokens / (time.time() - t0), 1),
                 "active_memory_mb": round(mx.get_active_memory() / 2**20, 1),
                 "peak_memory_mb": round(mx.get_peak_memory() / 2**20, 1)}
            metrics_file.write(json.dumps(m) + "\n")
            if step % s["log_every"] == 0 or step == sess.total_steps:
                metrics_file.flush()
                _log({k: m[k] for k in ("step", "loss", "nll", "or_loss", "accuracy", "margin", "lr",
                                        "tokens_per_s", "active_memory_mb")})
            if step in ckpt_steps:
                v = sess.evaluate(val)
                metrics_file.write(json.dumps({"step": step, "split": "validation", **v}) + "\n")
                metrics_file.flush()
                sha = save_checkpoint(work, step, sess.model, sess.opt, sess.adapter_config,
                                      {"epoch_of_step": _epoch_of(sess, step), "seed": s["seed"]})
                index["checkpoints"][str(step)] = {"sha256": sha, "validation": v}
                _update_best(index)
                write_json(work / "index.json", index)
                _log({"step": step, "validation": v, "sha256": sha[:16]})

    index["final_step"] = sess.total_steps
    write_json(work / "index.json", index)
    final = step_dir(work, sess.total_steps)
    shutil.copy2(final / "adapters.safetensors", work / "adapters.safetensors")
    shutil.copy2(final / "adapter_config.json", work / "adapter_config.json")
    if out_dir.exists():
        shutil.rmtree(out_dir)
    work.rename(out_dir)
    return index


def _epoch_of(sess: Session, step: int) -> int:
    per_epoch = max(1, sess.total_steps // max(1, sess.s["epochs"]))
    return (step - 1) // per_epoch


def _update_best(index: dict[str, Any]) -> None:
    ck = {int(k): v["validation"] for k, v in index["checkpoints"].items()}
    index["best_margin_step"] = max(sorted(ck), key=lambda k: ck[k]["margin"])
    index["best_loss_step"] = min(sorted(ck), key=lambda k: ck[k]["loss"])


def _prepare_workdir(work: Path, record: dict[str, Any], sess: Session) -> int:
    """Resume from the last checkpoint of an interrupted run with the same settings; else start clean."""
    settings_path = work / "settings.json"
    if work.exists() and settings_path.exists() and json.loads(settings_path.read_text()) == json.loads(json.dumps(record)):
        steps = kept_steps(work)
        if steps:
            last = steps[-1]
            load_checkpoint(work, last, sess.model, sess.opt)
            _truncate_metrics(work / "metrics.jsonl", last)
            index = read_index(work)
            index["checkpoints"] = {k: v for k, v in index["checkpoints"].items() if int(k) <= last}
            write_json(work / "index.json", index)
            _log({"resumed_from_step": last})
            return last
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    write_json(settings_path, record)
    return 0


def _truncate_metrics(path: Path, last: int) -> None:
    if not path.exists():
        return
    keep = [ln for ln in path.read_text().splitlines() if ln.strip() and json.loads(ln)["step"] <= last]
    with atomic_path(path) as tmp:
        tmp.write_text("".join(ln + "\n" for ln in keep))


def replay(
    run_dir: str | Path, base_dir: str | Path, rendered_dir: str | Path, which: str | int = "best_margin",
    from_: str = "previous",
) -> dict[str, Any]:
    """Re-run training to a checkpoint step and compare the adapter's sha256 with the run's index.

    `from_="previous"` starts at the latest kept checkpoint before the target (its optimizer and loop state
    restored); `from_="zero"` retrains from step 0.
    """
    from orpo.train.checkpoint import resolve_step

    run_dir = Path(run_dir)
    record = json.loads((run_dir / "settings.json").read_text())
    index = read_index(run_dir)
    target = resolve_step(index, which)
    sess = build_session(base_dir, rendered_dir, record["settings"])
    earlier = [k for k in kept_steps(run_dir) if k < target] if from_ == "previous" else []
    if from_ not in ("previous", "zero"):
        raise ValueError(f"replay from {from_!r}: use 'previous' or 'zero'")
    start = earlier[-1] if earlier else 0
    if start:
        load_checkpoint(run_dir, start, sess.model, sess.opt)
    t0 = time.time()
    for step in range(start + 1, target + 1):
        sess.step(step)
    with tempfile.TemporaryDirectory() as tmp:
        save_adapter(sess.model, sess.adapter_config, Path(tmp))
        replayed = sha256_file(Path(tmp) / "adapters.safetensors")
    expected = index["checkpoints"][str(target)]["sha256"]
    return {
        "checkpoint": str(which), "step": target, "from_step": start, "steps_replayed": target - start,
        "expected_sha256": expected, "replayed_sha256": replayed, "equal": expected == replayed,
        "seconds": round(time.time() - t0, 1),
    }
