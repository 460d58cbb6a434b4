"""Full-parameter training (`train.method: full`): every weight of the model trains, bar `train.full.freeze`.

The model computes in its own dtype while the optimizer keeps float32 master weights and moments
(`full_adamw`). Each checkpoint folder is itself a loadable model folder (with the optimizer's state beside
it), and the run ends with `model/`, the final one (`orpo generate --model <run>/model`).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from orpo.device import on_gpu
from orpo.engine.embedding import with_summed_embeddings
from orpo.io import sha256_file
from orpo.optim import FlatAdamW, lr_schedule
from orpo.train.settings import TrainSettings

WEIGHTS = "model.safetensors"
# A bucket of the flat optimizer holds at most this many elements (a weight larger than it is its own): an
# update's temporaries are a bucket's, not the model's, and a lone weight's gradient is a view, not a copy.
BUCKET_ELEMENTS = 2**24
# Model folder files a checkpoint does not copy from the base: its weights (written anew) and their index.
_WEIGHT_SUFFIXES = (".safetensors", ".safetensors.index.json", ".npz", ".bin", ".pt", ".gguf")


def is_full(adapter_config: dict[str, Any]) -> bool:
    """Whether a run's record (its adapter_config, or the dict `apply_full` returns) is of a full-parameter run."""
    return adapter_config.get("fine_tune_type") == "full"


def frozen_modules(model: nn.Module, freeze: list[str]) -> list[str]:
    """The module paths `train.full.freeze` names: each entry a full path or a path's last parts ("embed_tokens")."""
    paths = [name for name, _ in model.named_modules() if name]
    found: list[str] = []
    for entry in freeze:
        hits = [p for p in paths if p == entry or p.endswith("." + entry)]
        if not hits:
            hint = (" (the head is the tied model.embed_tokens: freeze embed_tokens to freeze it)"
                    if entry == "lm_head" and "lm_head" not in model else "")
            raise ValueError(f"train.full.freeze: {entry!r} names no module of this model{hint}; "
                             f"top-level modules: {sorted({p.split('.layers.')[0] for p in paths if p.count('.') < 2})}")
        found.extend(h for h in hits if h not in found)
    return found


def apply_full(model: nn.Module, settings: dict[str, Any]) -> dict[str, Any]:
    """Make every weight of `model` trainable but the frozen modules; returns the run's weight record (what
    adapter_config is to LoRA). A quantized model is refused."""
    quantized = [name for name, m in model.named_modules()
                 if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding))]
    if quantized:
        raise ValueError(f"train.method: full cannot train a quantized model ({quantized[0]} is "
                         f"{type(dict(model.named_modules())[quantized[0]]).__name__}); use a float model or "
                         "train.method: lora")
    freeze = list(settings.get("freeze") or [])
    model.unfreeze()
    modules = dict(model.named_modules())
    frozen = frozen_modules(model, freeze)
    for path in frozen:
        modules[path].freeze()
    if on_gpu():  # a repeated token's rows summed in a fixed order: replay stays bit-exact
        with_summed_embeddings(model)
    trainable = tree_flatten(model.trainable_parameters())
    if not trainable:
        raise ValueError(f"train.full.freeze: {freeze} freezes every weight of the model: nothing to train")
    dtypes = sorted({str(v.dtype).removeprefix("mlx.core.") for _, v in tree_flatten(model.parameters())})
    return {"fine_tune_type": "full", "freeze": freeze, "frozen_modules": frozen,
            "trainable_parameters": sum(v.size for _, v in trainable), "dtypes": dtypes}


def full_adamw(kind: str, lr: float, total_steps: int, warmup_steps: int, weight_decay: float,
               bias_correction: bool = False) -> FlatAdamW:
    """AdamW over every trainable weight with float32 master weights and moments, in buckets of BUCKET_ELEMENTS
    updated one at a time in place. At a bf16 model's lr of 5e-6 an update is below half a bf16 ulp of most weights
    and would be lost in place (tests/test_train_full.py); a float32 master keeps it."""
    return FlatAdamW([lr_schedule(kind, lr, total_steps, warmup_steps)], weight_decay, lambda name: 0,
                     master_dtype=mx.float32, bucket_elements=BUCKET_ELEMENTS, bias_correction=bias_correction,
                     bucketwise=True)


# --- what a full run writes: model folders ---

# The base folder's own records (orpo's folder marker and the base stage's manifests), not the model's.
_STAGE_FILES = ("complete.json", "manifest.json", "warmup_log.json")
# The record of what trained, beside the weights (what adapter_config.json is to an adapter).
RECORD = "full_config.json"
# Files of a checkpoint folder that are the optimizer's and the loop's, not the model's.
_CHECKPOINT_ONLY = ("optimizer.safetensors", "state.json")


def start_full(model: nn.Module, settings: TrainSettings, base_dir: Path) -> dict[str, Any]:
    """`apply_full` for a run's resolved settings; the record names the base folder its config and tokenizer come from."""
    if settings.init_adapter:
        raise ValueError("train.init_adapter warm-starts LoRA weights; with train.method: full, start from a "
                         "model folder instead (a full run's <run>/model is one)")
    return {**apply_full(model, {"freeze": list(settings.full.freeze)}), "base_folder": str(base_dir)}


def save_model_folder(model: nn.Module, record: dict[str, Any], folder: Path) -> str:
    """Write `folder` as a model folder mlx-lm loads: every weight in the model's dtype (`model.safetensors`, sorted,
    so equal weights give equal bytes), the base's files but its weights and the stage records (config, tokenizer,
    template, generation config), and the run's record; returns the weights' sha256."""
    weights = dict(sorted(tree_flatten(model.parameters())))
    mx.save_safetensors(str(folder / WEIGHTS), weights, metadata={"format": "mlx"})
    for src in sorted(Path(record["base_folder"]).iterdir()):
        if not (src.name.startswith(".") or src.name in _STAGE_FILES or src.name.endswith(_WEIGHT_SUFFIXES)):
            (shutil.copytree if src.is_dir() else shutil.copyfile)(src, folder / src.name)
    (folder / RECORD).write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
    return sha256_file(folder / WEIGHTS)


def load_model_weights(model: nn.Module, folder: Path) -> None:
    """Load a full checkpoint's weights (every one of the model's) into the model."""
    model.load_weights(str(folder / WEIGHTS), strict=True)
    mx.eval(model.parameters())


def publish_model(checkpoint: Path, out: Path) -> None:
    """`out`: the final checkpoint as a model folder (hard-linked where possible), without the optimizer's files."""
    out.mkdir()
    for src in checkpoint.iterdir():
        if src.name in _CHECKPOINT_ONLY:
            continue
        try:
            (shutil.copytree if src.is_dir() else os.link)(src, out / src.name)
        except OSError:
            shutil.copy2(src, out / src.name)


def keeps_optimizer(record: dict[str, Any], step: int, total_steps: int) -> bool:
    """Whether the checkpoint at `step` holds the optimizer state: always for LoRA; for a full run not at the last
    step, which nothing resumes or replays from (there it would be 3x the weights in float32 on disk)."""
    return not (is_full(record) and step == total_steps)
