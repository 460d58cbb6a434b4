"""Shared fixtures: a tiny embedded stack (synthetic rows -> base model -> curated -> rendered), built once."""

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared"

# Small enough to build in seconds on 2 CPU cores, big enough to learn something.
TINY_BASE = {
    "vocab_size": 512, "hidden_size": 64, "num_layers": 2, "num_heads": 2, "intermediate_size": 128,
    "max_length": 96, "steps": 80, "batch_size": 8, "lr": 0.003, "log_every": 10,
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
