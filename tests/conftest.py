"""Shared fixtures: a tiny embedded stack (synthetic rows -> base model -> curated -> rendered), built once."""

from pathlib import Path

import mlx.core as mx
import pytest

ROOT = Path(__file__).resolve().parents[1]

# MLX on CUDA computes float32 matmuls in TF32 (measured on the H200: 2.6e-4 relative error against
# float64), so two float32 orders of the same sum agree less closely there than on the CPU.
ON_GPU = mx.default_device().type == mx.DeviceType.gpu
MATMUL_TOL = 1e-3 if ON_GPU else 1e-6
SHARED = ROOT.parent / "shared"

# Small enough to build in seconds on 2 CPU cores, big enough to learn something.
TINY_BASE = {
    "vocab_size": 512, "hidden_size": 64, "num_layers": 2, "num_heads": 2, "intermediate_size": 128,
    "max_length": 96, "context_length": 96, "steps": 80, "batch_size": 8, "lr": 0.003, "log_every": 10,
}
TINY_TRAIN = {
    "lr": 0.003, "batch_size": 4, "max_steps": 12, "checkpoint_every": 4, "log_every": 4,
    "lora": {"rank": 4, "alpha": 8},
}


@pytest.fixture(scope="session")
def tiny_raw(tmp_path_factory) -> Path:
    from orpo.data.synth import write_rows

    path = tmp_path_factory.mktemp("raw") / "raw.jsonl"
    write_rows(path, 160, 0)
    return path


@pytest.fixture(scope="session")
def tiny_base(tmp_path_factory, tiny_raw) -> Path:
    from orpo.base.model import build_base

    out = tmp_path_factory.mktemp("base") / "model"
    build_base(tiny_raw, out, TINY_BASE)
    return out


@pytest.fixture(scope="session")
def tiny_rendered(tmp_path_factory, tiny_raw, tiny_base) -> Path:
    from orpo.curate import curate
    from orpo.render.pairs import render_pairs

    root = tmp_path_factory.mktemp("stack")
    curate([str(tiny_raw)], root / "curated", {"validation_fraction": 0.1}, tokenizer=str(tiny_base / "tokenizer.json"))
    render_pairs(tiny_base, root / "curated", root / "rendered", {"max_length": 256, "max_prompt_length": 96})
    return root / "rendered"


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def shortest_pairs(rendered: Path, out: Path, n_train: int = 16, n_val: int = 4) -> Path:
    """The shortest pairs of a rendered folder, same contract, fewer tokens: many steps in seconds."""
    import polars as pl

    out.mkdir(parents=True)
    for split, n in (("train", n_train), ("validation", n_val)):
        df = pl.read_parquet(rendered / f"{split}.parquet")
        length = pl.col("prompt_len") + pl.max_horizontal("chosen_len", "rejected_len")
        df.with_columns(length.alias("_n")).sort("_n", "id").head(n).drop("_n").write_parquet(out / f"{split}.parquet")
    return out


def save_model_folder(model, config: dict, tokenizer_from: Path, out: Path) -> Path:
    """An HF-style folder mlx-lm loads: config.json, model.safetensors and the tiny tokenizer's files."""
    import shutil

    from mlx_lm.utils import save_config, save_model

    save_model(out, model)
    save_config(dict(config), out / "config.json")
    for name in TOKENIZER_FILES:
        shutil.copy(tokenizer_from / name, out / name)
    return out
