"""Causal (or unmasked) attention as CUDA kernels that keep the scores on chip: a forward, and a backward summing in
a fixed order. Both take each query's key bounds (its first key: packed rows keep a pair to itself; a hidden span:
prefix rows keep rejected's queries blind to chosen's keys), which no head-dim trick needs, so they run at any head
dim up to 128, and skip the key blocks (query blocks) no row of a block sees.

`flash_backward` gives what `attention.ordered_backward` gives (the same products, bf16 or fp16 operands, float32
sums) without writing a block's float32 scores to memory: one kernel per query block recomputes the row's
log-sum-exp and then dQ over the key blocks in order; one per key block and query head sums that head's shares
of dK and dV over the query blocks in order, and a key head's shares are then added in head order. No atomics:
the same inputs give the same bits on every run. Products are bf16/fp16 tensor-core `mma.sync` on fragments read
with `ldmatrix`; the blocks a loop walks are double-buffered in shared memory, the next copied with `cp.async`
while the current one is multiplied.
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
// The 32-bit shared-memory address that ldmatrix and cp.async take.
__device__ __forceinline__ unsigned fab_smem_address(const void* p) {
  unsigned a;
  asm volatile("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }\n" : "=r"(a) : "l"(p));
  return a;
}
// Four 8x8 b16 matrices from shared memory (lanes 8i..8i+7 give matrix i's row addresses); .trans transposes each.
__device__ __forceinline__ void fab_ldsm(unsigned* r, const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(fab_smem_address(p)));
}
__device__ __forceinline__ void fab_ldsm_trans(unsigned* r, const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(fab_smem_address(p)));
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

// Asynchronous copies (sm_80+): `bytes` of 16 (or 4) copied, the rest of the destination zero-filled.
__device__ __forceinline__ void fab_copy16(void* dst, const void* src, int bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" :: "r"(fab_smem_address(dst)), "l"(src), "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void fab_copy4(void* dst, const void* src, int bytes) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" :: "r"(fab_smem_address(dst)), "l"(src), "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void fab_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void fab_wait() { asm volatile("cp.async.wait_group %0;\n" :: "n"(N) : "memory"); }

// fab_load's rows, copied asynchronously (fab_commit, then fab_wait before reading them).
template <typename T, int D>
__device__ __forceinline__ void fab_load_async(T* dst, const T* src, int first, int n, int len) {
  constexpr int V = D / 8;
  for (int i = threadIdx.x; i < n * V; i += blockDim.x) {
    int r = i / V, c = (i % V) * 8;
    bool ok = first + r < len;
    fab_copy16(dst + r * (D + FAB_PAD) + c, src + (size_t)(ok ? first + r : 0) * D + c, ok ? 16 : 0);
  }
}

// s[N/8][4] = A (16 rows of a [.., D] tile) * B^T (N rows of a [.., D] tile): a warp's 16 x N scores.
template <typename T, int D, int N>
__device__ __forceinline__ void fab_scores(float (*s)[4], const T* a, const T* b) {
  constexpr int SD = D + FAB_PAD;
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int n = 0; n < N / 8; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.f;
#pragma unroll
  for (int ks = 0; ks < D / 16; ++ks) {
    unsigned af[4];
    fab_ldsm(af, a + (lane & 15) * SD + ks * 16 + (lane >> 4) * 8);
#pragma unroll
    for (int n = 0; n < N / 8; n += 2) {
      unsigned bf[4];
      fab_ldsm(bf, b + (n * 8 + (lane & 7) + (lane >> 4) * 8) * SD + ks * 16 + ((lane >> 3) & 1) * 8);
      fab_mma(s[n], af, bf, a);
      fab_mma(s[n + 1], af, bf + 2, a);
    }
  }
}

// Whether query r sees key `key`: inside the rows, causal (bottom-right aligned by `offset`) where asked, not
// below the query's first key `lo` (packed rows: its pair's first token) and not in its hidden span [hs, he)
// (prefix rows: rejected's queries never see chosen's keys).
template <bool CAUSAL>
__device__ __forceinline__ bool fab_sees(int r, int key, int L, int S, int offset, int lo, int hs, int he) {
  return r < L && key < S && (!CAUSAL || key <= r + offset) && key >= lo && !(key >= hs && key < he);
}

// acc[D/8][4] += P (the warp's 16 x K, as score fragments) * M (K rows of a [.., D] tile).
template <typename T, int D, int K>
__device__ __forceinline__ void fab_accumulate(float (*acc)[4], const float (*p)[4], const T* m) {
  constexpr int SD = D + FAB_PAD;
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int ks = 0; ks < K / 16; ++ks) {
    const T* tag = m;
    unsigned af[4] = {fab_pack(p[2 * ks][0], p[2 * ks][1], tag), fab_pack(p[2 * ks][2], p[2 * ks][3], tag),
                      fab_pack(p[2 * ks + 1][0], p[2 * ks + 1][1], tag),
                      fab_pack(p[2 * ks + 1][2], p[2 * ks + 1][3], tag)};
    const T* r0 = m + (ks * 16 + (lane & 15)) * SD + (lane >> 4) * 8;
#pragma unroll
    for (int n = 0; n < D / 8; n += 2) {
      unsigned bf[4];
      fab_ldsm_trans(bf, r0 + n * 8);
      fab_mma(acc[n], af, bf, m);
      fab_mma(acc[n + 1], af, bf + 2, m);
    }
  }
}

// One key block (keys k0 .. k0 + BC - 1) of a warp's online softmax (base 2) over its rows row[0], row[1]: the
// scores s become p = exp2(sl * score - m) (0 for keys a row does not see), each row's running maximum m and sum l
// take the block in, and alpha gets the factor by which the earlier blocks' sum (and anything summed with it) shrinks.
template <int BC, bool CAUSAL>
__device__ __forceinline__ void fab_softmax_block(float (*s)[4], float* m, float* l, float* alpha, const int* row,
                                                  const int (*bd)[3], int k0, int L, int S, int offset, float sl,
                                                  int t) {
  float top[2] = {fab_neg_inf(), fab_neg_inf()};
#pragma unroll
  for (int n = 0; n < BC / 8; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int* b = bd[e >> 1];
      bool ok = fab_sees<CAUSAL>(row[e >> 1], k0 + n * 8 + t * 2 + (e & 1), L, S, offset, b[0], b[1], b[2]);
      s[n][e] = ok ? s[n][e] * sl : fab_neg_inf();
      top[e >> 1] = fmaxf(top[e >> 1], s[n][e]);
    }
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    top[i] = fmaxf(top[i], __shfl_xor_sync(0xffffffff, top[i], 1));
    top[i] = fmaxf(top[i], __shfl_xor_sync(0xffffffff, top[i], 2));
    const float mn = fmaxf(m[i], top[i]);
    const float base = mn == fab_neg_inf() ? 0.f : mn;  // a row that has seen no key yet: every p is 0
    alpha[i] = exp2f(m[i] - base);
    float sum = 0.f;
#pragma unroll
    for (int n = 0; n < BC / 8; ++n) {
      s[n][2 * i] = exp2f(s[n][2 * i] - base);
      s[n][2 * i + 1] = exp2f(s[n][2 * i + 1] - base);
      sum += s[n][2 * i] + s[n][2 * i + 1];
    }
    l[i] = l[i] * alpha[i] + sum;
    m[i] = mn;
  }
}

// Pass 1 of a query block: the log-sum-exp (base 2, of sl * scores) of the warp's rows row[0], row[1] (bounds
// bd) over the keys kfirst .. kend - 1 they see, key blocks double-buffered in sK (2 * BC rows).
template <typename T, int DK, int BC, bool CAUSAL>
__device__ __forceinline__ void fab_rows_lse(float* lse, const T* sQw, T* sK, const T* kg, const int* row,
                                             const int (*bd)[3], int L, int S, int offset, int kfirst, int kend,
                                             float sl, int t) {
  constexpr int SK = DK + FAB_PAD;
  float m[2] = {fab_neg_inf(), fab_neg_inf()}, l[2] = {0.f, 0.f}, alpha[2];
  float s[BC / 8][4];
  const int blocks = (kend - kfirst + BC - 1) / BC;
  fab_load_async<T, DK>(sK, kg, kfirst, BC, S);
  fab_commit();
  for (int j = 0; j < blocks; ++j) {
    const int k0 = kfirst + j * BC;
    if (j + 1 < blocks) {
      fab_load_async<T, DK>(sK + ((j + 1) & 1) * BC * SK, kg, k0 + BC, BC, S);
      fab_commit();
      fab_wait<1>();
    } else {
      fab_wait<0>();
    }
    __syncthreads();
    fab_scores<T, DK, BC>(s, sQw, sK + (j & 1) * BC * SK);
    fab_softmax_block<BC, CAUSAL>(s, m, l, alpha, row, bd, k0, L, S, offset, sl, t);
    __syncthreads();  // the next copy overwrites this block's buffer
  }
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    l[i] += __shfl_xor_sync(0xffffffff, l[i], 1);
    l[i] += __shfl_xor_sync(0xffffffff, l[i], 2);
    lse[i] = m[i] + log2f(l[i]);
  }
}
"""

