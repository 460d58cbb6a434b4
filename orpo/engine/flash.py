"""Causal (or unmasked) attention's backward as two CUDA kernels that keep the scores on chip, summing in a fixed order.

`flash_backward` gives what `attention.ordered_backward` gives (the same products, bf16 or fp16 operands, float32
sums) without writing a block's float32 scores to memory: one kernel per query block recomputes the row's
log-sum-exp and then dQ over the key blocks in order; one per key block sums dK and dV over the query blocks
(and a key head's query heads) in order. No atomics: the same inputs give the same bits on every run.
"""

from __future__ import annotations

from functools import cache

import mlx.core as mx

from orpo.device import on_cuda

# Tile sizes (template constants of the kernels): a thread block's 4 warps take 16 query rows (dQ) or 16 keys
# (dK/dV) each; blocks of the other side are multiples of 16. Row strides carry PAD extra elements so a warp's
# 32-bit reads spread over the banks (a multiple of 8: rows stay 16-byte aligned for vector copies).
THREADS, DQ_ROWS, DQ_KEYS, KV_KEYS, KV_ROWS, PAD = 128, 64, 32, 64, 32, 8

_HEADER = f"#define FAB_PAD {PAD}\n" + r"""
#define FAB_LOG2E 1.4426950408889634f
__device__ __forceinline__ float fab_neg_inf() { return __int_as_float(0xff800000); }

__device__ __forceinline__ unsigned fab_pack(float a, float b, const __nv_bfloat16*) {
  __nv_bfloat162 v = __floats2bfloat162_rn(a, b);
  return *reinterpret_cast<unsigned*>(&v);
}
__device__ __forceinline__ unsigned fab_pack(float a, float b, const __half*) {
  __half2 v = __floats2half2_rn(a, b);
  return *reinterpret_cast<unsigned*>(&v);
}
// c += a (16x16, row) * b (16x8, col), float32 accumulators.
__device__ __forceinline__ void fab_mma(float* c, const unsigned* a, const unsigned* b, const __nv_bfloat16*) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
               "{%0,%1,%2,%3};\n"
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
__device__ __forceinline__ void fab_mma(float* c, const unsigned* a, const unsigned* b, const __half*) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
               "{%0,%1,%2,%3};\n"
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
template <typename T>
__device__ __forceinline__ unsigned fab_pair(const T* p) { return *reinterpret_cast<const unsigned*>(p); }
template <typename T>
__device__ __forceinline__ unsigned fab_gather(const T* lo, const T* hi) {
  return (unsigned)*reinterpret_cast<const unsigned short*>(lo) |
         ((unsigned)*reinterpret_cast<const unsigned short*>(hi) << 16);
}

// rows [first, first + n) of a [len, D] matrix into shared memory (row stride D + FAB_PAD), zeros past len.
template <typename T, int D>
__device__ __forceinline__ void fab_load(T* dst, const T* src, int first, int n, int len) {
  constexpr int V = D / 8;  // 16-byte vectors a row
  for (int i = threadIdx.x; i < n * V; i += blockDim.x) {
    int r = i / V, c = (i % V) * 8;
    uint4 x = make_uint4(0, 0, 0, 0);
    if (first + r < len) x = *reinterpret_cast<const uint4*>(src + (size_t)(first + r) * D + c);
    *reinterpret_cast<uint4*>(dst + r * (D + FAB_PAD) + c) = x;
  }
}

// s[N/8][4] = A (16 rows of a [.., D] tile) * B^T (N rows of a [.., D] tile): a warp's 16 x N scores.
template <typename T, int D, int N>
__device__ __forceinline__ void fab_scores(float (*s)[4], const T* a, const T* b, int g, int t) {
  constexpr int SD = D + FAB_PAD;
#pragma unroll
  for (int n = 0; n < N / 8; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.f;
#pragma unroll
  for (int ks = 0; ks < D / 16; ++ks) {
    unsigned af[4] = {fab_pair(a + g * SD + ks * 16 + t * 2), fab_pair(a + (g + 8) * SD + ks * 16 + t * 2),
                      fab_pair(a + g * SD + ks * 16 + 8 + t * 2), fab_pair(a + (g + 8) * SD + ks * 16 + 8 + t * 2)};
#pragma unroll
    for (int n = 0; n < N / 8; ++n) {
      unsigned bf[2] = {fab_pair(b + (n * 8 + g) * SD + ks * 16 + t * 2),
                        fab_pair(b + (n * 8 + g) * SD + ks * 16 + 8 + t * 2)};
      fab_mma(s[n], af, bf, a);
    }
  }
}

// acc[D/8][4] += P (the warp's 16 x K, as score fragments) * M (K rows of a [.., D] tile).
template <typename T, int D, int K>
__device__ __forceinline__ void fab_accumulate(float (*acc)[4], const float (*p)[4], const T* m, int g, int t) {
  constexpr int SD = D + FAB_PAD;
#pragma unroll
  for (int ks = 0; ks < K / 16; ++ks) {
    const T* tag = m;
    unsigned af[4] = {fab_pack(p[2 * ks][0], p[2 * ks][1], tag), fab_pack(p[2 * ks][2], p[2 * ks][3], tag),
                      fab_pack(p[2 * ks + 1][0], p[2 * ks + 1][1], tag),
                      fab_pack(p[2 * ks + 1][2], p[2 * ks + 1][3], tag)};
    const T* r0 = m + (ks * 16 + t * 2) * SD;
#pragma unroll
    for (int n = 0; n < D / 8; ++n) {
      unsigned bf[2] = {fab_gather(r0 + n * 8 + g, r0 + SD + n * 8 + g),
                        fab_gather(r0 + 8 * SD + n * 8 + g, r0 + 9 * SD + n * 8 + g)};
      fab_mma(acc[n], af, bf, m);
    }
  }
}
"""

