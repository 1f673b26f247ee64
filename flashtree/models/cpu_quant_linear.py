"""CPU products with few rows straight from a GGUF's quantized blocks (Q4_0, Q4_1, Q8_0).

A GGUF model is dequantized once to float32 (gguf_convert.py). On a CPU, a decode step then
streams every fp32 weight once per token and is bound by memory bandwidth. For products with
at most :data:`MAX_ROWS` rows (decode: one row per sequence; verification trees; drafter blocks;
batches of a few dozen sequences) this module multiplies from the GGUF blocks instead: 0.625 bytes per Q4_1 weight (0.56 for Q4_0,
1.06 for Q8_0) instead of 4. A small SIMD kernel rebuilds each weight in registers exactly
as the converter stored it and accumulates in float32:

- Q4_1: ``fma(d, q, m)``. ``d`` is an fp16 value and ``q`` a 4-bit integer, so ``d * q`` is
  exact in fp32 and the fma rounds once, like numpy's ``d * q + m``.
- Q4_0: ``fma(d, q, -8 d)`` = ``d * (q - 8)`` exactly (every term and the result are
  representable), as numpy's ``d * (q - 8)``.
- Q8_0: ``d * q``, exact.

so the weights are bit-identical to the fp32 ones (checked at load on a spread of rows of every
weight, in full by the tests); only the summation order differs from MKL's.
Each weight block is decoded once for up to 8 rows of a product (from L1 again for each further
group of 8), and a row's result does not depend on how many rows share the call. The kernel prefetches 4 KB ahead in the weight stream: the
separate per-layer products are too short for the hardware prefetcher alone (3x slower without).
Larger products (prefill, big trees) keep the fp32 weights (kept too: 538 MB for SmolLM2-135M).

The same library also holds the fused small ops of :mod:`cpu_kernels` (RMSNorm, rotary + KV
write, silu, short attention), and :func:`quantize_q8_0` rounds a drafter's weights to Q8_0 blocks.

The blocks come from ``gguf_blocks.safetensors``, which the GGUF conversion writes beside the
fp32 weights (and the first load of an older cache entry adds). The kernel is plain C++ (no
torch headers, so it compiles in about two seconds) built once with
the system compiler into ``$FLASHTREE_CACHE/kernels`` and called through ``ctypes``; its OpenMP
loop runs on the OpenMP runtime torch already loaded, with torch's thread count. It is built for
AVX-512 (avx512f, avx512bw, f16c, fma in /proc/cpuinfo) or else AVX2 (avx2, f16c, fma: the same
code on pairs of 8-float registers, :data:`ISA_BUILDS`) and used when a compiler works;
otherwise the fp32 path stays and one log line says why. ``EngineConfig(quant_kernels=False)``
/ ``--no-quant-kernels`` turns it off.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import json
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

import numpy as np
import torch

if TYPE_CHECKING:
    from flashtree.models.loader import Checkpoint
    from flashtree.models.transformer import CausalLM

log = logging.getLogger("flashtree")

MAX_ROWS = 32  # products with at most this many rows use the block kernel; more rows keep the fp32 weights
# (SmolLM2 forwards on a 2-core Xeon, benchmarks/README.md: 9 rows 30.5 vs 58.4 ms, 16 rows 36.9 vs 60.5,
# 24 rows 52.8 vs 66.2, 32 rows 72.8 vs 73.1 ms; the kernel's arithmetic per row is the same for every count)
CHECKED_ROWS = 64  # rows per weight compared with the fp32 weight at load
CXX_FLAGS = ("-O3", "-std=c++17", "-shared", "-fPIC", "-fopenmp", "-mf16c", "-mfma")
# instruction sets the kernel is built for, best first: (name, CPU flags it needs, compiler flags)
ISA_BUILDS = (("avx512", ("avx512f", "avx512bw", "f16c", "fma"), ("-mavx512f", "-mavx512bw")),
              ("avx2", ("avx2", "f16c", "fma"), ("-mavx2",)))

# type name -> (bytes per 32-weight block, kernel type code)
BLOCK_TYPES = {"Q4_0": (18, 0), "Q4_1": (20, 1), "Q8_0": (34, 2)}

KERNEL_SOURCE = r"""
// flashtree CPU block kernels: y[M, N] = x[M, K] @ W[N, K]^T (+ bias) with W in GGUF blocks.
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include <vector>