# The query-block kernels' indices: this block's queries, head, row, key head; the warp's rows and their key
# bounds; the first key block any of the block's rows sees (packed rows skip the earlier pairs' keys), the key
# blocks from there (on the row's K and V) and the block's queries, loaded into sQ.
_QUERY_BLOCK = r"""  const int H = q_shape[1], L = q_shape[2], KVH = k_shape[1], S = k_shape[2];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane >> 2, t = lane & 3;
  // Causal: the last query blocks see the most keys; blocks start in order of x, so they take x = 0 first.
  const int q0 = (CAUSAL ? gridDim.x - 1 - blockIdx.x : blockIdx.x) * BR, h = blockIdx.y, b = blockIdx.z;
  const int kvh = h / (H / KVH), offset = S - L;
  const size_t bh = (size_t)b * H + h, bkv = (size_t)b * KVH + kvh;
  const float sl = scale[0] * FAB_LOG2E;
  const int row[2] = {q0 + warp * 16 + g, q0 + warp * 16 + g + 8};
  int bd[2][3];
#pragma unroll
  for (int i = 0; i < 2; ++i)
#pragma unroll
    for (int c = 0; c < 3; ++c) bd[i][c] = bounds[((size_t)b * L + min(row[i], L - 1)) * 3 + c];
  __shared__ int fab_lo;
  if (threadIdx.x == 0) fab_lo = S;
  __syncthreads();
  if (threadIdx.x < BR && q0 + threadIdx.x < L) atomicMin(&fab_lo, bounds[((size_t)b * L + q0 + threadIdx.x) * 3]);
  __syncthreads();
  const int kfirst = fab_lo / BC * BC;
  const int kend = CAUSAL ? min(S, q0 + BR + offset) : S;
  const int blocks = (kend - kfirst + BC - 1) / BC;
  const T* kg = k + bkv * S * DK;
  const T* vg = v + bkv * S * DV;
  fab_load<T, DK>(sQ, q + bh * L * DK, q0, BR, L);
"""

