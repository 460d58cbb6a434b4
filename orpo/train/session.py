"""One training session: model, optimizer, data and step order, and the step shared by train/resume/replay.

A step is two halves so the host's work overlaps the device's: `prepare(step)` builds its rows on the host,
`run(step, batches)` builds the step's graph (gradients, then clip and update under one `mx.compile`) and
returns its metrics unevaluated.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import mlx.core as mx
import mlx.nn as nn

from orpo.batching import batch_schedule
from orpo.device import on_cuda
from orpo.engine.queue import memory_limit
from orpo.io import sha256_file
from orpo.optim import FlatAdamW, lora_adamw, warmup_steps_for
from orpo.precision import Precision, load_model
from orpo.render.template import resolve_model_dir
from orpo.settings import as_dict
from orpo.train.accumulate import accumulate_grads
from orpo.train.data import Pairs, load_pairs, pair_lengths, scored_counts
from orpo.train.distributed import BACKEND_ENV, Shard, join, shard_micro_batches
from orpo.train.footprint import plan_memory
from orpo.train.full import full_adamw, is_full, start_full
from orpo.train.keys import DropoutKeys
from orpo.train.lambdas import ConstantLambda, LambdaController, lambda_schedule
from orpo.train.launch import resolve_backend
from orpo.train.lora import apply_lora, warm_start
from orpo.train.objectives import Objective, PairLoss, pair_objective
from orpo.train.rows import block_lengths
from orpo.train.settings import EngineSettings, Machine, ResolvedRun, TrainSettings
from orpo.train.step import (MicroBatch, batch_value_and_grad, check_attention, pair_scores, prepare,
                             plan_packing, prepare_packed_step, reference_model, resolve_engine, row_lengths,
                             segmented, tight_rows_fit)


class TrainingError(RuntimeError):
    """Training cannot go on (non-finite loss or gradients)."""


def resolve_run(settings: TrainSettings, model: nn.Module) -> ResolvedRun:
    """Every `auto` of `settings` decided on this machine for `model`: once per run (the run folder records it)."""
    dist = settings.distributed
    backend = (os.environ.get(BACKEND_ENV) or resolve_backend(dist.backend)) if dist.processes > 1 else dist.backend
    resolved = dataclasses.replace(settings, engine=resolve_engine(settings.engine),
                                   distributed=dataclasses.replace(dist, backend=backend))
    return ResolvedRun(resolved, tight_rows_fit(model), Machine.here())


@dataclass
class StepResult:
    """One optimizer step's metrics (arrays, evaluated when read), its host-side counts, the λ it ran with, and
    the λ schedule that reads its NLL once read."""

    step: int
    metrics: dict[str, mx.array]
    counts: dict[str, int]
    lam: float
    lambdas: ConstantLambda | LambdaController

    def read(self) -> dict[str, float]:
        """Wait for the step and return its metrics as floats; a non-finite loss or gradient raises TrainingError."""
        mx.eval(self.metrics)
        out = {k: v.item() for k, v in self.metrics.items()}
        if not out.pop("finite"):
            raise TrainingError(f"non-finite loss or gradient at step {self.step}: {out}")
        self.lambdas.observe(out["nll"])  # the next step's λ: read before it runs
        return {**out, **self.counts, "lambda": self.lam}


@dataclass
class Session:
    """Everything a step needs: model with LoRA, optimizer, data, the step order and the dropout keys; `s` is the
    run's resolved settings (no `auto` left)."""

    resolved: ResolvedRun
    model: nn.Module
    opt: FlatAdamW
    adapter_config: dict[str, Any]
    train: Pairs
    schedule: list[list[int]]
    keys: DropoutKeys
    init_adapter: dict[str, str] | None = None
    shard: Shard = field(default_factory=Shard)
    precision: Precision | None = None  # the dtype the model computes in (model.dtype), and why
    reference: nn.Module | None = None  # dpo's frozen starting weights in full-parameter training
    plan: dict[str, Any] | None = None  # segment_layers auto: the prediction it was planned on
    blocks: list[int] | None = None  # packed rows: each pair's block_lengths (computed here where not given)
    # Distinct micro-batch shapes seen (each a compiled trace when the engine compiles).
    signatures: set = field(default_factory=set)
    _update: tuple[int, Callable] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        check_attention(self.model, self.engine)
        self.lengths = row_lengths(self.train, self.engine, self.resolved.tight_rows)
        if not self.engine.pack_width:
            self.blocks = None
        elif self.blocks is None:
            self.blocks = block_lengths(self.train)
        if self.blocks and max(self.blocks) > self.engine.pack_width:
            i = max(range(len(self.blocks)), key=self.blocks.__getitem__)
            raise ValueError(f"train.engine.pack_width {self.engine.pack_width}: pair {self.train.ids[i]!r} takes "
                             f"{self.blocks[i]} positions (its prompt once and both responses); set pack_width to "
                             f"at least that, a multiple of {self.engine.input_multiple or 16}")
        self.objective = Objective.of(self.s)
        self.lambdas = lambda_schedule(self.s)

    def loop_state(self) -> dict[str, Any]:
        """What a checkpoint keeps beyond the weights and the optimizer for the steps after it to run alike."""
        state = self.lambdas.state()
        return {} if state is None else {"lambda_controller": state}

    def restore(self, state: dict[str, Any]) -> None:
        """Continue after a checkpoint: its state.json's loop state (the weights and optimizer restored apart)."""
        self.lambdas.load(state.get("lambda_controller"))

    @property
    def s(self) -> TrainSettings:
        return self.resolved.settings

    @property
    def engine(self) -> EngineSettings:
        return self.resolved.settings.engine

    @property
    def total_steps(self) -> int:
        return len(self.schedule)

    def micro_batches(self, step: int) -> list[list[int]]:
        """This rank's rows of global step `step` (1-based) in micro-batches of batch_size, cut in order of the
        length their rows pad to (`lengths`): the same mean gradient, each micro-batch of similar lengths."""
        rows = sorted(self.schedule[step - 1], key=lambda r: (self.lengths[r], r))
        return shard_micro_batches(rows, self.s.batch_size, self.shard.rank, self.shard.size)

    def prepare(self, step: int) -> list[MicroBatch]:
        """Step `step`'s micro-batches as rows (host work only: runs while the device computes the step before)."""
        tight = self.resolved.tight_rows
        if self.blocks:  # this rank's pairs of the step, packed
            rows = [r for piece in self.micro_batches(step) for r in piece]
            return prepare_packed_step(self.train.select(rows), [self.blocks[r] for r in rows], self.engine,
                                       self.s.nll_span)
        return [prepare(self.train.select(rows), self.engine, tight, self.s.nll_span) for rows in self.micro_batches(step)]

    def run(self, step: int, batches: list[MicroBatch]) -> StepResult:
        """Start optimizer step `step` (1-based) on its prepared micro-batches; its metrics are read later."""
        if not self.model.training:  # evaluate() leaves it in eval mode (no dropout)
            self.model.train()
        lam = self.lambdas.value
        loss = PairLoss(self.objective, lam)
        with memory_limit(self.engine.memory_limit_gb):

            def micro(j: int, sums: dict[str, mx.array]) -> tuple[dict[str, mx.array], Any]:
                self.keys.at(step, j)  # dropout masks of this micro-batch: keyed by (seed, step, j, module)
                self.signatures.add(batches[j].signature())
                (_, metrics), grads = batch_value_and_grad(self.model, batches[j], loss, self.engine, sums,
                                                           self.reference)
                return metrics, grads

            seen = len(self.signatures)
            shares = [b.packed.share for b in batches] if self.blocks else None
            evaluating = [segmented(b, self.engine) for b in batches]
            grads, metrics = accumulate_grads(micro, len(batches), shares, evaluating)
            counts = {k: sum(getattr(b, k) for b in batches)
                      for k in ("scored", "row_tokens", "two_forward_tokens", "positions")}
            counts["new_shapes"] = len(self.signatures) - seen  # each a new trace of a compiled step
            counts["segmented"] = sum(evaluating)
            # Every rank gets the global batch's mean gradients and metrics: clipping sees the global norm.
            grads, metrics, counts = self.shard.reduce(grads, metrics, counts)
            grad_norm, lr = self.update_fn()(grads)
            metrics = {**metrics, "grad_norm": grad_norm, "lr": lr}
            metrics["finite"] = mx.all(mx.isfinite(mx.stack([v.astype(mx.float32) for v in metrics.values()])))
            # Encoded now (under the memory limit), waited for in StepResult.read.
            mx.async_eval(metrics, self.opt.state)
        counts["tokens"] = counts.pop("scored")
        return StepResult(step, metrics, counts, lam, self.lambdas)

    def step(self, step: int) -> dict[str, float]:
        """Run optimizer step `step` (1-based) and return its metrics as floats."""
        return self.run(step, self.prepare(step)).read()

    def update_fn(self) -> Callable:
        """Clip and optimizer update as one compiled function of the gradients, compiled anew whenever the optimizer
        took its weights from the model again (a start, a restore)."""
        if not self.opt.attaches:
            self.opt.attach(self.model)
        if self.opt.bucketwise:  # evaluated bucket by bucket, each bucket's rule compiled on its own
            return lambda grads: self.opt.update(self.model, grads, self.s.grad_clip)
        if self._update is None or self._update[0] != self.opt.attaches:
            clip = self.s.grad_clip
            state = [self.model.state, self.opt.state]
            compiled = mx.compile(lambda grads: self.opt.update(self.model, grads, clip), inputs=state, outputs=state)
            self._update = (self.opt.attaches, compiled)
        return self._update[1]

    def evaluate(self, pairs: Pairs) -> dict[str, float]:
        """The objective's metrics over a whole split at the current λ (batched forwards, no dropout)."""
        self.model.eval()
        chosen, rejected, nll, counts, ref = [], [], [], [], []
        bs = self.s.batch_size
        by_length = sorted(range(len(pairs)), key=pair_lengths(pairs).__getitem__)
        for i in range(0, len(pairs), bs):
            batch = pairs.select(by_length[i : i + bs])
            lw, lr, nll_logp = pair_scores(self.model, batch, self.engine, self.s.nll_span, self.resolved.tight_rows)
            mx.eval(lw, lr, nll_logp)
            chosen.append(lw)
            rejected.append(lr)
            nll += [] if nll_logp is None else [nll_logp]
            counts.append(scored_counts(batch).reshape(2, -1))
            if self.objective.needs_reference:
                with reference_model(self.model, self.reference) as net:
                    ref_w, ref_r, _ = pair_scores(net, batch, self.engine, tight=self.resolved.tight_rows)
                    mx.eval(ref_w, ref_r)
                ref.append(mx.stack([ref_w, ref_r]))
        # [chosen of every batch; rejected of every batch], as pair_objective reads them
        flat = lambda parts: mx.concatenate(parts, axis=1).reshape(-1)  # noqa: E731
        loss = PairLoss(self.objective, self.lambdas.value, flat(ref) if ref else None)
        _, metrics = pair_objective(loss, mx.concatenate(chosen + rejected), flat(counts),
                                    mx.concatenate(nll) if nll else None)
        mx.eval(metrics)
        return {k: round(v.item(), 6) for k, v in metrics.items()}