namespace {

// V16: 16 floats in one AVX-512 register, or in two AVX2 registers (same element order); only
// sums are associated differently (8 lanes instead of 16), so results differ by rounding alone.
#if defined(__AVX512F__)
struct V16 { __m512 v; };
inline V16 v_zero() { return {_mm512_setzero_ps()}; }
inline V16 v_set1(float a) { return {_mm512_set1_ps(a)}; }
inline V16 v_load(const float* p) { return {_mm512_loadu_ps(p)}; }
inline void v_store(float* p, V16 a) { _mm512_storeu_ps(p, a.v); }
inline V16 v_add(V16 a, V16 b) { return {_mm512_add_ps(a.v, b.v)}; }
inline V16 v_mul(V16 a, V16 b) { return {_mm512_mul_ps(a.v, b.v)}; }
inline V16 v_fmadd(V16 a, V16 b, V16 c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
inline float v_sum(V16 a) { return _mm512_reduce_add_ps(a.v); }
inline V16 v_from_i8(__m128i q) { return {_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q))}; }  // 16 int8
inline V16 v_from_u8(__m128i q) { return {_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(q))}; }  // 16 uint8
inline V16 v_fnmadd(V16 a, V16 b, V16 c) { return {_mm512_fnmadd_ps(a.v, b.v, c.v)}; }  // c - a * b
inline V16 v_clamp(V16 a, float lo, float hi) {
  return {_mm512_min_ps(_mm512_max_ps(a.v, _mm512_set1_ps(lo)), _mm512_set1_ps(hi))};
}
inline V16 v_round(V16 a) { return {_mm512_roundscale_ps(a.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)}; }
inline V16 v_times_pow2(V16 a, V16 n) { return {_mm512_scalef_ps(a.v, n.v)}; }  // a * 2^n, n integral
inline V16 v_div(V16 a, V16 b) { return {_mm512_div_ps(a.v, b.v)}; }
#else
struct V16 { __m256 lo, hi; };
inline V16 v_zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline V16 v_set1(float a) { return {_mm256_set1_ps(a), _mm256_set1_ps(a)}; }
inline V16 v_load(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline void v_store(float* p, V16 a) { _mm256_storeu_ps(p, a.lo); _mm256_storeu_ps(p + 8, a.hi); }
inline V16 v_add(V16 a, V16 b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
inline V16 v_mul(V16 a, V16 b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
inline V16 v_fmadd(V16 a, V16 b, V16 c) { return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)}; }
inline float v_sum(V16 a) {
  const __m256 s = _mm256_add_ps(a.lo, a.hi);
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  return _mm_cvtss_f32(_mm_add_ss(x, _mm_movehdup_ps(x)));
}
inline V16 v_from_i8(__m128i q) {
  return {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(q, 8)))};
}
inline V16 v_from_u8(__m128i q) {
  return {_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(q)), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(q, 8)))};
}
inline V16 v_fnmadd(V16 a, V16 b, V16 c) {  // c - a * b
  return {_mm256_fnmadd_ps(a.lo, b.lo, c.lo), _mm256_fnmadd_ps(a.hi, b.hi, c.hi)};
}
inline __m256 clamp8(__m256 a, float lo, float hi) {
  return _mm256_min_ps(_mm256_max_ps(a, _mm256_set1_ps(lo)), _mm256_set1_ps(hi));
}
inline V16 v_clamp(V16 a, float lo, float hi) { return {clamp8(a.lo, lo, hi), clamp8(a.hi, lo, hi)}; }
inline __m256 round8(__m256 a) { return _mm256_round_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline V16 v_round(V16 a) { return {round8(a.lo), round8(a.hi)}; }
inline __m256 pow2_8(__m256 n) {  // 2^n for integral n in [-126, 127], through the exponent bits
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
}
inline V16 v_times_pow2(V16 a, V16 n) { return {_mm256_mul_ps(a.lo, pow2_8(n.lo)), _mm256_mul_ps(a.hi, pow2_8(n.hi))}; }
inline V16 v_div(V16 a, V16 b) { return {_mm256_div_ps(a.lo, b.lo), _mm256_div_ps(a.hi, b.hi)}; }
#endif

// exp(x) for x in [-87.3, 88.3] (clamped there): the Cephes polynomial of r = x - n ln 2, times 2^n
inline V16 v_exp(V16 x) {
  x = v_clamp(x, -87.3f, 88.3f);
  const V16 n = v_round(v_mul(x, v_set1(1.44269504088896341f)));
  V16 r = v_fnmadd(n, v_set1(0.693359375f), x);
  r = v_fnmadd(n, v_set1(-2.12194440e-4f), r);
  V16 p = v_set1(1.9875691500e-4f);
  for (const float c : {1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f})
    p = v_fmadd(p, r, v_set1(c));
  p = v_add(v_fmadd(p, v_mul(r, r), r), v_set1(1.0f));
  return v_times_pow2(p, n);
}

inline float half_to_float(const uint8_t* p) {
  uint16_t h;
  memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

// One 32-weight block as two vectors of 16 weights (elements 0..15 and 16..31).
// type 0: Q4_0 {fp16 d; u8 qs[16]}     w = d * (q - 8)  computed as fma(d, q, -8 d), exact
// type 1: Q4_1 {fp16 d, m; u8 qs[16]}  w = fma(d, q, m) (d * q exact: one rounding, like d*q + m)
// type 2: Q8_0 {fp16 d; i8 qs[32]}     w = d * q, exact
template <int TYPE>
inline void decode(const uint8_t* block, V16& w0, V16& w1) {
  const V16 d = v_set1(half_to_float(block));
  if (TYPE == 2) {
    const __m128i* q = (const __m128i*)(block + 2);
    w0 = v_mul(d, v_from_i8(_mm_loadu_si128(q)));
    w1 = v_mul(d, v_from_i8(_mm_loadu_si128(q + 1)));
  } else {
    const V16 m = TYPE == 1 ? v_set1(half_to_float(block + 2)) : v_mul(d, v_set1(-8.0f));
    const __m128i v = _mm_loadu_si128((const __m128i*)(block + (TYPE == 1 ? 4 : 2)));
    const __m128i low4 = _mm_set1_epi8(0x0F);
    w0 = v_fmadd(d, v_from_u8(_mm_and_si128(v, low4)), m);
    w1 = v_fmadd(d, v_from_u8(_mm_and_si128(_mm_srli_epi16(v, 4), low4)), m);
  }
}

constexpr int64_t block_bytes(int type) { return type == 0 ? 18 : type == 1 ? 20 : 34; }

#ifndef PREFETCH_BYTES
#define PREFETCH_BYTES 4096
#endif

// Accumulators per row: AVX-512's 32 registers hold two (independent FMA chains); AVX2's 16 would
// spill them from 3 rows on (a V16 is two registers), so it keeps one. The same for every row count,
// so a row's result never depends on how many rows share the call.
#if defined(__AVX512F__)
constexpr bool ONE_ACCUMULATOR = false;
#else
constexpr bool ONE_ACCUMULATOR = true;
#endif

constexpr int ROW_GROUP = 8;  // rows of x whose accumulators share the registers while the weights stream
constexpr int COLUMN_TILE = 4;  // weight rows (output columns) a task takes at once

// Output columns worked on together by a group of M rows: one column's chain of FMAs is latency-bound
// when few rows share it, so small groups interleave the independent chains of several columns
// (as many as the registers hold: accumulators, decoded weights and the x vectors).
#if defined(__AVX512F__)
template <int M> constexpr int columns_for() { return M <= 2 ? 4 : M <= 4 ? 2 : 1; }
#else
template <int M> constexpr int columns_for() { return M == 1 ? 2 : 1; }
#endif

// y[r * N + c] = x[r] . W[c] + add[c] for the M <= ROW_GROUP rows of x and the C consecutive weight
// rows at w (output columns c < C). Each (row, column) pair is its own chain of FMAs over the
// blocks in order: the same arithmetic whatever M and C are.
template <int TYPE, int M, int C>
inline void dot_rows(const float* x, const uint8_t* w, int64_t row_bytes, int64_t blocks, int64_t K,
                     const float* add, float* y, int64_t N) {
  V16 acc0[C][M], acc1[C][M];
  for (int c = 0; c < C; ++c)
    for (int r = 0; r < M; ++r) acc0[c][r] = acc1[c][r] = v_zero();
  for (int64_t b = 0; b < blocks; ++b) {
    V16 w0[C], w1[C];
    for (int c = 0; c < C; ++c) {
      const uint8_t* block = w + c * row_bytes + b * block_bytes(TYPE);
      _mm_prefetch((const char*)(block + PREFETCH_BYTES), _MM_HINT_T0);
      decode<TYPE>(block, w0[c], w1[c]);
    }
    for (int r = 0; r < M; ++r) {
      const float* xr = x + r * K + b * 32;
      const V16 x0 = v_load(xr), x1 = v_load(xr + 16);
      for (int c = 0; c < C; ++c) {
        if (ONE_ACCUMULATOR) {
          acc0[c][r] = v_fmadd(w1[c], x1, v_fmadd(w0[c], x0, acc0[c][r]));
        } else {
          acc0[c][r] = v_fmadd(w0[c], x0, acc0[c][r]);
          acc1[c][r] = v_fmadd(w1[c], x1, acc1[c][r]);
        }
      }
    }
  }
  for (int c = 0; c < C; ++c)
    for (int r = 0; r < M; ++r)
      y[r * N + c] = v_sum(ONE_ACCUMULATOR ? acc0[c][r] : v_add(acc0[c][r], acc1[c][r])) + add[c];
}

// `cols` <= COLUMN_TILE consecutive columns for M rows: in steps of columns_for<M>(), then one by one.
template <int TYPE, int M>
inline void tile_columns(const float* x, const uint8_t* w, int64_t row_bytes, int64_t blocks, int64_t K,
                         const float* add, float* y, int64_t N, int cols) {
  constexpr int C = columns_for<M>();
  int c = 0;
  for (; c + C <= cols; c += C) dot_rows<TYPE, M, C>(x, w + c * row_bytes, row_bytes, blocks, K, add + c, y + c, N);
  for (; c < cols; ++c) dot_rows<TYPE, M, 1>(x, w + c * row_bytes, row_bytes, blocks, K, add + c, y + c, N);
}

template <int TYPE>
inline void tile_group(int m, const float* x, const uint8_t* w, int64_t row_bytes, int64_t blocks, int64_t K,
                       const float* add, float* y, int64_t N, int cols) {
  switch (m) {
    case 1: tile_columns<TYPE, 1>(x, w, row_bytes, blocks, K, add, y, N, cols); return;
    case 2: tile_columns<TYPE, 2>(x, w, row_bytes, blocks, K, add, y, N, cols); return;
    case 3: tile_columns<TYPE, 3>(x, w, row_bytes, blocks, K, add, y, N, cols); return;
    case 4: tile_columns<TYPE, 4>(x, w, row_bytes, blocks, K, add, y, N, cols); return;
    case 5: tile_columns<TYPE, 5>(x, w, row_bytes, blocks, K, add, y, N, cols); return;
    case 6: tile_columns<TYPE, 6>(x, w, row_bytes, blocks, K, add, y, N, cols); return;
    case 7: tile_columns<TYPE, 7>(x, w, row_bytes, blocks, K, add, y, N, cols); return;
    default: tile_columns<TYPE, 8>(x, w, row_bytes, blocks, K, add, y, N, cols); return;
  }
}

// Tasks of COLUMN_TILE weight rows; within a task the rows of x go in groups of ROW_GROUP, so the
// weights are read from memory once and decoded again from L1 for each further group. A row's
// result never depends on how many rows share the call.
template <int TYPE>
int gemm_rows(const float* x, const uint8_t* w, const float* bias, float* y, int64_t M, int64_t N, int64_t K,
              int threads) {
  if (M < 1) return 1;
  const int64_t blocks = K / 32, row_bytes = blocks * block_bytes(TYPE);
  const int64_t tiles = (N + COLUMN_TILE - 1) / COLUMN_TILE;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && N >= 64)
  for (int64_t t = 0; t < tiles; ++t) {
    const int64_t n = t * COLUMN_TILE;
    const int cols = (int)(N - n < COLUMN_TILE ? N - n : COLUMN_TILE);
    float add[COLUMN_TILE] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (int c = 0; bias && c < cols; ++c) add[c] = bias[n + c];
    for (int64_t r0 = 0; r0 < M; r0 += ROW_GROUP) {
      const int m = (int)(M - r0 < ROW_GROUP ? M - r0 : ROW_GROUP);
      tile_group<TYPE>(m, x + r0 * K, w + n * row_bytes, row_bytes, blocks, K, add, y + r0 * N + n, N, cols);
    }
  }
  return 0;
}

template <int TYPE>
void dequantize(const uint8_t* w, float* out, int64_t N, int64_t K, int threads) {
  const int64_t blocks = K / 32, row_bytes = blocks * block_bytes(TYPE);
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && N >= 64)
  for (int64_t n = 0; n < N; ++n)
    for (int64_t b = 0; b < blocks; ++b) {
      V16 w0, w1;
      decode<TYPE>(w + n * row_bytes + b * block_bytes(TYPE), w0, w1);
      v_store(out + n * K + b * 32, w0);
      v_store(out + n * K + b * 32 + 16, w1);
    }
}