# The walk over key blocks from kfirst (the forward's, and the dQ kernel's pass 2), K and V double-buffered: block
# j is read while block j + 1 is copied.
_KEY_BLOCKS = r"""  fab_load_async<T, DK>(sK, kg, kfirst, BC, S);
  fab_load_async<T, DV>(sV, vg, kfirst, BC, S);
  fab_commit();
  for (int j = 0; j < blocks; ++j) {
    const int k0 = kfirst + j * BC;
    if (j + 1 < blocks) {
      fab_load_async<T, DK>(sK + ((j + 1) & 1) * BC * SK, kg, k0 + BC, BC, S);
      fab_load_async<T, DV>(sV + ((j + 1) & 1) * BC * SV, vg, k0 + BC, BC, S);
      fab_commit();
      fab_wait<1>();
    } else {
      fab_wait<0>();
    }
    __syncthreads();
"""

# One query block a thread block: pass 1 its rows' log-sum-exp (base 2, of scale * log2(e) * scores), pass 2 dQ.
_DQ_SOURCE = r"""
  constexpr int BR = DQ_ROWS, BC = DQ_KEYS, SK = DK + FAB_PAD, SV = DV + FAB_PAD;
  extern __shared__ __align__(16) unsigned char fab_smem[];
  T* sQ = reinterpret_cast<T*>(fab_smem);
  T* sO = sQ + BR * SK;
  T* sK = sO + BR * SV;  // two key blocks: the one read and the next, copied meanwhile
  T* sV = sK + 2 * BC * SK;
""" + _QUERY_BLOCK + r"""
  fab_load<T, DV>(sO, dout + bh * L * DV, q0, BR, L);
  float s[BC / 8][4], dp[BC / 8][4], lse[2], dl[2];
  fab_rows_lse<T, DK, BC, CAUSAL>(lse, sQ + warp * 16 * SK, sK, kg, row, bd, L, S, offset, kfirst, kend, sl, t);
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    dl[i] = row[i] < L ? delta[bh * L + row[i]] : 0.f;
    if (t == 0 && row[i] < L) lse_out[bh * L + row[i]] = lse[i];
  }
  float acc[DK / 8][4] = {};
""" + _KEY_BLOCKS + r"""
    const T* cK = sK + (j & 1) * BC * SK;
    fab_scores<T, DK, BC>(s, sQ + warp * 16 * SK, cK);
    fab_scores<T, DV, BC>(dp, sO + warp * 16 * SV, sV + (j & 1) * BC * SV);
#pragma unroll
    for (int n = 0; n < BC / 8; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int* r = bd[e >> 1];
        bool ok = fab_sees<CAUSAL>(row[e >> 1], k0 + n * 8 + t * 2 + (e & 1), L, S, offset, r[0], r[1], r[2]);
        float p = ok ? exp2f(s[n][e] * sl - lse[e >> 1]) : 0.f;
        s[n][e] = p * (dp[n][e] - dl[e >> 1]);
      }
    fab_accumulate<T, DK, BC>(acc, s, cK);
    __syncthreads();
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

# The forward, one query block a thread block, in one walk over the key blocks: each row's running maximum and sum
# (online softmax), the accumulated P V rescaled as the maximum grows, divided by the sum at the end.
_FORWARD_SOURCE = r"""
  constexpr int BR = DQ_ROWS, BC = DQ_KEYS, SK = DK + FAB_PAD, SV = DV + FAB_PAD;
  extern __shared__ __align__(16) unsigned char fab_smem[];
  T* sQ = reinterpret_cast<T*>(fab_smem);
  T* sK = sQ + BR * SK;  // two key blocks (and their values): the one read and the next, copied meanwhile
  T* sV = sK + 2 * BC * SK;
