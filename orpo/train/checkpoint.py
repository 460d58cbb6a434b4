"""Checkpoints: adapter (or, for a full run, the model folder), optimizer state and loop state per step, and the
index of their hashes."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from orpo.io import atomic_path, sha256_file, write_json
from orpo.optim import FlatAdamW
from orpo.train.full import WEIGHTS, is_full, load_model_weights, save_model_folder
from orpo.train.lora import load_adapter_weights, save_adapter


def step_dir(run_dir: Path, step: int) -> Path:
    """Folder of the checkpoint at `step`."""
    return run_dir / "checkpoints" / f"step-{step:06d}"


def save_weights(model: nn.Module, adapter_config: dict[str, Any], folder: Path) -> str:
    """Write what the run trains into `folder` (the adapter, or a full run's model folder); returns its weights' sha256."""
    if is_full(adapter_config):
        return save_model_folder(model, adapter_config, folder)
    save_adapter(model, adapter_config, folder)
    return sha256_file(folder / "adapters.safetensors")


def save_checkpoint(run_dir: Path, step: int, model: nn.Module, opt: FlatAdamW, adapter_config: dict[str, Any],
                    state: dict[str, Any], optimizer: bool = True) -> str:
    """Write the checkpoint at `step` atomically (the optimizer state unless not `optimizer`); returns its sha256."""
    with atomic_path(step_dir(run_dir, step)) as tmp:
        tmp.mkdir()
        sha = save_weights(model, adapter_config, tmp)
        if optimizer:
            mx.save_safetensors(str(tmp / "optimizer.safetensors"), dict(sorted(opt.state_dict().items())))
        write_json(tmp / "state.json", {**state, "step": step})
    return sha


def load_checkpoint(run_dir: Path, step: int, model: nn.Module, opt: FlatAdamW) -> dict[str, Any]:
    """Restore the weights and optimizer state of `step` (fresh moments where the checkpoint holds none: a full
    run's last step, from which no step follows); returns its state.json."""
    d = step_dir(run_dir, step)
    if (d / WEIGHTS).is_file() and not (d / "adapters.safetensors").is_file():
        load_model_weights(model, d)
    else:
        load_adapter_weights(model, d)
    if (d / "optimizer.safetensors").is_file():
        opt.load_state_dict(model, mx.load(str(d / "optimizer.safetensors")))
    else:
        opt.attach(model)
    return json.loads((d / "state.json").read_text())


def read_index(run_dir: Path) -> dict[str, Any]:
    """index.json: {'checkpoints': {step: {sha256, validation}}, best steps, final step}."""
    path = run_dir / "index.json"
    return json.loads(path.read_text()) if path.exists() else {"checkpoints": {}}


def kept_steps(run_dir: Path) -> list[int]:
    """Steps whose checkpoint folder is on disk, ascending."""
    return sorted(int(p.name.split("-")[1]) for p in (run_dir / "checkpoints").glob("step-*")
                  if (p / "state.json").exists())


def prune_checkpoints(run_dir: Path, index: dict[str, Any], keep_last: int) -> list[int]:
    """Delete checkpoint folders but the newest `keep_last` and the best-margin/best-loss ones; returns the removed
    (index.json keeps every sha256, so a removed step still replays from an earlier kept one)."""
    if keep_last <= 0:
        return []
    steps = kept_steps(run_dir)
    keep = set(steps[-keep_last:]) | {index.get("best_margin_step"), index.get("best_loss_step")}
    removed = [k for k in steps if k not in keep]
    for k in removed:
        shutil.rmtree(step_dir(run_dir, k))
    return removed


def resolve_step(index: dict[str, Any], which: str | int) -> int:
    """A step number from 'final', 'best_margin', 'best_loss' or a number."""
    if isinstance(which, int) or str(which).isdigit():
        step = int(which)
    elif which in ("final", "best_margin", "best_loss"):
        step = index.get(f"{which}_step")
        if step is None and which != "final" and not index.get("baseline"):
            raise ValueError(f"checkpoint {which}: the run had no validation pairs (curate.validation_fraction 0), so "
                             "no checkpoint was chosen by validation; use final or a step number")
        if step is None:
            raise ValueError(f"the run's index.json has no {which}_step")
    else:
        raise ValueError(f"unknown checkpoint {which!r}: use final, best_margin, best_loss or a step number")
    if str(step) not in index["checkpoints"]:
        raise ValueError(f"step {step} is not a checkpoint of this run (have {sorted(map(int, index['checkpoints']))})")
    return step


def checkpoint_folder(run: Path, checkpoint: str | int, use: str = "use") -> Path:
    """The adapter folder of a run's checkpoint (final, best_margin, best_loss or a step): the run itself for final,
    else its kept checkpoint folder; a pruned one raises ValueError saying how to recover it."""
    if str(checkpoint) == "final":
        return run
    step = resolve_step(read_index(run), checkpoint)
    folder = step_dir(run, step)
    if not folder.exists():
        raise ValueError(f"checkpoint {step} of {run} was pruned (train.keep_last); recover it with "
                         f"`orpo replay --run {run} --checkpoint {step} ...` or {use} a kept step")
    return folder
