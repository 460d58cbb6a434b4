"""Learning-rate schedules: inverse_sqrt against transformers' own code, warmup as a step count."""

import ast
import importlib.util
import math
from pathlib import Path

import mlx.core as mx
import pytest

from orpo.config import PROJECT_ROOT, ConfigError, validate_config
from orpo.optim import lr_schedule, warmup_steps_for


def transformers_inverse_sqrt():
    """transformers' `_get_inverse_sqrt_schedule_lr_lambda` and `get_inverse_sqrt_schedule`'s default timescale,
    read from the installed optimization.py (importing it needs torch, which this venv lacks)."""
    spec = importlib.util.find_spec("transformers")
    if spec is None:
        pytest.skip("transformers is not installed")
    source = (Path(spec.origin).parent / "optimization.py").read_text()
    tree = ast.parse(source)
    found = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
    namespace = {"math": math}
    exec(compile(ast.Module([found["_get_inverse_sqrt_schedule_lr_lambda"]], []), "optimization.py", "exec"),
         namespace)
    # The default timescale: `timescale = num_warmup_steps or 10_000` in get_inverse_sqrt_schedule.
    default = [ast.unparse(n) for n in ast.walk(found["get_inverse_sqrt_schedule"])
               if isinstance(n, ast.Assign) and ast.unparse(n.targets[0]) == "timescale"]
    assert default == ["timescale = num_warmup_steps or 10000"]
    return namespace["_get_inverse_sqrt_schedule_lr_lambda"]


@pytest.mark.parametrize("warmup", [200, 7, 1, 0])
def test_inverse_sqrt_is_transformers_schedule(warmup: int) -> None:
    """Update k (0-based, as both count) runs at lr * transformers' lambda(k), warmup and decay alike."""
    hf = transformers_inverse_sqrt()
    lr, total = 5e-6, 3000
    ours = lr_schedule("inverse_sqrt", lr, total, warmup_steps_for(total, warmup))
    steps = sorted({0, 1, 2, 99, 100, 101, 199, 200, 201, 202, 500, 999, 1000, 2999, 20000} | {warmup - 1, warmup})
    for k in (k for k in steps if k >= 0):
        expected = lr * hf(k, num_warmup_steps=warmup, timescale=warmup or 10_000)
        got = ours(mx.array(k, mx.uint64)).item()
        assert got == pytest.approx(expected, rel=2e-6, abs=1e-20), (k, got, expected)
    if warmup:
        assert ours(mx.array(0, mx.uint64)).item() == 0.0  # transformers' first update runs at 0 too
        assert ours(mx.array(warmup, mx.uint64)).item() == pytest.approx(lr, rel=1e-6)  # the peak
        assert ours(mx.array(4 * warmup, mx.uint64)).item() == pytest.approx(lr / 2, rel=1e-6)  # sqrt(w / 4w)


def test_inverse_sqrt_ignores_the_run_length_and_compiles() -> None:
    """No end: a run shorter than its warmup warms up throughout (transformers clamps nothing either)."""
    short, long = lr_schedule("inverse_sqrt", 1.0, 50, 200), lr_schedule("inverse_sqrt", 1.0, 5000, 200)
    compiled = mx.compile(lambda k: short(k))
    for k in (0, 10, 49, 300):
        step = mx.array(k, mx.uint64)
        assert short(step).item() == long(step).item() == pytest.approx(compiled(step).item())
    assert short(mx.array(49, mx.uint64)).item() == pytest.approx(49 / 200)


def test_warmup_is_a_fraction_below_one_and_whole_steps_from_one() -> None:
    assert warmup_steps_for(1000, 0.03) == 30
    assert warmup_steps_for(1000, 200) == 200 and warmup_steps_for(100, 200) == 200
    assert warmup_steps_for(1000, 1) == 1 and warmup_steps_for(1000, 0) == 0
    assert warmup_steps_for(1000, 200.0) == 200
    with pytest.raises(ValueError, match="whole number"):
        warmup_steps_for(1000, 2.5)
    # The other schedules reach the peak at exactly the warmup step given as a count.
    rate = lr_schedule("cosine", 5e-6, 9000, warmup_steps_for(9000, 200))
    assert rate(mx.array(200, mx.uint64)).item() == pytest.approx(5e-6, rel=1e-6)
    assert rate(mx.array(100, mx.uint64)).item() < 5e-6


def test_config_refuses_a_fractional_step_count() -> None:
    with pytest.raises(ConfigError, match="train.warmup"):
        validate_config({"train": {"warmup": 2.5, "schedule": "inverse_sqrt"}}, PROJECT_ROOT)
    cfg = validate_config({"train": {"warmup": 200, "schedule": "inverse_sqrt"}}, PROJECT_ROOT)
    assert cfg["train"]["warmup"] == 200 and cfg["train"]["schedule"] == "inverse_sqrt"
    assert validate_config({"train": {"warmup": 0.03}}, PROJECT_ROOT)["train"]["warmup"] == 0.03