""" + _QUERY_BLOCK + r"""
  float m[2] = {fab_neg_inf(), fab_neg_inf()}, l[2] = {0.f, 0.f}, alpha[2], s[BC / 8][4], acc[DV / 8][4] = {};
""" + _KEY_BLOCKS + r"""
    fab_scores<T, DK, BC>(s, sQ + warp * 16 * SK, sK + (j & 1) * BC * SK);
    fab_softmax_block<BC, CAUSAL>(s, m, l, alpha, row, bd, k0, L, S, offset, sl, t);
#pragma unroll
    for (int n = 0; n < DV / 8; ++n) {
      acc[n][0] *= alpha[0];
      acc[n][1] *= alpha[0];
      acc[n][2] *= alpha[1];
      acc[n][3] *= alpha[1];
    }
    fab_accumulate<T, DV, BC>(acc, s, sV + (j & 1) * BC * SV);
    __syncthreads();
  }
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    l[i] += __shfl_xor_sync(0xffffffff, l[i], 1);
    l[i] += __shfl_xor_sync(0xffffffff, l[i], 2);
    if (row[i] >= L) continue;
    const float inv = l[i] > 0.f ? 1.f / l[i] : 0.f;
    T* o = out + (bh * L + row[i]) * DV;
#pragma unroll
    for (int n = 0; n < DV / 8; ++n)
      *reinterpret_cast<unsigned*>(o + n * 8 + t * 2) = fab_pack(acc[n][2 * i] * inv, acc[n][2 * i + 1] * inv, o);
  }
