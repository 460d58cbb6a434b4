"""LoRA adapters through mlx-lm's layers, saved in the format `mlx_lm.load(adapter_path=...)` reads."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.tuner.utils import linear_to_lora_layers


def block_keys(model: nn.Module, targets: list[str]) -> list[str]:
    """Block-relative module paths (e.g. 'self_attn.q_proj') whose last part is in `targets`."""
    names = {name for name, m in model.layers[0].named_modules() if isinstance(m, (nn.Linear, nn.QuantizedLinear))}
    keys = sorted(n for n in names if n.rsplit(".", 1)[-1] in set(targets))
    missing = set(targets) - {k.rsplit(".", 1)[-1] for k in keys}
    if missing:
        raise ValueError(f"lora.target_modules: {sorted(missing)} not found among the model's linear layers {sorted(names)}")
    return keys


def apply_lora(model: nn.Module, settings: dict[str, Any], seed: int) -> dict[str, Any]:
    """Freeze `model`, add LoRA layers (initialised from `seed`) and return the adapter_config.json dict."""
    rank = int(settings["rank"])
    scale = float(settings["alpha"]) / (rank ** 0.5 if settings.get("rslora") else rank)
    num_layers = int(settings["num_layers"])
    if num_layers < 0:
        num_layers = len(model.layers)
    params = {
        "rank": rank,
        "scale": scale,
        "dropout": float(settings["dropout"]),
        "keys": block_keys(model, list(settings["target_modules"])),
    }
    model.freeze()
    mx.random.seed(seed)
    linear_to_lora_layers(model, num_layers, params)
    mx.eval(model.trainable_parameters())
    return {"fine_tune_type": "lora", "num_layers": num_layers, "lora_parameters": params}


def adapter_weights(model: nn.Module) -> dict[str, mx.array]:
    """The trainable (LoRA) weights, in sorted key order so the saved bytes are deterministic."""
    return dict(sorted(tree_flatten(model.trainable_parameters())))


def save_adapter(model: nn.Module, adapter_config: dict[str, Any], out_dir: Path) -> None:
    """Write adapters.safetensors + adapter_config.json into an existing folder."""
    mx.save_safetensors(str(out_dir / "adapters.safetensors"), adapter_weights(model))
    (out_dir / "adapter_config.json").write_text(json.dumps(adapter_config, indent=2, sort_keys=True) + "\n")


def load_adapter_weights(model: nn.Module, adapter_dir: Path) -> None:
    """Load adapters.safetensors into a model that already has its LoRA layers."""
    model.load_weights(str(adapter_dir / "adapters.safetensors"), strict=False)
    mx.eval(model.parameters())