# One query block a thread block: pass 1 its rows' log-sum-exp (base 2, of scale * log2(e) * scores), pass 2 dQ.
_DQ_SOURCE = r"""
  constexpr int BR = DQ_ROWS, BC = DQ_KEYS, SK = DK + FAB_PAD, SV = DV + FAB_PAD;
  extern __shared__ __align__(16) unsigned char fab_smem[];
  T* sQ = reinterpret_cast<T*>(fab_smem);
  T* sO = sQ + BR * SK;
  T* sK = sO + BR * SV;
  T* sV = sK + BC * SK;
  const int H = q_shape[1], L = q_shape[2], KVH = k_shape[1], S = k_shape[2];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane >> 2, t = lane & 3;
  const int q0 = blockIdx.x * BR, h = blockIdx.y, b = blockIdx.z, kvh = h / (H / KVH), offset = S - L;
  const size_t bh = (size_t)b * H + h, bkv = (size_t)b * KVH + kvh;
  const float sl = scale[0] * FAB_LOG2E;
  fab_load<T, DK>(sQ, q + bh * L * DK, q0, BR, L);
  fab_load<T, DV>(sO, dout + bh * L * DV, q0, BR, L);
  const int row[2] = {q0 + warp * 16 + g, q0 + warp * 16 + g + 8};
  const int kend = CAUSAL ? min(S, q0 + BR + offset) : S;
  float m[2] = {fab_neg_inf(), fab_neg_inf()}, l[2] = {0.f, 0.f};
  float s[BC / 8][4], dp[BC / 8][4];
  for (int k0 = 0; k0 < kend; k0 += BC) {
    __syncthreads();
    fab_load<T, DK>(sK, k + bkv * S * DK, k0, BC, S);
    __syncthreads();
    fab_scores<T, DK, BC>(s, sQ + warp * 16 * SK, sK, g, t);
    float top[2] = {fab_neg_inf(), fab_neg_inf()};
#pragma unroll
    for (int n = 0; n < BC / 8; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        int r = row[e >> 1], key = k0 + n * 8 + t * 2 + (e & 1);
        bool ok = r < L && key < S && (!CAUSAL || key <= r + offset);
        s[n][e] = ok ? s[n][e] * sl : fab_neg_inf();
        top[e >> 1] = fmaxf(top[e >> 1], s[n][e]);
      }
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      top[i] = fmaxf(top[i], __shfl_xor_sync(0xffffffff, top[i], 1));
      top[i] = fmaxf(top[i], __shfl_xor_sync(0xffffffff, top[i], 2));
      float mn = fmaxf(m[i], top[i]);
      if (mn == fab_neg_inf()) continue;
      float sum = 0.f;
#pragma unroll
      for (int n = 0; n < BC / 8; ++n) sum += exp2f(s[n][2 * i] - mn) + exp2f(s[n][2 * i + 1] - mn);
      l[i] = l[i] * exp2f(m[i] - mn) + sum;
      m[i] = mn;
    }
  }
  float lse[2], dl[2];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    l[i] += __shfl_xor_sync(0xffffffff, l[i], 1);
    l[i] += __shfl_xor_sync(0xffffffff, l[i], 2);
    lse[i] = m[i] + log2f(l[i]);
    dl[i] = row[i] < L ? delta[bh * L + row[i]] : 0.f;
    if (t == 0 && row[i] < L) lse_out[bh * L + row[i]] = lse[i];
  }
  float acc[DK / 8][4];
#pragma unroll
  for (int n = 0; n < DK / 8; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.f;
  for (int k0 = 0; k0 < kend; k0 += BC) {
    __syncthreads();
    fab_load<T, DK>(sK, k + bkv * S * DK, k0, BC, S);
    fab_load<T, DV>(sV, v + bkv * S * DV, k0, BC, S);
    __syncthreads();
    fab_scores<T, DK, BC>(s, sQ + warp * 16 * SK, sK, g, t);
    fab_scores<T, DV, BC>(dp, sO + warp * 16 * SV, sV, g, t);
#pragma unroll
    for (int n = 0; n < BC / 8; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        int r = row[e >> 1], key = k0 + n * 8 + t * 2 + (e & 1);
        bool ok = r < L && key < S && (!CAUSAL || key <= r + offset);
        float p = ok ? exp2f(s[n][e] * sl - lse[e >> 1]) : 0.f;
        s[n][e] = p * (dp[n][e] - dl[e >> 1]);
      }
    fab_accumulate<T, DK, BC>(acc, s, sK, g, t);
  }
  const float sc = scale[0];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    if (row[i] >= L) continue;
    T* out = dq + (bh * L + row[i]) * DK;
#pragma unroll
    for (int n = 0; n < DK / 8; ++n)
      *reinterpret_cast<unsigned*>(out + n * 8 + t * 2) = fab_pack(acc[n][2 * i] * sc, acc[n][2 * i + 1] * sc, out);
  }
"""