"""

# One key block of one key head a thread block: dK and dV summed over its query heads and query blocks in order.
_DKV_SOURCE = r"""
  constexpr int BC = KV_KEYS, BR = KV_ROWS, SK = DK + FAB_PAD, SV = DV + FAB_PAD;
  extern __shared__ __align__(16) unsigned char fab_smem[];
  T* sK = reinterpret_cast<T*>(fab_smem);
  T* sV = sK + BC * SK;
  T* sQ = sV + BC * SV;  // two query blocks (with their lse and delta): the one read and the next
  T* sO = sQ + 2 * BR * SK;
  float* sL = reinterpret_cast<float*>(sO + 2 * BR * SV);
  float* sD = sL + 2 * BR;
  int* sB = reinterpret_cast<int*>(sD + 2 * BR);  // the query blocks' key bounds, 3 a row
  const int H = q_shape[1], L = q_shape[2], KVH = k_shape[1], S = k_shape[2], G = H / KVH;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane >> 2, t = lane & 3;
  const int k0 = blockIdx.x * BC, h = blockIdx.y, kvh = h / G, b = blockIdx.z, offset = S - L;
  const size_t bkv = (size_t)b * KVH + kvh, bh = (size_t)b * H + h;
  const float sl = scale[0] * FAB_LOG2E;
  fab_load<T, DK>(sK, k + bkv * S * DK, k0, BC, S);
  fab_load<T, DV>(sV, v + bkv * S * DV, k0, BC, S);
  const int key[2] = {k0 + warp * 16 + g, k0 + warp * 16 + g + 8};
  const int qfirst = CAUSAL ? max(0, k0 - offset) / BR * BR : 0;
  float dk[DK / 8][4] = {}, dv[DV / 8][4] = {}, s[BR / 8][4], dp[BR / 8][4];
  const int blocks = (L - qfirst + BR - 1) / BR;
  auto copy_block = [&](int j) {
    const int q0 = qfirst + j * BR, buf = j & 1;
    fab_load_async<T, DK>(sQ + buf * BR * SK, q + bh * L * DK, q0, BR, L);
    fab_load_async<T, DV>(sO + buf * BR * SV, dout + bh * L * DV, q0, BR, L);
    if (threadIdx.x < BR) {
      int r = q0 + threadIdx.x;
      bool ok = r < L;
      fab_copy4(sL + buf * BR + threadIdx.x, lse + bh * L + (ok ? r : 0), ok ? 4 : 0);
      fab_copy4(sD + buf * BR + threadIdx.x, delta + bh * L + (ok ? r : 0), ok ? 4 : 0);
      for (int c = 0; c < 3; ++c)
        fab_copy4(sB + (buf * BR + threadIdx.x) * 3 + c, bounds + ((size_t)b * L + (ok ? r : 0)) * 3 + c, ok ? 4 : 0);
    }
    fab_commit();
  };
  if (blocks > 0) copy_block(0);
  for (int j = 0; j < blocks; ++j) {
    const int q0 = qfirst + j * BR, buf = j & 1;
    if (j + 1 < blocks) {
      copy_block(j + 1);
      fab_wait<1>();
    } else {
      fab_wait<0>();
    }
    __syncthreads();
    const T* cQ = sQ + buf * BR * SK;
    const T* cO = sO + buf * BR * SV;
    const float* cL = sL + buf * BR;
    const float* cD = sD + buf * BR;
    const int* cB = sB + buf * BR * 3;
    // A query block whose rows all start past this key block (packed rows: a later pair's) adds nothing.
    int lo = cB[3 * lane];
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) lo = min(lo, __shfl_xor_sync(0xffffffff, lo, o));
    if (lo > k0 + BC - 1) {
      __syncthreads();
      continue;
    }
    fab_scores<T, DK, BR>(s, sK + warp * 16 * SK, cQ);
    fab_scores<T, DV, BR>(dp, sV + warp * 16 * SV, cO);
#pragma unroll
    for (int n = 0; n < BR / 8; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        int c = n * 8 + t * 2 + (e & 1);
        bool ok = fab_sees<CAUSAL>(q0 + c, key[e >> 1], L, S, offset, cB[3 * c], cB[3 * c + 1], cB[3 * c + 2]);
        float p = ok ? exp2f(s[n][e] * sl - cL[c]) : 0.f;
        s[n][e] = p;
        dp[n][e] = p * (dp[n][e] - cD[c]);
      }
    fab_accumulate<T, DV, BR>(dv, s, cO);
    fab_accumulate<T, DK, BR>(dk, dp, cQ);
    __syncthreads();  // the next copy overwrites this block's buffers
  }
  const float sc = scale[0];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    if (key[i] >= S) continue;
    float* gk = dk_out + (bh * S + key[i]) * DK;
    float* ov = dv_out + (bh * S + key[i]) * DV;
#pragma unroll
    for (int n = 0; n < DK / 8; ++n)
      *reinterpret_cast<float2*>(gk + n * 8 + t * 2) = make_float2(dk[n][2 * i] * sc, dk[n][2 * i + 1] * sc);
