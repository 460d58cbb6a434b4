"""LoRA adapters: our own layer (keyed init and dropout), saved in the format `mlx_lm.load(adapter_path=...)` reads.

The layer computes what mlx-lm's `LoRALinear` computes in eval mode (same `lora_a`/`lora_b`), so mlx-lm loads
our adapters unchanged; A's init and the dropout masks come from keys derived from (seed, step, micro-batch,
module index) instead of the global RNG, so every recompute sees the same mask.
"""

from __future__ import annotations

import contextlib
import json
import math
from pathlib import Path
from typing import Any, Iterator

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

from orpo.engine.quantized import frozen_linear
from orpo.train.keys import INIT, DropoutKeys, derive_key, keyed_dropout
from orpo.train.settings import LoraSettings


class AdapterMismatch(ValueError):
    """An adapter to warm-start from does not fit this run's LoRA layers."""


class LoRALinear(nn.Module):
    """A frozen linear (plain or quantized) plus a float low-rank update: y = W x + scale * (drop(x) A) B."""

    def __init__(self, linear: nn.Module, rank: int, scale: float, dropout: float, index: int,
                 keys: DropoutKeys, init_key: mx.array):
        super().__init__()
        out_dims, in_dims = linear.weight.shape
        if isinstance(linear, nn.QuantizedLinear):
            in_dims = in_dims * 32 // linear.bits  # packed uint32 columns
        self.linear = linear
        self.scale = scale
        self.p = dropout
        self.index = index
        if dropout > 0:
            keys.register(self)  # sets and moves self._dropout_key
        bound = 1 / math.sqrt(in_dims)  # mlx-lm's init: A ~ U(-1/sqrt(in), 1/sqrt(in)), B = 0
        self.lora_a = mx.random.uniform(-bound, bound, (in_dims, rank), key=init_key)
        self.lora_b = mx.zeros((rank, out_dims))
        self.bypass = False  # adapters_off: the frozen linear alone (a reference model without a copy)

    def __call__(self, x: mx.array) -> mx.array:
        y = frozen_linear(self.linear, x)
        if self.bypass:
            return y
        if self.training and self.p > 0:
            x = keyed_dropout(x, self.p, self._dropout_key)
        # In the activation dtype: a float32 path on a bf16 model would keep float32 copies of x for the backward
        # (bench/README.md); y as addmm's addend: no [tokens, out] copies of (x A) B and of its scaled form. The
        # scale on B [rank, out], not as addmm's alpha, whose backward multiplies each [tokens, out] cotangent by it.
        dt = x.dtype
        return mx.addmm(y, x @ self.lora_a.astype(dt), (self.lora_b * self.scale).astype(dt))


@contextlib.contextmanager
def adapters_off(model: nn.Module) -> Iterator[None]:
    """The model without its LoRA updates while inside: the base model's forward, no second copy of its weights
    (eager forwards only: a compiled function traced inside would keep the adapters off after it)."""
    layers = [m for _, m in model.named_modules() if isinstance(m, LoRALinear)]
    if not layers:
        raise ValueError("train.objective dpo takes its reference from the model with its LoRA adapters off, and "
                         "this model has none (train.method full passes its frozen copy instead)")
    for m in layers:
        m.bypass = True
    try:
        yield
    finally:
        for m in layers:
            m.bypass = False


def mlp_dropout(layers: list[nn.Module]) -> list[tuple[str, LoRALinear]]:
    """The LoRA adapters of the layers' MLPs that have dropout (drawn while training), by module name."""
    return [(name, m) for layer in layers for name, m in layer.mlp.named_modules()
            if isinstance(m, LoRALinear) and m.p > 0]


def refuse_mlp_dropout(layers: list[nn.Module]) -> None:
    """The MLP differentiated in token chunks would draw its dropout masks over a chunk's shape: refuse dropout there."""
    for name, m in mlp_dropout(layers):
        if m.training:
            raise ValueError(f"train.engine.mlp_chunks > 1 with LoRA dropout on the MLP ({name}, dropout {m.p}): "
                             "a chunked recompute would draw other dropout masks; set lora.dropout: 0 or "
                             "mlp_chunks: 1")


def block_keys(model: nn.Module, targets: list[str]) -> list[str]:
    """Block-relative module paths (e.g. 'self_attn.q_proj') whose last part is in `targets`."""
    names = {name for name, m in model.layers[0].named_modules() if isinstance(m, (nn.Linear, nn.QuantizedLinear))}
    keys = sorted(n for n in names if n.rsplit(".", 1)[-1] in set(targets))
    missing = set(targets) - {k.rsplit(".", 1)[-1] for k in keys}
    if missing:
        raise ValueError(f"lora.target_modules: {sorted(missing)} not found among the model's linear layers {sorted(names)}")
    return keys