# One key block of one key head a thread block: dK and dV summed over its query heads and query blocks in order.
_DKV_SOURCE = r"""
  constexpr int BC = KV_KEYS, BR = KV_ROWS, SK = DK + FAB_PAD, SV = DV + FAB_PAD;
  extern __shared__ __align__(16) unsigned char fab_smem[];
  T* sK = reinterpret_cast<T*>(fab_smem);
  T* sV = sK + BC * SK;
  T* sQ = sV + BC * SV;
  T* sO = sQ + BR * SK;
  float* sL = reinterpret_cast<float*>(sO + BR * SV);
  float* sD = sL + BR;
  const int H = q_shape[1], L = q_shape[2], KVH = k_shape[1], S = k_shape[2], G = H / KVH;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane >> 2, t = lane & 3;
  const int k0 = blockIdx.x * BC, kvh = blockIdx.y, b = blockIdx.z, offset = S - L;
  const size_t bkv = (size_t)b * KVH + kvh;
  const float sl = scale[0] * FAB_LOG2E;
  fab_load<T, DK>(sK, k + bkv * S * DK, k0, BC, S);
  fab_load<T, DV>(sV, v + bkv * S * DV, k0, BC, S);
  const int key[2] = {k0 + warp * 16 + g, k0 + warp * 16 + g + 8};
  const int qfirst = CAUSAL ? max(0, k0 - offset) / BR * BR : 0;
  float dk[DK / 8][4], dv[DV / 8][4], s[BR / 8][4], dp[BR / 8][4];
#pragma unroll
  for (int n = 0; n < DK / 8; ++n) dk[n][0] = dk[n][1] = dk[n][2] = dk[n][3] = 0.f;
#pragma unroll
  for (int n = 0; n < DV / 8; ++n) dv[n][0] = dv[n][1] = dv[n][2] = dv[n][3] = 0.f;
  for (int hg = 0; hg < G; ++hg) {
    const size_t bh = (size_t)b * H + kvh * G + hg;
    for (int q0 = qfirst; q0 < L; q0 += BR) {
      __syncthreads();
      fab_load<T, DK>(sQ, q + bh * L * DK, q0, BR, L);
      fab_load<T, DV>(sO, dout + bh * L * DV, q0, BR, L);
      if (threadIdx.x < BR) {
        int r = q0 + threadIdx.x;
        sL[threadIdx.x] = r < L ? lse[bh * L + r] : 0.f;
        sD[threadIdx.x] = r < L ? delta[bh * L + r] : 0.f;
      }
      __syncthreads();
      fab_scores<T, DK, BR>(s, sK + warp * 16 * SK, sQ, g, t);
      fab_scores<T, DV, BR>(dp, sV + warp * 16 * SV, sO, g, t);
#pragma unroll
      for (int n = 0; n < BR / 8; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          int c = n * 8 + t * 2 + (e & 1), r = q0 + c, kk = key[e >> 1];
          bool ok = r < L && kk < S && (!CAUSAL || kk <= r + offset);
          float p = ok ? exp2f(s[n][e] * sl - sL[c]) : 0.f;
          s[n][e] = p;
          dp[n][e] = p * (dp[n][e] - sD[c]);
        }
      fab_accumulate<T, DV, BR>(dv, s, sO, g, t);
      fab_accumulate<T, DK, BR>(dk, dp, sQ, g, t);
    }
  }
  const float sc = scale[0];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    if (key[i] >= S) continue;
    T* gk = dk_out + (bkv * S + key[i]) * DK;
    T* ov = dv_out + (bkv * S + key[i]) * DV;
#pragma unroll
    for (int n = 0; n < DK / 8; ++n)
      *reinterpret_cast<unsigned*>(gk + n * 8 + t * 2) = fab_pack(dk[n][2 * i] * sc, dk[n][2 * i + 1] * sc, gk);
#pragma unroll
    for (int n = 0; n < DV / 8; ++n)
      *reinterpret_cast<unsigned*>(ov + n * 8 + t * 2) = fab_pack(dv[n][2 * i], dv[n][2 * i + 1], ov);
  }
"""