// ---- fused small ops of a decoder layer (fp32, rows = tokens); see cpu_kernels.py
inline float dot_product(const float* a, const float* b, int64_t n) {
  int64_t d = 0;
  V16 acc = v_zero();
  for (; d + 16 <= n; d += 16) acc = v_fmadd(v_load(a + d), v_load(b + d), acc);
  float sum = v_sum(acc);
  for (; d < n; ++d) sum += a[d] * b[d];
  return sum;
}

inline float inv_rms(const float* x, int64_t width, float eps) {
  float sum = 0.0f;
  for (int64_t j = 0; j < width; ++j) sum += x[j] * x[j];
  return 1.0f / sqrtf(sum / (float)width + eps);
}

}  // namespace

extern "C" {

// sum = x + residual; out = sum * rsqrt(mean(sum^2) + eps) * weight, per row of width values.
void flashtree_add_rms_norm(const float* x, const float* residual, const float* weight, float* sum, float* out,
                            int64_t rows, int64_t width, float eps) {
  for (int64_t i = 0; i < rows; ++i) {
    const float *xi = x + i * width, *ri = residual + i * width;
    float *si = sum + i * width, *oi = out + i * width;
    for (int64_t j = 0; j < width; ++j) si[j] = xi[j] + ri[j];
    const float scale = inv_rms(si, width, eps);
    for (int64_t j = 0; j < width; ++j) oi[j] = si[j] * scale * weight[j];
  }
}

// out[i, j] = silu(gate_up[i, j]) * gate_up[i, width + j]
void flashtree_silu_mul(const float* gate_up, float* out, int64_t rows, int64_t width) {
  for (int64_t i = 0; i < rows; ++i) {
    const float *g = gate_up + i * 2 * width, *u = g + width;
    float* o = out + i * width;
    int64_t j = 0;
    for (; j + 16 <= width; j += 16) {
      const V16 gj = v_load(g + j);
      const V16 sig = v_div(gj, v_add(v_set1(1.0f), v_exp(v_mul(v_set1(-1.0f), gj))));
      v_store(o + j, v_mul(sig, v_load(u + j)));
    }
    for (; j < width; ++j) o[j] = g[j] / (1.0f + expf(-g[j])) * u[j];
  }
}

// Per token t (= b * new_tokens + n) of qkv [T, (H + 2 KVH) * D]: q/k heads get the optional
// RMSNorm (qk_norm [2, D]: q's weight, then k's) and rotary (rotate-half) at positions[t] from the
// [P, D] cos/sin tables; q goes to q_out [B, H, N, D]; k and v go to the cache views at
// (slots[t], head, entries[t]) with the given element strides.
void flashtree_qkv_rope_write(const float* qkv, const float* qk_norm, const float* cos_table, const float* sin_table,
                              const int64_t* positions, const int64_t* slots, const int64_t* entries, float* q_out,
                              float* k_cache, float* v_cache, int64_t tokens, int64_t new_tokens, int64_t heads,
                              int64_t kv_heads, int64_t head_dim, float eps, int64_t slot_stride,
                              int64_t head_stride, int64_t pos_stride) {
  const int64_t half = head_dim / 2, width = (heads + 2 * kv_heads) * head_dim;
  float normed[1024];
  for (int64_t t = 0; t < tokens; ++t) {
    const float* row = qkv + t * width;
    const float *c = cos_table + positions[t] * head_dim, *s = sin_table + positions[t] * head_dim;
    const int64_t b = t / new_tokens, n = t % new_tokens;
    for (int64_t h = 0; h < heads + kv_heads; ++h) {
      const float* x = row + h * head_dim;
      if (qk_norm) {
        const float* w = qk_norm + (h < heads ? 0 : head_dim);
        const float scale = inv_rms(x, head_dim, eps);
        for (int64_t j = 0; j < head_dim; ++j) normed[j] = x[j] * scale * w[j];
        x = normed;
      }
      float* dst = h < heads ? q_out + ((b * heads + h) * new_tokens + n) * head_dim
                             : k_cache + slots[t] * slot_stride + (h - heads) * head_stride + entries[t] * pos_stride;
      for (int64_t j = 0; j < half; ++j) {
        const float lo = x[j], hi = x[j + half];
        dst[j] = lo * c[j] - hi * s[j];
        dst[j + half] = hi * c[j + half] + lo * s[j + half];
      }
    }
    for (int64_t h = 0; h < kv_heads; ++h) {
      const float* v = row + (heads + kv_heads + h) * head_dim;
      float* dst = v_cache + slots[t] * slot_stride + h * head_stride + entries[t] * pos_stride;
      memcpy(dst, v, head_dim * sizeof(float));
    }
  }
}

// Attention of each row's N new tokens over its cache entries 0 .. lengths[b] + N - 1 (committed
// context, then the new tokens' own entries): query i sees every committed entry (the last
// `window` ones when window > 0) and new token t where new_mask[b, i, t]. q, out: [B, H, N, D].
// One task per (row, head) on `threads` threads; a task reads each key and value once for all N
// queries, and every query's sums run over the keys in the same order as in a one-query call, so a
// query's result never depends on how many queries share the call.
void flashtree_tree_attention(const float* q, const float* k_cache, const float* v_cache, const int64_t* slots,
                              const int64_t* lengths, const uint8_t* new_mask, float* out, int64_t rows,
                              int64_t new_tokens, int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t window,
                              float scale, int64_t slot_stride, int64_t head_stride, int64_t pos_stride,
                              int threads) {
  const int64_t group = heads / kv_heads, n = new_tokens;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && rows * heads > 1)
  for (int64_t task = 0; task < rows * heads; ++task) {
    const int64_t b = task / heads, h = task % heads;
    const int64_t committed = lengths[b], total = committed + n;
    const int64_t oldest = window > 0 && committed > window ? committed - window : 0;
    const float* keys = k_cache + slots[b] * slot_stride + (h / group) * head_stride;
    const float* values = v_cache + slots[b] * slot_stride + (h / group) * head_stride;
    const float* qh = q + (b * heads + h) * n * head_dim;
    float* oh = out + (b * heads + h) * n * head_dim;
    const uint8_t* sees = new_mask + b * n * n;
    std::vector<float> scores(n * total), top(n, -INFINITY), sums(n, 0.0f);
    for (int64_t j = oldest; j < total; ++j) {
      const float* kj = keys + j * pos_stride;
      for (int64_t i = 0; i < n; ++i) {
        float s = -INFINITY;
        if (j < committed || sees[i * n + (j - committed)]) s = dot_product(qh + i * head_dim, kj, head_dim) * scale;
        scores[i * total + j] = s;
        top[i] = s > top[i] ? s : top[i];
      }
    }
    for (int64_t i = 0; i < n; ++i) {  // scores -> exp(score - top), 0 for keys the query does not see
      float* si = scores.data() + i * total;
      int64_t j = oldest;
      for (; j + 16 <= total; j += 16) {
        float e[16];
        v_store(e, v_exp(v_add(v_load(si + j), v_set1(-top[i]))));
        for (int t = 0; t < 16; ++t) si[j + t] = si[j + t] == -INFINITY ? 0.0f : e[t];
      }
      for (; j < total; ++j) {
        float e[16];
        v_store(e, v_exp(v_set1(si[j] - top[i])));
        si[j] = si[j] == -INFINITY ? 0.0f : e[0];
      }
    }
    for (int64_t d = 0; d < n * head_dim; ++d) oh[d] = 0.0f;
    for (int64_t j = oldest; j < total; ++j) {
      const float* vj = values + j * pos_stride;
      for (int64_t i = 0; i < n; ++i) {
        const float p = scores[i * total + j];
        if (p == 0.0f) continue;
        sums[i] += p;
        float* oi = oh + i * head_dim;
        const V16 pv = v_set1(p);
        int64_t d = 0;
        for (; d + 16 <= head_dim; d += 16) v_store(oi + d, v_fmadd(pv, v_load(vj + d), v_load(oi + d)));
        for (; d < head_dim; ++d) oi[d] = fmaf(p, vj[d], oi[d]);
      }
    }
    for (int64_t i = 0; i < n; ++i) {
      const float inv = sums[i] > 0.0f ? 1.0f / sums[i] : 0.0f;
      for (int64_t d = 0; d < head_dim; ++d) oh[i * head_dim + d] *= inv;
    }
  }
}

