"""The train stage's settings (config section `train`), typed, and what one run resolved them to on its machine.

A run decides the machine-dependent `auto` values once (`orpo.train.session.resolve_run`) and records a
`ResolvedRun` in its settings.json; resume and replay use that record.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from orpo.settings import as_dict, build, from_mapping


@dataclass(frozen=True)
class LoraSettings:
    """train.lora: the adapters' shape and regularisation (the schema describes each key)."""

    rank: int
    alpha: float
    dropout: float
    plus_ratio: float
    rslora: bool
    num_layers: int
    target_modules: tuple[str, ...]


@dataclass(frozen=True)
class EngineSettings:
    """train.engine: how the step computes (all choices give the same loss and gradients within float tolerance).
    Resolved (`orpo.train.step.resolve_engine`), no value is `auto`; `width_multiple` 0 stays the loader's 16."""

    head: str
    head_chunk: int
    segment_layers: int | str
    segment_min_positions: int | str
    mlp_chunks: int | str
    prefix_sharing: bool | str
    prefix_attention: str
    attention_backward: str
    gated_mlp: bool | str
    width_multiple: int
    pack_width: int | str
    pack_rows: int | str
    compile: bool | str
    overlap: int
    memory_limit_gb: float
    cache_limit_gb: float | str

    @property
    def resolved(self) -> bool:
        """Whether the machine's choices are made (no `auto` left that the step would have to decide)."""
        return "auto" not in (self.prefix_sharing, self.compile, self.attention_backward, self.gated_mlp,
                              self.pack_width, self.pack_rows, *self.memory_plan.values())

    @property
    def memory_plan(self) -> dict[str, int | str]:
        """The settings that trade speed for memory, which `auto` plans per run (orpo.train.footprint.plan_memory)."""
        return {k: getattr(self, k) for k in ("segment_layers", "segment_min_positions", "mlp_chunks")}

    def segments_for(self, positions: int) -> int:
        """Layers per recomputed segment for a micro-batch of `positions` (rows x width): 0 (the plain backward)
        below segment_min_positions."""
        return self.segment_layers if positions >= self.segment_min_positions else 0

    @property
    def input_multiple(self) -> int | None:
        """What the forward's input length is padded to a multiple of (None: the loader's 16-token rounding)."""
        return self.width_multiple or None

    @property
    def plain(self) -> bool:
        """Whether this is the plain path: naive head, plain backward, no sharing (the oracle)."""
        return self.head == "naive" and self.segment_layers == 0 and self.prefix_sharing is False


@dataclass(frozen=True)
class DistributedSettings:
    """train.distributed: how many ranks, over which backend (`any` is decided at launch)."""

    processes: int
    backend: str
    hostfile: str | None


@dataclass(frozen=True)
class FullSettings:
    """The `train.full` section: full-parameter training's frozen modules."""

    freeze: tuple[str, ...]


@dataclass(frozen=True)
class ControllerSettings:
    """train.controller: the λ controller's gains, window, target drift and bounds (lambda_schedule controller)."""

    kp: float
    ki: float
    kd: float
    window: int
    target_drift: float
    lambda_min: float
    lambda_max: float


@dataclass(frozen=True)
class TrainSettings:
    """The `train` section: optimisation, schedule, checkpoints, and the nested lora, engine and distributed."""

    method: str
    lr: float
    lambda_: float
    objective: str
    beta: float
    gamma: float
    dpo_beta: float
    lambda_schedule: str
    controller: ControllerSettings
    nll_span: str
    schedule: str
    warmup: float | int
    epochs: int
    max_steps: int
    batch_size: int
    grad_accum: int
    group_by_length: bool
    grad_clip: float
    divergence_ratio: float
    weight_decay: float
    bias_correction: bool
    seed: int
    checkpoint_every: int
    checkpoint_each_epoch: bool
    keep_last: int
    log_every: int
    report_to: tuple[str, ...]
    init_adapter: str | None
    lora: LoraSettings
    full: FullSettings
    engine: EngineSettings
    distributed: DistributedSettings


# Each section's settings from its mapping (`what=` names it in errors): checked against the schema, its defaults
# filled in; the engine's as configured, `auto` values not yet decided.
train_settings = partial(build, TrainSettings, "train")
engine_settings = partial(build, EngineSettings, "train.engine")
lora_settings = partial(build, LoraSettings, "train.lora")