def _refuse_identical(pairs: Pairs, path: Path) -> None:
    """Pairs whose chosen and rejected are the same tokens teach nothing (or_loss stays ln 2): warn, or refuse all."""
    same = sum(c == r for c, r in zip(pairs.chosen, pairs.rejected))
    if same == len(pairs):
        raise TrainingError(f"{path}: every pair's chosen and rejected tokens are identical: nothing to prefer "
                            "(the render stage drops such pairs; was this file rendered another way?)")
    if same:
        print(f"orpo train: warning: {same} of {len(pairs)} pairs in {path} have identical chosen and rejected "
              "tokens", file=sys.stderr)


def build_session(base_dir: str | Path, rendered_dir: str | Path, settings: TrainSettings,
                  resolved: ResolvedRun | None = None, dtype: str = "auto") -> Session:
    """Load the base model in `dtype`, add LoRA (warm-started if asked) or make every weight trainable (method
    full), and set up the optimizer and the step order; `resolved`: the run's recorded resolution, None: decide it."""
    shard = join(settings.distributed)
    model_dir = resolve_model_dir(base_dir, weights=True)
    model, _, precision = load_model(model_dir, dtype, announce=shard.is_main)
    planned = resolved is None
    if planned:
        resolved = resolve_run(settings, model)
    s = resolved.settings
    keys = shard.dropout_keys(s.seed)
    reference = None
    if s.method == "full":
        adapter_config = start_full(model, s, model_dir)
        if s.objective == "dpo":  # DPO's reference: the starting weights, frozen (the model's own copy trains)
            reference, _, _ = load_model(model_dir, dtype, announce=False)
            reference.freeze()
            reference.eval()
    else:
        adapter_config = apply_lora(model, s.lora, s.seed, keys)
    init = None
    if s.init_adapter:
        folder = warm_start(model, adapter_config, s.init_adapter)
        init = {"path": str(folder), "sha256": sha256_file(folder / "adapters.safetensors")}
    train = load_pairs(Path(rendered_dir) / "train.parquet")
    _refuse_identical(train, Path(rendered_dir) / "train.parquet")
    # Grouping by length saves padding but makes batches homogeneous; on the embedded data it slowed
    # learning more than it sped up steps (docs/embedded-default.md), so it is opt-in. Within a step the
    # micro-batches are cut by length whatever this says (Session.micro_batches).
    window = 32 if s.group_by_length else 1
    rows_per_step = s.batch_size * s.grad_accum * shard.size  # the global batch, cut per rank in micro_batches
    schedule = batch_schedule(pair_lengths(train), rows_per_step, s.epochs, s.seed, s.max_steps, window)
    rule = (s.schedule, s.lr, len(schedule), warmup_steps_for(len(schedule), s.warmup), s.weight_decay)
    opt = (full_adamw(*rule, s.bias_correction) if is_full(adapter_config)
           else lora_adamw(*rule, s.lora.plus_ratio, s.bias_correction))
    blocks = None
    if planned and "auto" in (settings.engine.pack_width, settings.engine.pack_rows):
        blocks = block_lengths(train)
        resolved = resolved.with_engine(**plan_packing(settings.engine, model, blocks, s.batch_size, on_cuda()))
    sess = Session(resolved, model, opt, adapter_config, train, schedule, keys, init, shard, precision=precision,
                   reference=reference, blocks=blocks)
    if planned and "auto" in settings.engine.memory_plan.values():  # a recorded run keeps the plan it made
        plan, sess.plan = plan_memory(sess, settings.engine)
        sess.resolved = resolved.with_engine(**plan)
    # Replay reads the settings back from here too, so the adapter records what produced it.
    adapter_config["orpo_train"] = as_dict(sess.s)
    return sess