// Returns 0 on success, 1 for an unsupported type or row count.
int flashtree_block_gemm(int type, const float* x, const uint8_t* w, const float* bias, float* y, int64_t M,
                         int64_t N, int64_t K, int threads) {
  if (K % 32 != 0) return 1;
  switch (type) {
    case 0: return gemm_rows<0>(x, w, bias, y, M, N, K, threads);
    case 1: return gemm_rows<1>(x, w, bias, y, M, N, K, threads);
    case 2: return gemm_rows<2>(x, w, bias, y, M, N, K, threads);
  }
  return 1;
}

int flashtree_block_dequantize(int type, const uint8_t* w, float* out, int64_t N, int64_t K, int threads) {
  if (K % 32 != 0) return 1;
  switch (type) {
    case 0: dequantize<0>(w, out, N, K, threads); return 0;
    case 1: dequantize<1>(w, out, N, K, threads); return 0;
    case 2: dequantize<2>(w, out, N, K, threads); return 0;
  }
  return 1;
}

}
"""


class KernelUnavailable(RuntimeError):
    """Why the block kernel cannot run here (the fp32 path is used instead)."""


# ----------------------------------------------------------------------------- build and load

def cpu_flags() -> set[str]:
    """The CPU feature flags of /proc/cpuinfo (empty where there is none)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def find_compiler() -> str | None:
    for candidate in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if candidate and shutil.which(candidate):
            return shutil.which(candidate)
    return None