def _tiles_bytes(rows_a: int, rows_b: int, dk: int, dv: int, itemsize: int) -> int:
    return (rows_a + rows_b) * (dk + PAD + dv + PAD) * itemsize


@cache
def _kernels(dk: int, dv: int, itemsize: int) -> tuple:
    """The two kernels for head dims (dk, dv) (shared memory is fixed per kernel object)."""
    dq = mx.fast.cuda_kernel(
        name=f"orpo_flash_dq_{dk}_{dv}", input_names=["q", "k", "v", "dout", "delta", "scale"],
        output_names=["dq", "lse_out"], source=_DQ_SOURCE, header=_HEADER,
        shared_memory=_tiles_bytes(DQ_ROWS, DQ_KEYS, dk, dv, itemsize))
    dkv = mx.fast.cuda_kernel(
        name=f"orpo_flash_dkv_{dk}_{dv}", input_names=["q", "k", "v", "dout", "delta", "lse", "scale"],
        output_names=["dk_out", "dv_out"], source=_DKV_SOURCE, header=_HEADER,
        shared_memory=_tiles_bytes(KV_KEYS, KV_ROWS, dk, dv, itemsize) + 2 * KV_ROWS * 4)
    return dq, dkv


# Widest head dim the kernels take (measured up to 128; wider ones would hold their dK and dV sums in spilled
# registers).
MAX_HEAD_DIM = 128


