"""One training session: model with LoRA, optimizer, data and step order, and the step shared by train/resume/replay."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
from mlx.utils import tree_flatten
from mlx_lm.utils import load_model

from orpo.batching import batch_schedule
from orpo.config import section_defaults
from orpo.engine.objective import pair_logps, pair_value_and_grad
from orpo.engine.queue import memory_limit
from orpo.io import sha256_file
from orpo.optim import current_lr, lora_adamw, warmup_steps_for
from orpo.render.template import resolve_model_dir
from orpo.train.accumulate import accumulate_grads
from orpo.train.data import Pairs, load_pairs, pair_lengths
from orpo.train.distributed import Shard, join
from orpo.train.keys import DropoutKeys
from orpo.train.lora import adapter_folder, apply_lora, warm_start
from orpo.train.loss import orpo_loss

DEFAULTS: dict[str, Any] = section_defaults("train")


class TrainingError(RuntimeError):
    """Training cannot go on (non-finite loss or gradients)."""


def resolve_settings(settings: dict[str, Any]) -> dict[str, Any]:
    """Defaults overlaid with the given settings (one level deep for the nested sections)."""
    s = {**DEFAULTS, **settings}
    for section in ("lora", "engine", "distributed"):
        s[section] = {**DEFAULTS[section], **settings.get(section, {})}
    return s


@dataclass
class Session:
    """Everything a step needs: model with LoRA, optimizer, data, the step order and the dropout keys."""

    s: dict[str, Any]
    model: nn.Module
    opt: optim.Optimizer
    adapter_config: dict[str, Any]
    train: Pairs
    schedule: list[list[int]]
    keys: DropoutKeys
    init_adapter: dict[str, str] | None = None
    shard: Shard = field(default_factory=Shard)

    @property
    def total_steps(self) -> int:
        return len(self.schedule)

    def micro_batches(self, step: int) -> list[list[int]]:
        """This rank's rows of global step `step` (1-based), cut into micro-batches of batch_size."""
        return self.shard.micro_batches(self.schedule[step - 1], self.s["batch_size"])

    def step(self, step: int) -> dict[str, float]:
        """Run optimizer step `step` (1-based) and return its metrics as floats."""
        with memory_limit(float(self.s["engine"]["memory_limit_gb"])):
            return self._step(step)

    def _step(self, step: int) -> dict[str, float]:
        if not self.model.training:  # evaluate() leaves it in eval mode (no dropout)
            self.model.train()
        parts = self.micro_batches(step)
        tokens = 0

        def micro(j: int) -> tuple[dict[str, mx.array], Any]:
            nonlocal tokens
            self.keys.at(step, j)  # dropout masks of this micro-batch: keyed by (seed, step, j, module)
            pairs = self.train.select(parts[j])
            tokens += sum(map(sum, pairs.chosen_mask + pairs.rejected_mask))  # scored tokens
            (_, metrics), grads = pair_value_and_grad(self.model, pairs, self.s["lambda"], self.s["engine"])
            return metrics, grads

        grads, metrics = accumulate_grads(micro, len(parts))
        # Every rank gets the global batch's mean gradients and metrics: clipping sees the global norm.
        grads, metrics, tokens = self.shard.reduce(grads, metrics, tokens)
        if self.s["grad_clip"] > 0:
            grads, grad_norm = optim.clip_grad_norm(grads, self.s["grad_clip"])
        else:
            grad_norm = mx.sqrt(sum((g * g).sum() for _, g in tree_flatten(grads)))
        metrics["grad_norm"] = grad_norm
        mx.eval(metrics)
        out = {k: v.item() for k, v in metrics.items()}
        if not all(math.isfinite(v) for v in out.values()):
            raise TrainingError(f"non-finite loss or gradient at step {step}: {out}")
        self.opt.update(self.model, grads)
        mx.eval(self.model.trainable_parameters(), self.opt.state)
        out["lr"] = current_lr(self.opt)  # the rate this update used
        out["tokens"] = tokens
        return out

    def evaluate(self, pairs: Pairs) -> dict[str, float]:
        """ORPO metrics over a whole split (exact means over rows, batched forwards, no dropout)."""
        self.model.eval()
        lw, lr = [], []
        bs = self.s["batch_size"]
        by_length = sorted(range(len(pairs)), key=pair_lengths(pairs).__getitem__)
        for i in range(0, len(pairs), bs):
            rows = by_length[i : i + bs]
            chosen, rejected = pair_logps(self.model, pairs.select(rows), self.s["engine"])
            mx.eval(chosen, rejected)
            lw.append(chosen)
            lr.append(rejected)
        _, metrics = orpo_loss(mx.concatenate(lw), mx.concatenate(lr), self.s["lambda"])
        mx.eval(metrics)
        return {k: round(v.item(), 6) for k, v in metrics.items()}


def build_session(base_dir: str | Path, rendered_dir: str | Path, settings: dict[str, Any]) -> Session:
    """Load the base model, add LoRA (warm-started if asked), and set up the optimizer and the step order."""
    s = resolve_settings(settings)
    shard = join(s["distributed"])
    model, _ = load_model(resolve_model_dir(base_dir, weights=True))
    keys = shard.dropout_keys(s["seed"])
    adapter_config = apply_lora(model, s["lora"], s["seed"], keys)
    init = None
    if s["init_adapter"]:
        folder = warm_start(model, adapter_config, adapter_folder(s["init_adapter"]))
        init = {"path": str(folder), "sha256": sha256_file(folder / "adapters.safetensors")}
    # Replay reads the settings back from here too, so the adapter records what produced it.
    adapter_config["orpo_train"] = s
    train = load_pairs(Path(rendered_dir) / "train.parquet")
    # Grouping by length saves padding but makes batches homogeneous; on the embedded data it slowed
    # learning more than it sped up steps (docs/embedded-default.md), so it is opt-in.
    window = 32 if s["group_by_length"] else 1
    rows_per_step = s["batch_size"] * s["grad_accum"] * shard.size  # the global batch, cut per rank in micro_batches
    schedule = batch_schedule(pair_lengths(train), rows_per_step, s["epochs"], s["seed"], s["max_steps"], window)
    opt = lora_adamw(s["schedule"], s["lr"], len(schedule), warmup_steps_for(len(schedule), s["warmup"]),
                     s["weight_decay"], s["lora"]["plus_ratio"])
    return Session(s, model, opt, adapter_config, train, schedule, keys, init, shard)