def kernel_cache_dir() -> Path:
    from flashtree.models.gguf_convert import default_cache_root

    return default_cache_root() / "kernels"


@functools.lru_cache(maxsize=None)
def load_kernels() -> ctypes.CDLL:
    """The compiled kernel library, built on first use and cached by source, flags and compiler.
    Raises :class:`KernelUnavailable` with the reason when it cannot be used here."""
    isa_flags = isa_compiler_flags(cpu_flags())
    compiler = find_compiler()
    if compiler is None:
        raise KernelUnavailable("no C++ compiler found (set CXX or install g++)")
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as err:
        raise KernelUnavailable(f"{compiler} does not run ({err})") from None
    flags = (*CXX_FLAGS, *isa_flags)
    key = hashlib.sha256("\0".join([KERNEL_SOURCE, *flags, compiler, version]).encode()).hexdigest()[:16]
    library = kernel_cache_dir() / f"flashtree_block_kernels-{key}.so"
    if not library.is_file():
        build_library(compiler, library, flags)
    lib = ctypes.CDLL(str(library))
    lib.flashtree_block_gemm.restype = ctypes.c_int
    lib.flashtree_block_gemm.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                                         ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                                         ctypes.c_int]
    lib.flashtree_block_dequantize.restype = ctypes.c_int
    lib.flashtree_block_dequantize.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                                               ctypes.c_int64, ctypes.c_int]
    ptr, i64 = ctypes.c_void_p, ctypes.c_int64  # the fused small ops (cpu_kernels.py)
    lib.flashtree_add_rms_norm.restype = lib.flashtree_silu_mul.restype = None
    lib.flashtree_add_rms_norm.argtypes = [ptr] * 5 + [i64, i64, ctypes.c_float]
    lib.flashtree_silu_mul.argtypes = [ptr, ptr, i64, i64]
    lib.flashtree_qkv_rope_write.restype = lib.flashtree_tree_attention.restype = None
    lib.flashtree_qkv_rope_write.argtypes = [ptr] * 10 + [i64] * 5 + [ctypes.c_float] + [i64] * 3
    lib.flashtree_tree_attention.argtypes = [ptr] * 7 + [i64] * 6 + [ctypes.c_float] + [i64] * 3 + [ctypes.c_int]
    return lib


