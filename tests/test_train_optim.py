"""The flat AdamW against mlx.optimizers' AdamW with clip_grad_norm: same weights and moments step after step."""

import mlx.core as mx
import mlx.optimizers as optim
import numpy as np
import pytest
from mlx.utils import tree_flatten

from orpo.optim import lr_schedule
from orpo.train.session import build_session
from orpo.train.settings import train_settings
from orpo.train.step import batch_value_and_grad

SETTINGS = {"batch_size": 2, "max_steps": 6, "lr": 0.003, "weight_decay": 0.1, "grad_clip": 0.05,
            "warmup": 0, "schedule": "cosine",
            "lora": {"rank": 4, "alpha": 8}}


def flat(tree) -> dict[str, np.ndarray]:
    return {k: np.array(v) for k, v in tree_flatten(tree)}


@pytest.mark.parametrize("plus_ratio", [1.0, 4.0])
def test_flat_adamw_is_mlx_adamw_with_clipping(tiny_base, tiny_rendered, plus_ratio):
    """Six steps of real gradients (clipped: the tiny max norm binds), compiled flat update vs per-matrix mlx."""
    sess = build_session(tiny_base, tiny_rendered, train_settings({**SETTINGS, "lora": {**SETTINGS["lora"], "plus_ratio": plus_ratio}}))
    total = len(sess.schedule)
    rate = lambda r: lr_schedule("cosine", r, total, 0)  # noqa: E731
    a, b = optim.AdamW(rate(0.003), weight_decay=0.1), optim.AdamW(rate(0.003 * plus_ratio), weight_decay=0.1)
    reference = optim.MultiOptimizer([b, a], [lambda path, _: path.endswith("lora_b")])
    weights = sess.model.trainable_parameters()
    reference.init(weights)
    clipped = 0
    for step in range(1, total + 1):
        batch = sess.prepare(step)[0]
        (_, _), grads = batch_value_and_grad(sess.model, batch, sess.s.lambda_, sess.engine)
        mx.eval(grads)
        g_ref, norm_ref = optim.clip_grad_norm(grads, SETTINGS["grad_clip"])
        weights = reference.apply_gradients(g_ref, weights)
        norm, lr = sess.update_fn()(grads)
        mx.eval(weights, norm, lr)
        clipped += norm.item() > SETTINGS["grad_clip"]
        np.testing.assert_allclose(norm.item(), norm_ref.item(), rtol=1e-5)
        assert lr.item() == pytest.approx(a.learning_rate.item(), rel=1e-6)
        ours, theirs = flat(sess.model.trainable_parameters()), flat(weights)
        assert ours.keys() == theirs.keys()
        for k in ours:
            np.testing.assert_allclose(ours[k], theirs[k], rtol=1e-5, atol=1e-7, err_msg=f"step {step} {k}")
    assert clipped == total  # the clipping branch was exercised
    moments = sess.opt.state_dict()
    ref_m = {k[: -len(".m")]: v for k, v in tree_flatten(a.state) + tree_flatten(b.state) if k.endswith(".m")}
    assert ref_m.keys() == {k[: -len(".m")] for k in moments if k.endswith(".m")}
    for k in ref_m:
        np.testing.assert_allclose(np.array(moments[f"{k}.m"]), np.array(ref_m[k]), rtol=1e-4, atol=1e-9, err_msg=k)
    assert int(moments["step"].item()) == total


def test_update_is_compiled_once_and_restored_weights_are_adopted(tiny_base, tiny_rendered):
    """Steps reuse one compiled update; a restore's weights and moments are taken over and compiled anew."""
    sess = build_session(tiny_base, tiny_rendered, train_settings(SETTINGS))
    sess.step(1)
    first = sess._update[1]
    sess.step(2)
    assert sess._update[1] is first
    saved = sess.opt.state_dict()
    w = {k: v + 1.0 for k, v in tree_flatten(sess.model.trainable_parameters())}
    sess.model.load_weights(list(w.items()), strict=False)
    sess.opt.load_state_dict(sess.model, saved)
    sess.step(3)
    assert sess._update[1] is not first
    moved = {k: np.abs(np.array(v) - np.array(w[k])).max() for k, v in tree_flatten(sess.model.trainable_parameters())}
    assert max(moved.values()) < 0.05  # one small step from the loaded weights, not from the old ones (1.0 away)
    assert all(np.abs(np.array(v)).max() > 0 for k, v in sess.opt.state_dict().items() if k.endswith(".v"))
    assert int(sess.opt.state["step"].item()) == 3
