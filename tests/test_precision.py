"""model.dtype: a bf16 checkpoint computes in float32 on the CPU under auto, in bf16 when asked, and every stage
that loads it (train, replay, generate, an mlx judge) says and records which."""

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from orpo.train.settings import train_settings
from mlx.utils import tree_flatten
from mlx_lm.utils import load_model as mlx_load_model

from orpo.eval.generate import generate
from orpo.eval.judge.mlx_judge import MlxJudge
from orpo.eval.judge.settings import resolve_settings
from orpo.precision import checkpoint_dtype, load_model, resolve
from orpo.train.trainer import replay, train

from conftest import ON_GPU, save_model_folder, shortest_pairs

SETTINGS = {"batch_size": 2, "max_steps": 3, "checkpoint_every": 0, "lr": 0.01, "lora": {"rank": 4, "alpha": 8}}
AUTO = "bfloat16" if ON_GPU else "float32"  # what auto means for a bf16 checkpoint on this machine


@pytest.fixture(scope="module")
def bf16_base(tiny_base, tmp_path_factory) -> Path:
    """The tiny base model saved as a bf16 HF folder (what real checkpoints are)."""
    model, config = mlx_load_model(tiny_base)
    model.set_dtype(mx.bfloat16)
    mx.eval(model.parameters())
    return save_model_folder(model, {**config, "torch_dtype": "bfloat16"}, tiny_base,
                             tmp_path_factory.mktemp("bf16") / "model")


@pytest.fixture(scope="module")
def short_rendered(tiny_rendered, tmp_path_factory) -> Path:
    return shortest_pairs(tiny_rendered, tmp_path_factory.mktemp("short") / "rendered")


def float_dtypes(model) -> set:
    return {v.dtype for _, v in tree_flatten(model.parameters()) if mx.issubdtype(v.dtype, mx.floating)}


def test_the_checkpoint_dtype_is_read_from_the_safetensors_headers(bf16_base, tiny_base, tmp_path):
    assert checkpoint_dtype(bf16_base) == "bfloat16" and checkpoint_dtype(tiny_base) == "float32"
    assert resolve("auto", bf16_base, "cpu").dtype == "float32"
    assert resolve("auto", bf16_base, "gpu").dtype == "bfloat16"
    assert resolve("float16", bf16_base, "cpu").dtype == "float16"
    assert resolve("auto", tiny_base, "gpu").dtype == "float32"
    (tmp_path / "model.safetensors").write_bytes(b"\x05\x00")
    with pytest.raises(ValueError, match=r"model\.safetensors: not a safetensors file"):
        checkpoint_dtype(tmp_path)
    with pytest.raises(ValueError, match=r"model\.dtype: 'int8' is not one of auto, float32, bfloat16, float16"):
        resolve("int8", bf16_base)


def test_a_bf16_folder_loads_as_float32_under_auto_on_the_cpu_and_as_bf16_when_set(bf16_base, capsys):
    stored, _ = mlx_load_model(bf16_base)
    model, _, precision = load_model(bf16_base, "auto")
    assert precision.record() == {"dtype": AUTO, "setting": "auto", "checkpoint": "bfloat16",
                                  "device": "gpu" if ON_GPU else "cpu"}
    assert float_dtypes(model) == {getattr(mx, AUTO)}
    kept, _, p16 = load_model(bf16_base, "bfloat16")
    assert p16.dtype == "bfloat16" and float_dtypes(kept) == {mx.bfloat16}
    # Upcasting bf16 is exact: the float32 weights are the stored ones, value for value.
    for (name, a), (_, b) in zip(tree_flatten(model.parameters()), tree_flatten(stored.parameters()), strict=True):
        assert np.array_equal(np.array(a.astype(mx.float32)), np.array(b.astype(mx.float32))), name
    err = capsys.readouterr().err.splitlines()
    assert err[0] == f"model dtype: {AUTO} (auto on {'gpu' if ON_GPU else 'cpu'}; checkpoint bfloat16)"
    assert err[1] == "model dtype: bfloat16 (as asked; checkpoint bfloat16)"


def test_training_records_the_dtype_and_replay_computes_in_it(bf16_base, short_rendered, tmp_path, capsys):
    train(bf16_base, short_rendered, tmp_path / "auto", train_settings(SETTINGS))
    record = json.loads((tmp_path / "auto" / "settings.json").read_text())
    assert record["precision"]["dtype"] == AUTO and record["precision"]["checkpoint"] == "bfloat16"
    assert f"model dtype: {AUTO} (auto on" in capsys.readouterr().err

    train(bf16_base, short_rendered, tmp_path / "bf16", train_settings(SETTINGS), dtype="bfloat16")
    record = json.loads((tmp_path / "bf16" / "settings.json").read_text())
    assert record["precision"] == {**record["precision"], "dtype": "bfloat16", "setting": "bfloat16"}
    # The two dtypes train different adapters; replay uses the run's recorded dtype and matches bit for bit.
    if not ON_GPU:
        assert ((tmp_path / "auto" / "adapters.safetensors").read_bytes()
                != (tmp_path / "bf16" / "adapters.safetensors").read_bytes())
    again = replay(tmp_path / "bf16", bf16_base, short_rendered, "final", "zero")
    assert again["equal"] and again["dtype"] == "bfloat16"


def test_generation_and_the_mlx_judge_compute_in_the_dtype_they_say(bf16_base, tiny_base, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"key": 1, "prompt": "Write one word."}) + "\n")
    stats = generate(bf16_base, prompts, tmp_path / "auto.jsonl", {"max_tokens": 4}, label="base")
    assert stats["precision"]["dtype"] == AUTO
    assert json.loads((tmp_path / "auto.jsonl").read_text())["dtype"] == AUTO
    generate(bf16_base, prompts, tmp_path / "bf16.jsonl", {"max_tokens": 4}, label="base", dtype="bfloat16")
    assert json.loads((tmp_path / "bf16.jsonl").read_text())["dtype"] == "bfloat16"

    settings = {"model": str(bf16_base), "batch_size": 1, "max_tokens": 4, "temperature": 0.0, "seed": 0}
    judge = MlxJudge(resolve_settings(settings), "float16")
    assert judge.identity["dtype"] == "float16"  # a cast: verdicts cached under the checkpoint's dtype do not apply
    assert "dtype" not in MlxJudge(resolve_settings(settings), "bfloat16").identity  # the checkpoint's own: cache keys unchanged
    assert "dtype" not in MlxJudge(resolve_settings({**settings, "model": str(tiny_base)}), "auto").identity
    judge.complete([[{"role": "user", "content": "Say yes."}]])
    assert judge._gen.precision.dtype == "float16" and float_dtypes(judge._gen.model) == {mx.float16}


def test_the_cli_takes_dtype_and_refuses_others(bf16_base, tmp_path, capsys):
    from orpo.cli import main

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"key": 1, "prompt": "Write one word."}) + "\n")
    main(["generate", "--model", str(bf16_base), "--prompts", str(prompts), "--out", str(tmp_path / "g.jsonl"),
          "--settings", '{"max_tokens": 2}', "--dtype", "float16"])
    assert json.loads((tmp_path / "g.jsonl").read_text())["dtype"] == "float16"
    with pytest.raises(SystemExit):
        main(["generate", "--model", str(bf16_base), "--prompts", str(prompts), "--out", str(tmp_path / "h.jsonl"),
              "--dtype", "int8"])
    assert "argument --dtype: invalid choice: 'int8'" in capsys.readouterr().err
