"""Where an ORPO step's time goes at a bench shape: forward, forward+backward, attention (mx.fast sdpa),
head (one process).

    python bench/step_profile.py --shape h200
Prints seconds per call of each piece (mean of timed calls after warm-up), to find what bounds the step.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import mlx.core as mx
import mlx.nn as nn

from engine_shapes import SUITES  # noqa: E402


def timeit(fn, n: int = 5, warm: int = 2) -> float:
    """Mean seconds of fn() (which returns arrays to evaluate)."""
    for _ in range(warm):
        mx.eval(fn())
    t0 = time.perf_counter()
    for _ in range(n):
        mx.eval(fn())
    return (time.perf_counter() - t0) / n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--shape", default="h200")
    a = ap.parse_args()
    shape = SUITES[a.shape].cases[0].shape
    dtype = getattr(mx, shape.dtype)
    from engine import LORA, build_model  # the same model and adapters as bench/engine.py's step cases
    from orpo.train.lora import apply_lora
    model = build_model(shape, 0)
    apply_lora(model, LORA, 0)
    B, T = 2 * shape.pairs, shape.prompt + shape.response - 1
    x = mx.random.randint(0, shape.vocab, (B, T))
    mx.eval(model.parameters(), x)
    print(f"shape {a.shape}: B={B} T={T} dtype={shape.dtype} device={mx.default_device()}")
    rows = []

    def hidden_sum(m, x):
        return m.model(x).astype(mx.float32).mean()

    def full_loss(m, x):
        logits = m(x).astype(mx.float32)
        return (mx.logsumexp(logits, axis=-1) - logits[..., 0]).mean()

    vg_h = nn.value_and_grad(model, hidden_sum)
    vg_full = nn.value_and_grad(model, full_loss)
    rows.append(("forward (hidden, no head)", timeit(lambda: model.model(x))))
    rows.append(("forward + logits", timeit(lambda: model(x))))
    rows.append(("fwd+bwd (hidden only)", timeit(lambda: vg_h(model, x))))
    rows.append(("fwd+bwd (full logits head)", timeit(lambda: vg_full(model, x))))
    H, D = shape.heads, shape.head_dim or shape.hidden // shape.heads
    q = mx.random.normal((B, H, T, D)).astype(dtype)
    k = mx.random.normal((B, shape.kv_heads, T, D)).astype(dtype)
    v = mx.random.normal((B, shape.kv_heads, T, D)).astype(dtype)
    attn = lambda q, k, v: mx.fast.scaled_dot_product_attention(q, k, v, scale=D**-0.5, mask="causal").astype(mx.float32).sum()
    rows.append(("sdpa causal fwd (1 layer)", timeit(lambda: mx.fast.scaled_dot_product_attention(q, k, v, scale=D**-0.5, mask="causal"))))
    rows.append(("sdpa causal fwd+bwd (1 layer)", timeit(lambda: mx.grad(attn, argnums=(0, 1, 2))(q, k, v))))
    # MLX's cuDNN attention backward runs only when the query length is a multiple of 128; otherwise the
    # gradient goes through the unfused fallback. Time both widths, causal and with a boolean block mask.
    T128 = -(-T // 128) * 128
    q2, k2, v2 = (mx.random.normal((B, n, T128, D)).astype(dtype) for n in (H, shape.kv_heads, shape.kv_heads))
    block_mask = mx.tril(mx.ones((T128, T128), mx.bool_))[None, None]
    for width, (qq, kk, vv) in ((T, (q, k, v)), (T128, (q2, k2, v2))):
        for label, m in (("causal", "causal"), ("bool mask", block_mask[..., :width, :width])):
            f = lambda q, k, v, m=m: mx.fast.scaled_dot_product_attention(q, k, v, scale=D**-0.5, mask=m).astype(mx.float32).sum()
            rows.append((f"sdpa {label} fwd+bwd T={width}", timeit(lambda f=f, qq=qq, kk=kk, vv=vv: mx.grad(f, argnums=(0, 1, 2))(qq, kk, vv))))
    # Agreement of the fast path (bf16, T128) with float32 attention through the same op (float32 inputs take
    # MLX's unfused path: cuDNN's attention is for float16/bfloat16 only).
    cot = mx.random.normal((B, H, T128, D))
    fast = mx.grad(lambda q, k, v: (mx.fast.scaled_dot_product_attention(q, k, v, scale=D**-0.5, mask="causal").astype(mx.float32) * cot).sum(), argnums=(0, 1, 2))(q2, k2, v2)
    ref = mx.grad(lambda q, k, v: (mx.fast.scaled_dot_product_attention(q, k, v, scale=D**-0.5, mask="causal") * cot).sum(), argnums=(0, 1, 2))(*(a.astype(mx.float32) for a in (q2, k2, v2)))
    for name, a, b in zip("qkv", fast, ref):
        err = (mx.linalg.norm(a.astype(mx.float32) - b) / mx.linalg.norm(b)).item()
        print(f"sdpa T={T128} bf16 d{name} vs float32: relative error {err:.2e}")
    h = mx.random.normal((B * T, shape.hidden)).astype(dtype)
    w = model.model.embed_tokens.weight
    head = lambda h: (mx.logsumexp((h @ w.T).astype(mx.float32), axis=-1)).mean()
    rows.append(("head logsumexp fwd+bwd", timeit(lambda: mx.grad(head)(h))))
    mlp = model.model.layers[0].mlp
    rows.append(("mlp fwd (1 layer)", timeit(lambda: mlp(h))))
    for name, s in rows:
        print(f"{name:44s} {s * 1000:9.2f} ms")
    print(f"peak {mx.get_peak_memory() / 1e9:.2f} GB")


if __name__ == "__main__":
    main()