def isa_compiler_flags(available: set[str]) -> tuple[str, ...]:
    """Compiler flags of the best instruction set in :data:`ISA_BUILDS` this CPU has (AVX-512, else
    AVX2); raises :class:`KernelUnavailable` naming what is missing when it has neither."""
    for _name, needed, flags in ISA_BUILDS:
        if all(flag in available for flag in needed):
            return flags
    missing = sorted(set(ISA_BUILDS[-1][1]) - available)  # what the least demanding build lacks
    raise KernelUnavailable(f"this CPU lacks {', '.join(missing)} (the kernel needs AVX-512 or AVX2 with F16C and FMA)")


def build_library(compiler: str, library: Path, flags: Sequence[str]) -> None:
    """Compile into a private temporary file and rename it into place (concurrent builds are safe)."""
    library.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".build-", dir=library.parent) as tmp:
        source, output = Path(tmp) / "kernels.cpp", Path(tmp) / library.name
        source.write_text(KERNEL_SOURCE)
        try:
            result = subprocess.run([compiler, *flags, str(source), "-o", str(output)],
                                    capture_output=True, text=True, timeout=300)
        except (OSError, subprocess.SubprocessError) as err:
            raise KernelUnavailable(f"{compiler} failed to run ({err})") from None
        if result.returncode != 0:
            detail = (result.stderr or result.stdout).strip().splitlines()
            raise KernelUnavailable(f"{compiler} could not build the kernel: {detail[0] if detail else result.returncode}")
        os.replace(output, library)


def kernels_available() -> tuple[bool, str]:
    """(True, "") when the kernel is usable here, else (False, why)."""
    try:
        load_kernels()
    except (KernelUnavailable, OSError) as err:
        return False, str(err)
    return True, ""


# ----------------------------------------------------------------------------- the weight holder

