"""The dtype a model computes in (`model.dtype`): float32 on a CPU, where bf16 runs several times slower per
step, the checkpoint's own dtype on a GPU; or what the config names. Decided once per load and said once."""

from __future__ import annotations

import json
import struct
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn

CHOICES = ("auto", "float32", "bfloat16", "float16")
MX_DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}
# safetensors header names of the floating dtypes a checkpoint stores its weights in.
SAFETENSORS_FLOATS = {"F32": "float32", "BF16": "bfloat16", "F16": "float16", "F64": "float64"}


@dataclass(frozen=True)
class Precision:
    """What a model computes in, what asked for it, what the checkpoint holds and on which device."""

    dtype: str  # float32 | bfloat16 | float16: what the model is cast to
    setting: str  # model.dtype as given: auto or one of the above
    checkpoint: str | None  # the floating dtype most of the checkpoint's weights are stored in (None: no floats)
    device: str  # cpu | gpu

    def record(self) -> dict[str, Any]:
        """The choice as manifests and run records keep it."""
        return asdict(self)

    def describe(self) -> str:
        """One line: 'model dtype: float32 (auto on cpu; checkpoint bfloat16)'."""
        how = f"auto on {self.device}" if self.setting == "auto" else "as asked"
        return f"model dtype: {self.dtype} ({how}; checkpoint {self.checkpoint or 'without float weights'})"


def checkpoint_dtype(model_dir: str | Path) -> str | None:
    """The floating dtype holding most of a model folder's weight elements, read from the safetensors headers.

    No tensor is read. A quantized checkpoint answers with its scales' dtype; None when no file has floats.
    """
    counts: dict[str, int] = {}
    for path in sorted(Path(model_dir).glob("model*.safetensors")):
        for dtype, elements in _header_floats(path):
            counts[dtype] = counts.get(dtype, 0) + elements
    return max(sorted(counts), key=counts.__getitem__) if counts else None


def _header_floats(path: Path) -> list[tuple[str, int]]:
    """(dtype, element count) of every floating tensor in one safetensors file's header."""
    with open(path, "rb") as f:
        size = f.read(8)
        if len(size) < 8:
            raise ValueError(f"{path}: not a safetensors file (shorter than its 8-byte header length)")
        try:
            header = json.loads(f.read(struct.unpack("<Q", size)[0]))
        except (ValueError, MemoryError, OverflowError):
            raise ValueError(f"{path}: not a safetensors file (its header is not JSON)") from None
    out = []
    for name, info in header.items():
        if name != "__metadata__" and info.get("dtype") in SAFETENSORS_FLOATS:
            elements = 1
            for d in info.get("shape", []):
                elements *= int(d)
            out.append((SAFETENSORS_FLOATS[info["dtype"]], elements))
    return out


def resolve(setting: str, model_dir: str | Path, device: str | None = None) -> Precision:
    """The dtype `setting` (model.dtype) means for the checkpoint in `model_dir` on `device` (the default one)."""
    if setting not in CHOICES:
        raise ValueError(f"model.dtype: {setting!r} is not one of {', '.join(CHOICES)}")
    device = device or ("gpu" if mx.default_device().type == mx.gpu else "cpu")
    stored = checkpoint_dtype(model_dir)
    if setting != "auto":
        dtype = setting
    elif device == "cpu" or stored not in MX_DTYPES:  # float64 or no floats: compute in float32
        dtype = "float32"
    else:
        dtype = stored
    return Precision(dtype, setting, stored, device)


def cast(model: nn.Module, precision: Precision) -> nn.Module:
    """The model's floating parameters in `precision.dtype` (integer, e.g. quantized, weights untouched)."""
    target = MX_DTYPES[precision.dtype]
    model.set_dtype(target, lambda d: mx.issubdtype(d, mx.floating) and d != target)
    return model


def load_model(model_dir: str | Path, setting: str = "auto",
               announce: bool = True) -> tuple[nn.Module, dict, Precision]:
    """mlx-lm's load_model, the weights cast to the dtype `setting` resolves to before they are evaluated.

    Prints the choice once on stderr (`announce`): "model dtype: float32 (auto on cpu; checkpoint bfloat16)".
    """
    from mlx_lm.utils import load_model as mlx_load_model

    precision = resolve(setting, model_dir)
    model, config = mlx_load_model(Path(model_dir), lazy=True)
    cast(model, precision)
    mx.eval(model.parameters())
    if announce:
        print(precision.describe(), file=sys.stderr, flush=True)
    return model, config, precision