def flash_fits(q: mx.array, k: mx.array, mask: object) -> bool:
    """Whether `flash_backward` takes this attention: CUDA, half-precision operands, a query/key head dim (the
    widest: values never carry the exclusion dims) up to MAX_HEAD_DIM once padded to 16, no mask or a causal
    one whose keys are at least its queries."""
    return (on_cuda() and q.dtype in (mx.bfloat16, mx.float16) and k.dtype == q.dtype
            and -(-q.shape[-1] // 16) * 16 <= MAX_HEAD_DIM
            and (mask is None or (isinstance(mask, str) and mask == "causal" and k.shape[2] >= q.shape[2])))


def pad_head_dim(x: mx.array, to: int) -> mx.array:
    """x with zeros appended to its last axis up to `to`."""
    extra = to - x.shape[-1]
    return x if extra == 0 else mx.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, extra)])


def _template(dtype: mx.Dtype, dk: int, dv: int, causal: bool) -> list:
    return [("T", dtype), ("DK", dk), ("DV", dv), ("CAUSAL", causal), ("DQ_ROWS", DQ_ROWS), ("DQ_KEYS", DQ_KEYS),
            ("KV_KEYS", KV_KEYS), ("KV_ROWS", KV_ROWS)]


def dq_and_lse(q: mx.array, k: mx.array, v: mx.array, dout: mx.array, delta: mx.array, scale: mx.array,
               causal: bool) -> tuple[mx.array, mx.array]:
    """The dQ kernel on head dims already multiples of 16: dq like q, and each row's log-sum-exp [B, H, L] (base
    2, of scale * log2(e) * scores) for `dk_and_dv`. `delta` [B, H, L] float32, `scale` a float32 [1]."""
    b, h, length, dk = q.shape
    return _kernels(dk, v.shape[-1], q.dtype.size)[0](
        inputs=[q, k, v, dout, delta, scale], template=_template(q.dtype, dk, v.shape[-1], causal),
        grid=(-(-length // DQ_ROWS) * THREADS, h, b), threadgroup=(THREADS, 1, 1),
        output_shapes=[q.shape, (b, h, length)], output_dtypes=[q.dtype, mx.float32])


def dk_and_dv(q: mx.array, k: mx.array, v: mx.array, dout: mx.array, delta: mx.array, lse: mx.array,
              scale: mx.array, causal: bool) -> tuple[mx.array, mx.array]:
    """The dK/dV kernel, as `dq_and_lse` takes its arguments, given its `lse`."""
    b, kvh, keys, dk = k.shape
    return _kernels(dk, v.shape[-1], q.dtype.size)[1](
        inputs=[q, k, v, dout, delta, lse, scale], template=_template(q.dtype, dk, v.shape[-1], causal),
        grid=(-(-keys // KV_KEYS) * THREADS, kvh, b), threadgroup=(THREADS, 1, 1),
        output_shapes=[k.shape, v.shape], output_dtypes=[k.dtype, v.dtype])


def flash_backward(q: mx.array, k: mx.array, v: mx.array, scale: float, causal: bool, cotangent: mx.array,
                   delta: mx.array) -> tuple[mx.array, mx.array, mx.array]:
    """dq, dk, dv of softmax attention (q [B, H, L, D], k/v [B, kv heads, keys, D], causal bottom-right aligned)
    given the output's cotangent and delta = rowsum(dO * O) [B, H, L] in float32. Head dims are zero-padded to
    multiples of 16 for the tensor-core products (zeros change no score)."""
    d, dvv = q.shape[-1], v.shape[-1]
    dk_, dv_ = -(-d // 16) * 16, -(-dvv // 16) * 16
    qp, kp = pad_head_dim(q, dk_), pad_head_dim(k, dk_)
    vp, dop = pad_head_dim(v, dv_), pad_head_dim(cotangent.astype(q.dtype), dv_)
    scale_arr = mx.array([scale], mx.float32)
    delta = delta.reshape(q.shape[:3]).astype(mx.float32)
    dq, lse = dq_and_lse(qp, kp, vp, dop, delta, scale_arr, causal)
    dk, dv = dk_and_dv(qp, kp, vp, dop, delta, lse, scale_arr, causal)
    return dq[..., :d], dk[..., :d], dv[..., :dvv]