class QuantizedLinear:
    """One linear weight ``[N, K]`` kept as GGUF blocks (rows of ``K / 32`` blocks, raw bytes).

    Call it with a float32 CPU ``x [..., K]`` of at most :data:`MAX_ROWS` rows (and a contiguous
    float32 ``bias [N]`` or None); :func:`linear` picks it or the fp32 weight by the row count."""

    def __init__(self, type_name: str, blocks: torch.Tensor, in_features: int):
        if type_name not in BLOCK_TYPES:
            raise ValueError(f"unsupported block type {type_name!r}; allowed: {', '.join(BLOCK_TYPES)}")
        block_bytes, self.type_code = BLOCK_TYPES[type_name]
        if in_features % 32 or blocks.dtype != torch.uint8 or blocks.dim() != 2 \
                or blocks.shape[1] != in_features // 32 * block_bytes:
            raise ValueError(f"{type_name} blocks of shape {list(blocks.shape)} do not hold rows of {in_features}")
        self.type_name = type_name
        self.blocks = blocks.contiguous()
        self.out_features, self.in_features = blocks.shape[0], in_features
        self._lib = load_kernels()
        self._gemm = self._lib.flashtree_block_gemm
        self._blocks_ptr = self.blocks.data_ptr()

    @classmethod
    def concat(cls, parts: Sequence["QuantizedLinear"]) -> "QuantizedLinear":
        """The fused weight (rows of every part, in order); all parts share one type and K."""
        first = parts[0]
        if any(p.type_name != first.type_name or p.in_features != first.in_features for p in parts):
            raise ValueError("fused weights need one block type and one input size")
        return cls(first.type_name, torch.cat([p.blocks for p in parts]), first.in_features)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        x = x.contiguous()
        rows = x.numel() // self.in_features
        y = torch.empty(*x.shape[:-1], self.out_features, dtype=torch.float32)
        if rows == 0:
            return y
        status = self._gemm(self.type_code, x.data_ptr(), self._blocks_ptr,
                            None if bias is None else bias.data_ptr(), y.data_ptr(), rows,
                            self.out_features, self.in_features, torch.get_num_threads())
        if status:
            raise ValueError(f"block kernel refused {rows} rows of {self.in_features} ({self.type_name})")
        return y

    def dequantize(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """The fp32 weight ``[N, K]`` (or its ``rows``) rebuilt by the kernel's own block decoding."""
        blocks = self.blocks if rows is None else self.blocks.index_select(0, rows).contiguous()
        out = torch.empty(blocks.shape[0], self.in_features, dtype=torch.float32)
        self._lib.flashtree_block_dequantize(self.type_code, blocks.data_ptr(), out.data_ptr(),
                                             blocks.shape[0], self.in_features, torch.get_num_threads())
        return out


def quantize_q8_0(weight: torch.Tensor) -> QuantizedLinear:
    """Q8_0 blocks of an fp32 weight ``[N, K]`` (K a multiple of 32), as GGUF writes them: per 32
    weights an fp16 scale ``d = max|w| / 127`` and ``q = round(w / d)``. Lossy (about 0.4% of a
    block's largest weight at most): for drafters, whose outputs are only proposals."""
    rows, k = weight.shape
    if k % 32:
        raise ValueError(f"Q8_0 needs rows of a multiple of 32 weights, got {k}")
    blocks = weight.detach().float().reshape(rows, k // 32, 32)  # [N, B, 32]
    scale = (blocks.abs().amax(dim=-1) / 127).half()  # [N, B]
    inverse = torch.where(scale > 0, 1.0 / scale.float(), torch.zeros_like(scale, dtype=torch.float32))
    quants = torch.round(blocks * inverse[..., None]).clamp(-127, 127).to(torch.int8)  # [N, B, 32]
    packed = torch.cat([scale.view(torch.uint8).reshape(rows, k // 32, 2), quants.view(torch.uint8)], dim=-1)
    return QuantizedLinear("Q8_0", packed.reshape(rows, -1), k)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           quant: QuantizedLinear | None = None) -> torch.Tensor:
    """``F.linear`` that takes products with few rows from the blocks when ``quant`` is set."""
    if quant is not None and x.numel() <= MAX_ROWS * quant.in_features:
        return quant(x, bias)
    return torch.nn.functional.linear(x, weight, bias)


# ----------------------------------------------------------------------------- GGUF -> holders

BLOCKS_FILE = "gguf_blocks.safetensors"  # beside model.safetensors in the conversion cache


def gguf_blocks(reader, architecture: str, heads: int, kv_heads: int) -> dict[str, tuple[str, np.ndarray]]:
    """Every Q4_0 / Q4_1 / Q8_0 matrix of an open GGUF file: GGUF name -> (type name, raw blocks
    ``uint8 [rows, K / 32 * block bytes]``), the q/k rows un-permuted like the converter does
    (whole blocks move with their rows)."""
    from flashtree.models.gguf_convert import unpermute_for_hf

    found = {}
    for tensor in reader.tensors:
        type_name = tensor.tensor_type.name
        if type_name not in BLOCK_TYPES or len(tensor.shape) != 2:
            continue
        rows = int(tensor.shape[1])  # GGUF lists the fastest dimension first
        raw = np.asarray(tensor.data, dtype=np.uint8).reshape(rows, -1)
        raw = unpermute_for_hf(tensor.name, raw, architecture, heads, kv_heads)
        found[tensor.name] = (type_name, np.array(raw, order="C"))  # a copy: the reader's memmap is read-only
    return found


def save_blocks(blocks: dict[str, tuple[str, np.ndarray]], out_dir: Path, source: dict) -> None:
    """Write ``blocks`` to ``out_dir/gguf_blocks.safetensors`` (atomically), tagged with the source
    record so a file converted from another GGUF is never used."""
    import safetensors.numpy

    metadata = {"types": json.dumps({name: t for name, (t, _) in blocks.items()}),
                "source": json.dumps(_source_key(source))}
    tmp = out_dir / f".{BLOCKS_FILE}.{os.getpid()}.tmp"
    safetensors.numpy.save_file({name: raw for name, (_, raw) in blocks.items()}, str(tmp), metadata=metadata)
    os.replace(tmp, out_dir / BLOCKS_FILE)


def _source_key(source: dict) -> list:
    return [source.get("path"), source.get("size"), source.get("mtime_ns")]


def load_blocks(model_dir: Path, source: dict, architecture: str, heads: int, kv_heads: int) -> dict[str, QuantizedLinear]:
    """The holders of a converted GGUF: from ``gguf_blocks.safetensors`` in its cache directory,
    written from the GGUF itself (and kept for next time) when missing or stale."""
    import safetensors

    path = model_dir / BLOCKS_FILE
    found = None
    if path.is_file():
        try:
            with safetensors.safe_open(str(path), framework="pt") as f:
                metadata = f.metadata() or {}
                if json.loads(metadata.get("source", "null")) == _source_key(source):
                    types = json.loads(metadata["types"])
                    found = {name: (types[name], f.get_tensor(name)) for name in f.keys()}
        except (OSError, ValueError, KeyError, safetensors.SafetensorError):
            found = None
    if found is None:
        import gguf

        gguf_path = Path(source["path"])
        if not gguf_path.is_file() or gguf_path.stat().st_size != source.get("size") \
                or gguf_path.stat().st_mtime_ns != source.get("mtime_ns"):
            raise KernelUnavailable(f"{gguf_path} changed or is gone since it was converted")
        raw = gguf_blocks(gguf.GGUFReader(str(gguf_path)), architecture, heads, kv_heads)
        try:
            save_blocks(raw, model_dir, source)
        except OSError as err:  # a read-only cache: fine, read the GGUF again next time
            log.info("flashtree: cannot cache the GGUF blocks in %s: %s", model_dir, err)
        found = {name: (t, torch.from_numpy(array)) for name, (t, array) in raw.items()}
    holders = {}
    for name, (type_name, blocks) in found.items():
        block_bytes = BLOCK_TYPES[type_name][0]
        holders[name] = QuantizedLinear(type_name, blocks, blocks.shape[1] // block_bytes * 32)
    return holders


def _fused(blocks: dict[str, QuantizedLinear], names: Sequence[str]) -> QuantizedLinear | None:
    if not all(name in blocks for name in names):
        return None
    parts = [blocks[name] for name in names]
    if len({(p.type_name, p.in_features) for p in parts}) != 1:
        return None
    return parts[0] if len(parts) == 1 else QuantizedLinear.concat(parts)


def attach_quantized(model: "CausalLM", blocks: dict[str, QuantizedLinear]) -> int:
    """Give ``model``'s linears their GGUF blocks (by GGUF name; fused like the model: qkv,
    gate_up; the lm_head from ``output`` or, tied, ``token_embd``). Every holder is checked
    bit-identical to the fp32 weight it stands for (on a spread of rows: a wrong type, layout or row
    order shows in every row; the tests compare whole weights). Returns the number of weights attached;
    raises KernelUnavailable."""
    cfg = model.config
    plan = []
    for i, layer in enumerate(model.model.layers):
        attn, mlp, p = layer.self_attn, layer.mlp, f"blk.{i}."
        plan += [
            (attn, "qkv_quant", attn.qkv_weight, [p + "attn_q.weight", p + "attn_k.weight", p + "attn_v.weight"]),
            (attn, "o_quant", attn.o_proj.weight, [p + "attn_output.weight"]),
            (mlp, "gate_up_quant", mlp.gate_up, [p + "ffn_gate.weight", p + "ffn_up.weight"]),
            (mlp, "down_quant", mlp.down_proj.weight, [p + "ffn_down.weight"]),
        ]
    head = "token_embd.weight" if cfg.tie_word_embeddings else "output.weight"
    plan.append((model, "lm_head_quant", model.lm_head.weight, [head]))
    attached = 0
    for owner, attr, weight, names in plan:
        quant = _fused(blocks, names) if weight is not None else None
        if quant is None:
            continue
        rows = torch.arange(0, quant.out_features, max(1, quant.out_features // CHECKED_ROWS))
        if tuple(weight.shape) != (quant.out_features, quant.in_features) or weight.dtype != torch.float32 \
                or not torch.equal(quant.dequantize(rows), weight[rows]):
            raise KernelUnavailable(f"the GGUF blocks of {', '.join(names)} differ from the loaded fp32 weights")
        setattr(owner, attr, quant)
        attached += 1
    return attached


def detach_quantized(model: "CausalLM") -> None:
    """Back to the fp32 path everywhere."""
    holders = [model] + [m for layer in model.model.layers for m in (layer.self_attn, layer.mlp)]
    for owner in holders:
        for attr in ("qkv_quant", "o_quant", "gate_up_quant", "down_quant", "lm_head_quant"):
            if getattr(owner, attr, None) is not None:
                setattr(owner, attr, None)


def maybe_attach_quantized(model: "CausalLM", checkpoint: "Checkpoint", enabled: bool = True) -> bool:
    """Use the block kernel for ``model`` when it was loaded from a GGUF with quantized matrices,
    lives on the CPU in float32, and the kernel works here; one log line when it cannot."""
    raw_config = checkpoint.raw_config
    source = raw_config.get("flashtree_source_gguf") if isinstance(raw_config, dict) else None
    if not enabled or checkpoint.weights is None or not isinstance(source, dict) or not source.get("path"):
        return False
    if not set(source.get("tensor_types") or BLOCK_TYPES) & set(BLOCK_TYPES):
        return False  # an F32/F16 GGUF: nothing quantized to keep
    param = model.lm_head.weight
    if param.device.type != "cpu" or param.dtype != torch.float32:
        return False
    cfg = model.config
    try:
        load_kernels()
        blocks = load_blocks(checkpoint.path, source, str(raw_config.get("model_type", "")),
                             cfg.num_attention_heads, cfg.num_key_value_heads)
        attached = attach_quantized(model, blocks)
    except (KernelUnavailable, OSError, ValueError) as err:
        detach_quantized(model)
        log.warning("flashtree: quantized CPU kernels off, using the float32 weights: %s", err)
        return False
    return attached > 0
