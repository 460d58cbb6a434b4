"""The fused head's forward block as one CUDA kernel: a [chunk, V] logit block -> logsumexp and target log-prob.

Under mx.compile the pure-MLX block (orpo.engine.head._forward_block) casts the block to float32, writing and
reading back a [chunk, V] float32 array, before MLX's logsumexp kernel. This kernel reads the block once in
its own dtype (16-byte loads), keeps each thread's running max and sum of exponentials in float32 registers
(one rescale per load), and reduces them per row; the optional logit softcap is applied per element as the
MLX block does. Measured on the H200 (bench/README.md): 1.78-1.85x the MLX block's speed at the auto chunk
for V 32k-256k, 1.15-1.27x one head chunk's forward; the lazy head's peak at V 32k 0.81x; a full step's
speed unchanged within run-to-run noise (0.97x, 0.96x peak), so `train.engine.head_kernel` is off by
default. Only the forward block: the backward's block is one fused elementwise kernel under mx.compile
already. CUDA only (`mx.fast.cuda_kernel`); elsewhere `logsumexp_block` returns None.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache

import mlx.core as mx

from orpo.device import on_cuda

THREADS = 256  # per row: one thread block per row of the logit block

_SOURCE = """
    const int row = blockIdx.x;
    const int tid = threadIdx.x;
    const T* xr = x + (size_t)row * V;
    const float c = CAP ? cap[0] : 1.0f;
    float m = -INFINITY, s = 0.0f;
    if (VEC) {  // V % (16 / sizeof(T)) == 0, checked by the caller
        constexpr int E = 16 / sizeof(T);
        const uint4* xv = reinterpret_cast<const uint4*>(xr);
        for (int j = tid; j < V / E; j += NT) {
            uint4 raw = xv[j];
            const T* e = reinterpret_cast<const T*>(&raw);
            float z[E];
            #pragma unroll
            for (int i = 0; i < E; ++i) {
                z[i] = static_cast<float>(e[i]);
                if (CAP) z[i] = tanhf(z[i] / c) * c;
            }
            float top = z[0];
            #pragma unroll
            for (int i = 1; i < E; ++i) top = fmaxf(top, z[i]);
            float mn = fmaxf(m, top), acc = 0.0f;
            #pragma unroll
            for (int i = 0; i < E; ++i) acc += __expf(z[i] - mn);
            s = (m == -INFINITY ? 0.0f : s * __expf(m - mn)) + acc;
            m = mn;
        }
    } else {
        for (int j = tid; j < V; j += NT) {
            float z = static_cast<float>(xr[j]);
            if (CAP) z = tanhf(z / c) * c;
            if (z > m) { s = s * __expf(m - z) + 1.0f; m = z; } else { s += __expf(z - m); }
        }
    }
    // Merge (max, sum) pairs: within each warp, then the warps' results in the first warp.
    __shared__ float smax[NT / 32];
    __shared__ float ssum[NT / 32];
    for (int pass = 0; pass < 2; ++pass) {
        for (int off = 16; off > 0; off >>= 1) {
            float m2 = __shfl_xor_sync(0xffffffff, m, off);
            float s2 = __shfl_xor_sync(0xffffffff, s, off);
            float mn = fmaxf(m, m2);
            s = (m == -INFINITY ? 0.0f : s * __expf(m - mn)) + (m2 == -INFINITY ? 0.0f : s2 * __expf(m2 - mn));
            m = mn;
        }
        if (pass == 1) break;
        if ((tid & 31) == 0) { smax[tid >> 5] = m; ssum[tid >> 5] = s; }
        __syncthreads();
        if (tid >= 32) return;
        m = tid < NT / 32 ? smax[tid] : -INFINITY;
        s = tid < NT / 32 ? ssum[tid] : 0.0f;
    }
    if (tid == 0) {
        float target = static_cast<float>(xr[targets[row]]);
        if (CAP) target = tanhf(target / c) * c;
        const float l = m + logf(s);
        lse[row] = l;
        logp[row] = target - l;
    }
"""

@cache
def _kernel() -> Callable:
    """The compiled CUDA kernel (built on first use: NVRTC compiles it per template instance)."""
    return mx.fast.cuda_kernel(name="orpo_head_logsumexp", input_names=["x", "targets", "cap"],
                               output_names=["logp", "lse"], source=_SOURCE)


@cache
def _block(cap: float | None) -> Callable[[mx.array, mx.array], tuple[mx.array, mx.array]]:
    """The kernel's block function for one softcap (kept: the head calls it once per chunk)."""
    cap_array = mx.array([cap or 1.0], mx.float32)

    def block(x: mx.array, targets: mx.array) -> tuple[mx.array, mx.array]:
        c, v = x.shape
        logp, lse = _kernel()(inputs=[x, targets.astype(mx.int32), cap_array],
                              template=[("T", x.dtype), ("V", v), ("NT", THREADS),
                                        ("VEC", v % (16 // x.itemsize) == 0), ("CAP", cap is not None)],
                              grid=(c * THREADS, 1, 1), threadgroup=(THREADS, 1, 1),
                              output_shapes=[(c,), (c,)], output_dtypes=[mx.float32, mx.float32])
        return logp, lse

    return block


def logsumexp_block(cap: float | None) -> Callable[[mx.array, mx.array], tuple[mx.array, mx.array]] | None:
    """(x [c, V], targets [c]) -> (target log-prob, logsumexp), float32, by the kernel; None where it cannot run."""
    return _block(cap) if on_cuda() else None