#pragma unroll
    for (int n = 0; n < DV / 8; ++n)
      *reinterpret_cast<float2*>(ov + n * 8 + t * 2) = make_float2(dv[n][2 * i], dv[n][2 * i + 1]);
  }
"""


def _tiles_bytes(rows_a: int, rows_b: int, dk: int, dv: int, itemsize: int) -> int:
    return (rows_a + rows_b) * (dk + PAD + dv + PAD) * itemsize


@cache
def _kernels(dk: int, dv: int, itemsize: int) -> tuple:
    """The three kernels for head dims (dk, dv) (shared memory is fixed per kernel object)."""
    dq = mx.fast.cuda_kernel(
        name=f"orpo_flash_dq_{dk}_{dv}", input_names=["q", "k", "v", "dout", "delta", "bounds", "scale"],
        output_names=["dq", "lse_out"], source=_DQ_SOURCE, header=_HEADER,
        shared_memory=_tiles_bytes(DQ_ROWS, 2 * DQ_KEYS, dk, dv, itemsize))
    dkv = mx.fast.cuda_kernel(
        name=f"orpo_flash_dkv_{dk}_{dv}", input_names=["q", "k", "v", "dout", "delta", "lse", "bounds", "scale"],
        output_names=["dk_out", "dv_out"], source=_DKV_SOURCE, header=_HEADER,
        shared_memory=_tiles_bytes(KV_KEYS, 2 * KV_ROWS, dk, dv, itemsize) + (2 + 2 + 6) * KV_ROWS * 4)
    forward = mx.fast.cuda_kernel(
        name=f"orpo_flash_forward_{dk}_{dv}", input_names=["q", "k", "v", "bounds", "scale"],
        output_names=["out"], source=_FORWARD_SOURCE, header=_HEADER,
        shared_memory=(DQ_ROWS * (dk + PAD) + 2 * DQ_KEYS * (dk + PAD + dv + PAD)) * itemsize)
    return dq, dkv, forward


# Widest head dim the kernels take (measured up to 128; wider ones would hold their dK and dV sums in spilled
# registers).
MAX_HEAD_DIM = 128


def spans_fit(head_dim: int, dtype: mx.Dtype) -> bool:
    """Whether the kernels (CUDA only) take this head dim (padded to 16) and dtype."""
    return dtype in (mx.bfloat16, mx.float16) and -(-head_dim // 16) * 16 <= MAX_HEAD_DIM


def flash_fits(q: mx.array, k: mx.array, mask: object) -> bool:
    """Whether `flash_backward` takes this attention: `spans_fit` for the query/key head dim (the widest: values
    never carry the exclusion dims), k like q, no mask or a causal one whose keys are at least its queries."""
    return (on_cuda() and spans_fit(q.shape[-1], q.dtype) and k.dtype == q.dtype
            and (mask is None or (isinstance(mask, str) and mask == "causal" and k.shape[2] >= q.shape[2])))


def pad_head_dim(x: mx.array, to: int) -> mx.array:
    """x with zeros appended to its last axis up to `to`."""
    extra = to - x.shape[-1]
    return x if extra == 0 else mx.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, extra)])


def _launch(kernel: int, inputs: list[mx.array], causal: bool, blocks: int, output_shapes: list[tuple[int, ...]],
            output_dtypes: list[mx.Dtype]) -> list[mx.array]:
    """Kernel `kernel` of `_kernels` on `inputs` (q, k, v first, head dims multiples of 16), `blocks` thread blocks
    for each query head of each row."""
    q, v = inputs[0], inputs[2]
    b, h, _, dk = q.shape
    template = [("T", q.dtype), ("DK", dk), ("DV", v.shape[-1]), ("CAUSAL", causal), ("DQ_ROWS", DQ_ROWS),
                ("DQ_KEYS", DQ_KEYS), ("KV_KEYS", KV_KEYS), ("KV_ROWS", KV_ROWS)]
    return _kernels(dk, v.shape[-1], q.dtype.size)[kernel](
        inputs=inputs, template=template, grid=(blocks * THREADS, h, b), threadgroup=(THREADS, 1, 1),
        output_shapes=output_shapes, output_dtypes=output_dtypes)


def no_bounds(batch: int, length: int) -> mx.array:
    """Key bounds [B, L, 3] that hide nothing: plain causal (or unmasked) attention."""
    return mx.zeros((batch, length, 3), mx.int32)


def _padded(q: mx.array, k: mx.array, v: mx.array) -> tuple[mx.array, mx.array, mx.array]:
    """q, k, v with head dims zero-padded to multiples of 16 for the tensor-core products (zeros change no score)."""
    dk, dv = -(-q.shape[-1] // 16) * 16, -(-v.shape[-1] // 16) * 16
    return pad_head_dim(q, dk), pad_head_dim(k, dk), pad_head_dim(v, dv)


def dq_and_lse(q: mx.array, k: mx.array, v: mx.array, dout: mx.array, delta: mx.array, bounds: mx.array,
               scale: mx.array, causal: bool) -> tuple[mx.array, mx.array]:
    """The dQ kernel on head dims already multiples of 16: dq like q, and each row's log-sum-exp [B, H, L] (base
    2, of scale * log2(e) * scores) for `dk_and_dv`. `delta` [B, H, L] float32, `bounds` [B, L, 3] int32 (as
    `flash_forward` takes them), `scale` a float32 [1]."""
    b, h, length, _ = q.shape
    return _launch(0, [q, k, v, dout, delta, bounds, scale], causal, -(-length // DQ_ROWS),
                   [q.shape, (b, h, length)], [q.dtype, mx.float32])


def dk_and_dv(q: mx.array, k: mx.array, v: mx.array, dout: mx.array, delta: mx.array, lse: mx.array,
              bounds: mx.array, scale: mx.array, causal: bool) -> tuple[mx.array, mx.array]:
    """The dK/dV kernel, as `dq_and_lse` takes its arguments, given its `lse`: one thread block per key block and
    query head (float32 shares), a key head's shares then summed in head order."""
    b, kvh, keys, dk = k.shape
    h = q.shape[1]
    parts = _launch(1, [q, k, v, dout, delta, lse, bounds, scale], causal, -(-keys // KV_KEYS),
                    [(b, h, keys, dk), (b, h, keys, v.shape[-1])], [mx.float32, mx.float32])

    def summed(x: mx.array, dtype: mx.Dtype) -> mx.array:
        x = x.reshape(b, kvh, h // kvh, *x.shape[2:])
        total = x[:, :, 0]
        for i in range(1, x.shape[2]):
            total = total + x[:, :, i]
        return total.astype(dtype)

    return summed(parts[0], k.dtype), summed(parts[1], v.dtype)


def flash_forward(q: mx.array, k: mx.array, v: mx.array, scale: float, causal: bool, bounds: mx.array) -> mx.array:
    """Softmax attention of q [B, H, L, D] over k/v [B, kv heads, keys, D] (causal bottom-right aligned) in which
    query i of row b sees no key below bounds[b, i, 0] (packed rows: its pair's first token) and none of
    bounds[b, i, 1] .. bounds[b, i, 2] - 1 (prefix rows: rejected blind to chosen); `no_bounds` hides nothing.
    [B, H, L, D] like q."""
    qp, kp, vp = _padded(q, k, v)
    b, h, length, _ = qp.shape
    out = _launch(2, [qp, kp, vp, bounds, mx.array([scale], mx.float32)], causal, -(-length // DQ_ROWS),
                  [(b, h, length, vp.shape[-1])], [q.dtype])[0]
    return out[..., :v.shape[-1]]


def flash_backward(q: mx.array, k: mx.array, v: mx.array, scale: float, causal: bool, cotangent: mx.array,
                   delta: mx.array, bounds: mx.array | None = None) -> tuple[mx.array, mx.array, mx.array]:
    """dq, dk, dv of softmax attention (as `flash_forward` takes it; bounds None hides nothing) given the output's
    cotangent and delta = rowsum(dO * O) [B, H, L] in float32."""
    d, dvv = q.shape[-1], v.shape[-1]
    qp, kp, vp = _padded(q, k, v)
    dop = pad_head_dim(cotangent.astype(q.dtype), vp.shape[-1])
    bounds = no_bounds(q.shape[0], q.shape[2]) if bounds is None else bounds
    scale_arr = mx.array([scale], mx.float32)
    delta = delta.reshape(q.shape[:3]).astype(mx.float32)
    dq, lse = dq_and_lse(qp, kp, vp, dop, delta, bounds, scale_arr, causal)
    dk, dv = dk_and_dv(qp, kp, vp, dop, delta, lse, bounds, scale_arr, causal)
    return dq[..., :d], dk[..., :d], dv[..., :dvv]
