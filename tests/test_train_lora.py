"""Our LoRA layer: keyed dropout replayed in any recompute, LoRA+ learning rates, warm-start checks."""

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm.tuner.utils import linear_to_lora_layers
from mlx_lm.utils import load_model

from orpo.train.data import pair_batch
from orpo.train.keys import derive_key, keyed_dropout
from orpo.train.lora import AdapterMismatch, adapter_weights
from orpo.train.session import build_session
from orpo.train.settings import train_settings
from orpo.train.step import naive_pair_loss as pair_loss

SETTINGS = {"batch_size": 2, "max_steps": 4, "lr": 0.003, "lora": {"rank": 4, "alpha": 8, "dropout": 0.5}}


def flat(tree) -> dict[str, np.ndarray]:
    return {k: np.array(v) for k, v in tree_flatten(tree)}


def randomize_b(model: nn.Module, seed: int = 0) -> None:
    """Give every lora_b small random values, so the adapter (and its dropout) changes the loss."""
    rng = np.random.default_rng(seed)
    model.load_weights([(k, mx.array(rng.normal(scale=0.05, size=v.shape).astype(np.float32)))
                        for k, v in adapter_weights(model).items() if k.endswith("lora_b")], strict=False)


def grads_at(sess, vg, step: int, micro: int = 0):
    """Loss and gradients of step 1's rows with the dropout keys pointed at (step, micro)."""
    tokens, mask = pair_batch(sess.train, sess.schedule[0])
    sess.model.train()
    sess.keys.at(step, micro)
    (loss, _), grads = vg(sess.model, tokens, mask, len(sess.schedule[0]), 0.1)
    mx.eval(loss, grads)
    return loss.item(), flat(grads)


def checkpoint_blocks(monkeypatch, block) -> None:
    """Recompute every block of this class in the backward (mx.checkpoint), as mlx-lm's grad_checkpoint does."""
    cls = type(block)
    forward = cls.__call__

    def call(self, x, *args, **kwargs):
        def inner(params, x):
            self.update(params)
            return forward(self, x, *args, **kwargs)

        return mx.checkpoint(inner)(self.trainable_parameters(), x)

    monkeypatch.setattr(cls, "__call__", call)


def test_keyed_dropout_is_inverted_dropout_with_the_keys_mask():
    x = mx.array(np.random.default_rng(0).normal(size=(64, 256)).astype(np.float32))
    key = derive_key(2, 0, 5, 0, 3)
    y = np.array(keyed_dropout(x, 0.25, key))
    keep = np.array(mx.random.bernoulli(0.75, x.shape, key=key))
    np.testing.assert_allclose(y, np.where(keep, np.array(x) / 0.75, 0.0), rtol=1e-6)
    assert abs(keep.mean() - 0.75) < 0.01
    np.testing.assert_array_equal(y, np.array(keyed_dropout(x, 0.25, derive_key(2, 0, 5, 0, 3))))
    assert not np.array_equal(y, np.array(keyed_dropout(x, 0.25, derive_key(2, 0, 6, 0, 3))))


def test_dropout_mask_depends_only_on_seed_step_micro_batch(tiny_base, tiny_rendered):
    sess = build_session(tiny_base, tiny_rendered, train_settings(SETTINGS))
    randomize_b(sess.model)
    vg = nn.value_and_grad(sess.model, pair_loss)
    loss, g = grads_at(sess, vg, 3)
    mx.random.seed(12345)  # the global RNG plays no part
    again, g2 = grads_at(sess, vg, 3)
    assert again == loss and all(np.array_equal(g[k], g2[k]) for k in g)
    assert grads_at(sess, vg, 4)[0] != loss
    assert grads_at(sess, vg, 3, micro=1)[0] != loss
    # A fresh session (a replay) draws the same masks.
    other = build_session(tiny_base, tiny_rendered, train_settings(SETTINGS))
    randomize_b(other.model)
    assert grads_at(other, nn.value_and_grad(other.model, pair_loss), 3)[0] == loss
    # Eval mode: no dropout, the same loss as a dropout-free adapter.
    plain = build_session(tiny_base, tiny_rendered, train_settings({**SETTINGS, "lora": {**SETTINGS["lora"], "dropout": 0.0}}))
    randomize_b(plain.model)
    tokens, mask = pair_batch(sess.train, sess.schedule[0])
    sess.model.eval()
    assert pair_loss(sess.model, tokens, mask, 2, 0.1)[0].item() == grads_at(plain, nn.value_and_grad(plain.model, pair_loss), 3)[0]