@dataclass(frozen=True)
class Machine:
    """What a run's `auto` values were decided on: the MLX backend, the device's name and MLX's version."""

    backend: str  # cuda, metal or cpu
    device: str
    mlx: str

    @classmethod
    def here(cls) -> Machine:
        """This process's machine, as MLX sees it."""
        import importlib.metadata

        import mlx.core as mx

        from orpo.device import on_cuda

        gpu = mx.default_device().type == mx.gpu
        backend = "cuda" if on_cuda() else "metal" if gpu and mx.metal.is_available() else "cpu"
        info = mx.device_info()
        return cls(backend, str(info.get("device_name", "")), importlib.metadata.version("mlx"))

    def describe(self) -> str:
        return f"{self.backend} ({self.device or 'unnamed device'}, mlx {self.mlx})"


# Settings added after runs were recorded, by section: the value such a run computed with.
ADDED_SINCE_RECORDED: dict[str, dict[str, Any]] = {"engine": {"attention_backward": "fused", "segment_min_positions": 0,
                                                               "pack_width": 0, "pack_rows": 1,
                                                               "gated_mlp": False}}


def as_recorded(settings: Mapping[str, Any]) -> Mapping[str, Any]:
    """Recorded train settings with each key of ADDED_SINCE_RECORDED a run's record lacks set to what it ran with."""
    out = dict(settings)
    for section, added in ADDED_SINCE_RECORDED.items():
        if isinstance(out.get(section), Mapping):
            out[section] = {**added, **out[section]}
    return out


@dataclass(frozen=True)
class ResolvedRun:
    """The settings a run uses, every `auto` decided once, and the machine that decided them; `tight_rows`:
    whether shared-prefix rows may be tight (orpo.train.step.tight_rows_fit)."""

    settings: TrainSettings
    tight_rows: bool
    machine: Machine

    def to_json(self) -> dict[str, Any]:
        return {"settings": as_dict(self.settings), "tight_rows": self.tight_rows,
                "machine": dataclasses.asdict(self.machine)}

    @classmethod
    def from_json(cls, record: Mapping[str, Any], where: str = "settings.json resolved") -> ResolvedRun:
        try:
            return cls(from_mapping(TrainSettings, as_recorded(record["settings"]), f"{where}.settings"),
                       bool(record["tight_rows"]), Machine(**record["machine"]))
        except (KeyError, TypeError) as e:
            raise ValueError(f"{where}: not a resolved-settings record ({e})") from None

    def with_engine(self, **changes: Any) -> ResolvedRun:
        """These settings with the engine's `changes` (the plans a run makes once it knows its model and data)."""
        engine = dataclasses.replace(self.settings.engine, **changes)
        return dataclasses.replace(self, settings=dataclasses.replace(self.settings, engine=engine))

    def reproducible_here(self, here: Machine | None = None) -> str | None:
        """Why this machine cannot replay the run bit for bit (another backend), or None."""
        here = here or Machine.here()
        if here.backend == self.machine.backend:
            return None
        e = self.settings.engine
        return (f"the run was resolved on {self.machine.describe()} (engine: compile {e.compile}, width_multiple "
                f"{e.width_multiple}, prefix_sharing {e.prefix_sharing}, tight_rows {self.tight_rows}); this machine "
                f"is {here.describe()}: a bit-exact replay needs the same backend ({self.machine.backend})")


def recorded_run(run_dir: str | Path) -> tuple[TrainSettings, ResolvedRun | None, dict[str, Any]]:
    """A run folder's settings.json: its settings as configured, as the run resolved them (None in a record
    without), and the whole record. Another backend is refused (ValueError, before any work); another device
    name or MLX version is warned about."""
    path = Path(run_dir) / "settings.json"
    record = json.loads(path.read_text())
    settings = from_mapping(TrainSettings, as_recorded(record["settings"]), f"{path}: settings")
    if "resolved" not in record:
        return settings, None, record
    resolved = ResolvedRun.from_json(record["resolved"], f"{path}: resolved")
    here = Machine.here()
    why = resolved.reproducible_here(here)
    if why:
        raise ValueError(f"cannot replay {run_dir} on this machine: {why}")
    for k in ("device", "mlx"):  # short of the backend: the device's name, MLX's version
        if getattr(resolved.machine, k) != getattr(here, k):
            print(f"orpo replay: warning: {run_dir}: {k} {getattr(resolved.machine, k)!r} recorded, "
                  f"{getattr(here, k)!r} here; the replay may not be bit-exact", file=sys.stderr)
    return settings, resolved, record