def _layer_count(num_layers: int, total: int) -> int:
    # mlx-lm adapts model.layers[-max(n, 0):], so n <= 0 means every block there.
    return total if num_layers <= 0 or num_layers > total else num_layers


def apply_lora(model: nn.Module, settings: LoraSettings, seed: int, keys: DropoutKeys | None = None) -> dict[str, Any]:
    """Freeze `model`, add LoRA layers (initialised from `seed`, dropout keyed by `keys`) and return the
    adapter_config.json dict."""
    rank = settings.rank
    scale = settings.alpha / (rank ** 0.5 if settings.rslora else rank)
    if settings.num_layers == 0:
        raise ValueError("lora.num_layers: 0 adapts no block (use -1 for all, or N > 0 for the last N)")
    total = len(model.layers)
    num_layers = _layer_count(settings.num_layers, total)
    dropout = settings.dropout
    module_keys = block_keys(model, list(settings.target_modules))
    keys = keys if keys is not None else DropoutKeys(seed)
    model.freeze()
    for b in range(total - num_layers, total):
        block = model.layers[b]
        modules = dict(block.named_modules())
        new = []
        for j, name in enumerate(module_keys):
            index = b * len(module_keys) + j  # stable across runs: block, then sorted module path
            new.append((name, LoRALinear(modules[name], rank, scale, dropout, index, keys, derive_key(INIT, seed, index))))
        block.update_modules(tree_unflatten(new))
    mx.eval(model.trainable_parameters())
    params = {"rank": rank, "scale": scale, "dropout": dropout, "keys": module_keys}
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


def adapter_folder(path: str | Path) -> Path:
    """The folder holding adapters.safetensors + adapter_config.json: a run, a checkpoint or an adapter folder."""
    folder = Path(path)
    if not ((folder / "adapters.safetensors").is_file() and (folder / "adapter_config.json").is_file()):
        raise AdapterMismatch(f"init_adapter {path}: no adapters.safetensors and adapter_config.json there "
                              "(give a run folder, a checkpoint folder or an mlx-lm adapter folder)")
    return folder


def warm_start(model: nn.Module, adapter_config: dict[str, Any], path: str | Path) -> Path:
    """Load an existing adapter's LoRA weights into `model`; its config must match this run's (else AdapterMismatch)."""
    folder = adapter_folder(path)
    theirs = json.loads((folder / "adapter_config.json").read_text())
    ours = adapter_config["lora_parameters"]
    tp = theirs.get("lora_parameters", {})
    problems = []
    if theirs.get("fine_tune_type", "lora") != "lora":
        problems.append(f"fine_tune_type {theirs.get('fine_tune_type')!r} is not 'lora'")
    for key, knob in (("rank", "lora.rank"), ("keys", "lora.target_modules"), ("scale", "lora.alpha/lora.rslora")):
        if tp.get(key) != ours[key]:
            problems.append(f"{key} {tp.get(key)!r} != this run's {ours[key]!r} (set {knob} to match)")
    n_theirs = _layer_count(int(theirs.get("num_layers", 0)), len(model.layers))
    if n_theirs != adapter_config["num_layers"]:
        problems.append(f"num_layers {n_theirs} != this run's {adapter_config['num_layers']} (set lora.num_layers to match)")
    if not problems:
        weights = mx.load(str(folder / "adapters.safetensors"))
        expected = adapter_weights(model)
        problems += [f"{name} missing from the adapter" for name in sorted(set(expected) - set(weights))]
        problems += [f"{name} is not a LoRA weight of this model" for name in sorted(set(weights) - set(expected))]
        problems += [f"{name} has shape {tuple(weights[name].shape)}, this model needs {tuple(expected[name].shape)} "
                     "(another base model?)" for name in sorted(set(weights) & set(expected))
                     if weights[name].shape != expected[name].shape]
    if problems:
        raise AdapterMismatch(f"init_adapter {folder} does not match this run's LoRA: " + "; ".join(problems[:6]))
    # Train in this run's dtype (float32) whatever the adapter was saved in.
    model.load_weights([(k, v.astype(expected[k].dtype)) for k, v in weights.items()], strict=False)
    mx.eval(model.trainable_parameters())
    return folder