def test_recompute_under_checkpoint_sees_the_same_mask(tiny_base, tiny_rendered, monkeypatch):
    """Gradients with every block recomputed in the backward equal the plain ones; stock dropout's do not."""
    sess = build_session(tiny_base, tiny_rendered, train_settings(SETTINGS))
    randomize_b(sess.model)
    vg = nn.value_and_grad(sess.model, pair_loss)
    loss, plain = grads_at(sess, vg, 2)

    keys = sess.adapter_config["lora_parameters"]["keys"]
    stock, _ = load_model(tiny_base)
    stock.freeze()
    linear_to_lora_layers(stock, len(stock.layers), {"rank": 4, "scale": 2.0, "dropout": 0.5, "keys": keys})
    stock.load_weights(list(adapter_weights(sess.model).items()), strict=False)
    stock.train()
    stock_vg = nn.value_and_grad(stock, pair_loss)
    tokens, mask = pair_batch(sess.train, sess.schedule[0])
    mx.random.seed(0)
    stock_plain = flat(stock_vg(stock, tokens, mask, 2, 0.1)[1])

    checkpoint_blocks(monkeypatch, sess.model.layers[0])
    loss_ck, ours_ck = grads_at(sess, vg, 2)
    mx.random.seed(0)
    stock_ck = flat(stock_vg(stock, tokens, mask, 2, 0.1)[1])

    assert loss_ck == loss
    scale = max(np.abs(v).max() for v in plain.values())
    assert scale > 1e-3
    for k in plain:
        np.testing.assert_allclose(ours_ck[k], plain[k], rtol=1e-5, atol=1e-7 * scale, err_msg=k)
    # The hazard this guards against: a global-RNG mask is redrawn in the recompute, so the gradient is wrong.
    assert max(np.abs(stock_ck[k] - stock_plain[k]).max() for k in stock_plain) > 0.1 * scale


@pytest.mark.parametrize("scale", [2.0, 1.5])
def test_lora_linear_value_and_gradients_equal_float64(scale):
    """y = W x + scale (x A) B and the gradients of sum(y * c) for x, A and B against float64 numpy (float32, relative
    to each result's largest magnitude); in bfloat16 too, where a power-of-two scale on B gives the bits of the
    scale applied to the product (rounding commutes with it), so runs replay as before with the defaults."""
    from orpo.train.keys import DropoutKeys
    from orpo.train.lora import LoRALinear

    rng = np.random.default_rng(0)
    layer = LoRALinear(nn.Linear(48, 40, bias=False), 8, scale, 0.0, 0, DropoutKeys(0), mx.random.key(0))
    layer.lora_b = mx.array(rng.normal(size=(8, 40)) * 0.1, mx.float32)
    x, c = (mx.array(rng.normal(size=(32, n)), mx.float32) for n in (48, 40))

    def loss(a, b, x):
        layer.lora_a, layer.lora_b = a, b
        return (layer(x) * c).sum()

    a, b = layer.lora_a, layer.lora_b
    value, (da, db, dx) = mx.value_and_grad(loss, argnums=(0, 1, 2))(a, b, x)
    A, B, X, C, W = (np.array(v, dtype=np.float64) for v in (a, b, x, c, layer.linear.weight))
    want = {"value": (X @ W.T + scale * X @ A @ B) * C, "dA": scale * X.T @ (C @ B.T), "dB": scale * (X @ A).T @ C,
            "dx": C @ W + scale * C @ B.T @ A.T}
    for name, got, w in (("value", value, want["value"].sum()), ("dA", da, want["dA"]), ("dB", db, want["dB"]),
                         ("dx", dx, want["dx"])):
        err = np.abs(np.array(got, dtype=np.float64) - w).max() / np.abs(w).max()
        assert err < 1e-5, (name, err)
    if scale == 2.0:
        xb, wb = x.astype(mx.bfloat16), layer.linear.weight.astype(mx.bfloat16)
        layer.linear.weight, layer.lora_a, layer.lora_b = wb, a, b
        product = mx.addmm(xb @ wb.T, xb @ a.astype(mx.bfloat16), b.astype(mx.bfloat16), alpha=scale)
        assert mx.array_equal(layer(xb), product)


