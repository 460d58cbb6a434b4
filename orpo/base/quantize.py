"""The `quantize` stage: the base model's weights quantized once, for LoRA on a quantized base (QLoRA).

mlx-lm's affine quantization (`mlx_lm.utils.quantize_model`: every Linear and Embedding whose input width the
group size divides, the head included), written as an mlx-lm model folder that every later stage loads as it
loads any model. The tokenizer and template files are copied byte for byte, so rendering is unchanged.
"""

from __future__ import annotations

import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from orpo.folders import mark_complete
from orpo.io import atomic_path, write_json

# Files of the source folder that the quantized folder rewrites (weights and the config holding "quantization").
REWRITTEN = ("config.json", "model.safetensors.index.json")


@dataclass(frozen=True)
class QuantizeSettings:
    """The `quantize` section (the schema describes each key)."""

    bits: int | None
    group_size: int


def quantize_in_memory(model: nn.Module, config: dict[str, Any], s: QuantizeSettings) -> tuple[nn.Module, dict]:
    """`model` with its quantizable layers replaced by quantized ones, and the config that loads it again."""
    from mlx_lm.utils import quantize_model

    if "quantization" in config or "quantization_config" in config:
        raise ValueError("quantize: the model is already quantized (its config.json has 'quantization'); "
                         "set quantize.bits: null to train on it as it is")
    return quantize_model(model, config, s.group_size, s.bits)


def _nbytes(model: nn.Module) -> int:
    return sum(v.nbytes for _, v in tree_flatten(model.parameters()))


def quantize(model_ref: str | Path, out_dir: str | Path, settings: QuantizeSettings) -> dict[str, Any]:
    """Write the quantized model folder `out_dir` (complete or absent) and return its manifest."""
    from mlx_lm.utils import load_model, save_config, save_model

    from orpo.render.template import resolve_model_dir

    if settings.bits is None:
        raise ValueError("quantize: quantize.bits is null: nothing to quantize")
    source = resolve_model_dir(model_ref, weights=True)
    model, config = load_model(source, lazy=True)
    before = _nbytes(model)
    model, config = quantize_in_memory(model, config, settings)
    mx.eval(model.parameters())
    layers = [name for name, m in model.named_modules() if hasattr(m, "bits")]
    kept = sorted(name for name, m in model.named_modules()
                  if isinstance(m, (nn.Linear, nn.Embedding)) and not hasattr(m, "bits"))
    manifest = {"source": str(model_ref), "bits": settings.bits, "group_size": settings.group_size,
                "mode": "affine", "quantized_layers": len(layers),
                "float_layers": kept,  # input width not a multiple of the group size
                "float_bytes": before, "quantized_bytes": _nbytes(model)}
    with atomic_path(out_dir) as tmp:
        tmp.mkdir()
        save_model(tmp, model)
        save_config(config, tmp / "config.json")
        for f in sorted(source.iterdir()):  # tokenizer, template, generation config: the source's bytes
            if f.is_file() and f.name not in REWRITTEN and not f.name.endswith(".safetensors") \
                    and f.name != "complete.json":
                shutil.copy2(f, tmp / f.name)
        write_json(tmp / "manifest.json", manifest)  # after the copies: the source's own manifest is not this one
        mark_complete(tmp, "quantize")
    gb = 1e9
    print(f"orpo quantize: note: {settings.bits}-bit affine, groups of {settings.group_size}: {len(layers)} layers "
          f"quantized, {len(kept)} kept in float; {before / gb:.2f} GB -> {manifest['quantized_bytes'] / gb:.2f} GB",
          file=sys.stderr, flush=True)
    return manifest