def test_lora_plus_scales_the_b_update_only(tiny_base, tiny_rendered, tmp_path):
    """First AdamW step from a warm start (A gets gradient): dA is the same, dB is plus_ratio times larger."""
    base = build_session(tiny_base, tiny_rendered, train_settings({**SETTINGS, "lora": {"rank": 4, "alpha": 8}}))
    randomize_b(base.model, seed=1)
    from orpo.train.lora import save_adapter

    save_adapter(base.model, base.adapter_config, tmp_path)
    deltas = {}
    for ratio in (1.0, 4.0):
        s = build_session(tiny_base, tiny_rendered, train_settings({**SETTINGS, "weight_decay": 0.0, "init_adapter": str(tmp_path),
                                                     "lora": {"rank": 4, "alpha": 8, "plus_ratio": ratio}}))
        before = flat(s.model.trainable_parameters())
        s.step(1)
        after = flat(s.model.trainable_parameters())
        deltas[ratio] = {k: after[k] - before[k] for k in before}
    one, four = deltas[1.0], deltas[4.0]
    a_keys = [k for k in one if k.endswith("lora_a")]
    b_keys = [k for k in one if k.endswith("lora_b")]
    assert all(np.abs(one[k]).max() > 0 for k in a_keys + b_keys)
    for k in a_keys:
        np.testing.assert_allclose(four[k], one[k], rtol=1e-5, atol=1e-9, err_msg=k)
    for k in b_keys:
        np.testing.assert_allclose(four[k], 4.0 * one[k], rtol=1e-3, atol=1e-8, err_msg=k)


def test_warm_start_checks_the_adapter_config(tiny_base, tiny_rendered, tmp_path):
    src = build_session(tiny_base, tiny_rendered, train_settings({**SETTINGS, "lora": {"rank": 4, "alpha": 8}}))
    randomize_b(src.model, seed=2)
    from orpo.train.lora import save_adapter

    save_adapter(src.model, src.adapter_config, tmp_path)
    warm = build_session(tiny_base, tiny_rendered, train_settings({**SETTINGS, "init_adapter": str(tmp_path),
                                                    "lora": {"rank": 4, "alpha": 8, "dropout": 0.1}}))
    theirs, ours = flat(src.model.trainable_parameters()), flat(warm.model.trainable_parameters())
    assert all(np.array_equal(theirs[k], ours[k]) for k in theirs)
    assert warm.init_adapter["sha256"] and int(warm.opt.state["step"]) == 0  # optimizer restarts

    with pytest.raises(AdapterMismatch, match=r"rank 4 != this run's 8 \(set lora.rank"):
        build_session(tiny_base, tiny_rendered, train_settings({**SETTINGS, "init_adapter": str(tmp_path), "lora": {"rank": 8, "alpha": 16}}))
    with pytest.raises(AdapterMismatch, match=r"keys .*\(set lora.target_modules"):
        build_session(tiny_base, tiny_rendered, train_settings({**SETTINGS, "init_adapter": str(tmp_path),
                                                 "lora": {"rank": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]}}))
    with pytest.raises(AdapterMismatch, match="scale 2.0 != this run's 4.0"):
        build_session(tiny_base, tiny_rendered, train_settings({**SETTINGS, "init_adapter": str(tmp_path), "lora": {"rank": 4, "alpha": 16}}))
    with pytest.raises(AdapterMismatch, match="no adapters.safetensors"):
        build_session(tiny_base, tiny_rendered, train_settings({**SETTINGS, "init_adapter": str(tmp_path / "nope")}))
