// flashtree CPU block kernels: y[M, N] = x[M, K] @ W[N, K]^T (+ bias) with W in GGUF blocks
// (Q4_0, Q4_1, Q8_0, Q5_0, Q5_1, Q4_K, Q6_K).
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include <algorithm>
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

// Type codes (quant_linear.BLOCK_TYPES). 32-weight blocks:
// 0: Q4_0 {fp16 d; u8 qs[16]}              w = d * (q - 8)   computed as fma(d, q, -8 d), exact
// 1: Q4_1 {fp16 d, m; u8 qs[16]}           w = fma(d, q, m)  (d * q exact: one rounding, like d*q + m)
// 2: Q8_0 {fp16 d; i8 qs[32]}              w = d * q, exact
// 3: Q5_0 {fp16 d; u32 qh; u8 qs[16]}      w = d * (q - 16)  as fma(d, q, -16 d), exact
// 4: Q5_1 {fp16 d, m; u32 qh; u8 qs[16]}   w = fma(d, q, m)
//    (Q4/Q5: weight i < 16 is the low nibble of qs[i], weight 16 + i its high nibble; Q5: bit i of qh is
//    weight i's fifth bit)
// 256-weight super-blocks, read as 8 sub-blocks of 32:
// 5: Q4_K {fp16 d, dmin; u8 scales[12]; u8 qs[128]}: sub-block j has 6-bit sc, m (scale_min) and the low
//    (j even) or high (j odd) nibbles of qs[32 (j / 2) ...]; w = fma(d sc, q, -(dmin m)) (d sc, dmin m and
//    (d sc) q exact: one rounding, like gguf-py's (d sc) q - dmin m)
// 6: Q6_K {u8 ql[128], qh[64]; i8 scales[16]; fp16 d}: sub-block j = 4 h + t has q = 4 bits of
//    ql[64 h + 32 (t % 2) ...] (low nibbles for t < 2) and 2 bits of qh[32 h ...] (bits 2t, 2t + 1); weights
//    16 i .. 16 i + 15 of the super-block use scales[i]; w = (d sc) * (q - 32) (d sc exact, one rounding)
// Not a GGUF block: 7: F32 {float w[32]}, a float32 weight row read 32 values at a time (no int8 activations):
//    a dense float32 model's products, row-invariant like the block types' (MKL's are not).
constexpr int F32_ROWS = 7;
constexpr bool is_super_block(int type) { return type == 5 || type == 6; }
constexpr int64_t block_bytes(int type) {  // a 32-weight block's, or a 256-weight super-block's
  return type == 0 ? 18 : type == 1 ? 20 : type == 2 ? 34 : type == 3 ? 22 : type == 4 ? 24 : type == 5 ? 144
       : type == 6 ? 210 : 128;
}
constexpr int64_t row_bytes_of(int type, int64_t blocks) {  // blocks: 32-weight blocks a row
  return is_super_block(type) ? blocks / 8 * block_bytes(type) : blocks * block_bytes(type);
}
constexpr int64_t block_offset(int type, int64_t b) {  // where 32-weight block b of a row starts (its super-block)
  return is_super_block(type) ? b / 8 * block_bytes(type) : b * block_bytes(type);
}

// Q4_K's 6-bit scale and min of sub-block j from the super-block's 12 bytes
inline void scale_min_k4(const uint8_t* s, int j, int& scale, int& min) {
  if (j < 4) {
    scale = s[j] & 63;
    min = s[j + 4] & 63;
  } else {
    scale = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
    min = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

// 16 bits -> 16 bytes: byte i = 0x10 where bit i is set (a Q5 weight's fifth bit)
inline __m128i fifth_bits(uint32_t bits) {
  const __m128i spread = _mm_shuffle_epi8(_mm_cvtsi32_si128((int)bits), _mm_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1));
  const __m128i select = _mm_set1_epi64x((long long)0x8040201008040201ULL);
  return _mm_and_si128(_mm_cmpeq_epi8(_mm_and_si128(spread, select), select), _mm_set1_epi8(0x10));
}

// A Q5 block's quants 0..31 (0 .. 31 each): weights 0..15 at low, 16..31 at high
inline void q5_quants(const uint8_t* qh_at, __m128i& low, __m128i& high) {
  uint32_t qh;
  memcpy(&qh, qh_at, 4);
  const __m128i v = _mm_loadu_si128((const __m128i*)(qh_at + 4)), low4 = _mm_set1_epi8(0x0F);
  low = _mm_or_si128(_mm_and_si128(v, low4), fifth_bits(qh & 0xFFFF));
  high = _mm_or_si128(_mm_and_si128(_mm_srli_epi16(v, 4), low4), fifth_bits(qh >> 16));
}

// 16 Q6_K quants minus 32 (int8 -32 .. 31): 4 bits of ql at nibble `shift` (0 or 4), 2 of qh at bit qshift
inline __m128i q6_quants(const uint8_t* ql, const uint8_t* qh, int shift, int qshift) {
  const __m128i low = _mm_and_si128(_mm_srl_epi16(_mm_loadu_si128((const __m128i*)ql), _mm_cvtsi32_si128(shift)),
                                    _mm_set1_epi8(0x0F));
  const __m128i high = _mm_and_si128(_mm_srl_epi16(_mm_loadu_si128((const __m128i*)qh), _mm_cvtsi32_si128(qshift)),
                                     _mm_set1_epi8(0x03));
  return _mm_sub_epi8(_mm_or_si128(low, _mm_slli_epi16(high, 4)), _mm_set1_epi8(32));
}

// The 32 Q6_K quants minus 32 of a sub-block as q6_quants takes them, at once: 4 bits of ql[0..31] at nibble
// SHIFT, 2 of `high_bits` (qh[0..31]) at bit QSHIFT
template <int SHIFT, int QSHIFT>
inline __m256i q6_quants32(const uint8_t* ql, __m256i high_bits) {
  const __m256i low = _mm256_and_si256(_mm256_srli_epi16(_mm256_loadu_si256((const __m256i*)ql), SHIFT),
                                       _mm256_set1_epi8(0x0F));
  const __m256i high = _mm256_and_si256(_mm256_srli_epi16(high_bits, QSHIFT), _mm256_set1_epi8(0x03));
  return _mm256_sub_epi8(_mm256_or_si256(low, _mm256_slli_epi16(high, 4)), _mm256_set1_epi8(32));
}

// 32-weight block b of the weight row at `row` as two vectors of 16 weights (elements 0..15 and 16..31),
// each weight exactly as gguf-py decodes it (see the type list above).
template <int TYPE>
inline void decode(const uint8_t* row, int64_t b, V16& w0, V16& w1) {
  const uint8_t* block = row + block_offset(TYPE, b);
  const __m128i low4 = _mm_set1_epi8(0x0F);
  if constexpr (TYPE == F32_ROWS) {
    w0 = v_load((const float*)block);
    w1 = v_load((const float*)block + 16);
  } else if constexpr (TYPE == 5) {
    const int j = (int)(b % 8);
    int sc, m;
    scale_min_k4(block + 4, j, sc, m);
    const V16 step = v_set1(half_to_float(block) * (float)sc), offset = v_set1(-(half_to_float(block + 2) * (float)m));
    const uint8_t* qs = block + 16 + 32 * (j / 2);
    const __m128i shift = _mm_cvtsi32_si128(4 * (j % 2));
    w0 = v_fmadd(step, v_from_u8(_mm_and_si128(_mm_srl_epi16(_mm_loadu_si128((const __m128i*)qs), shift), low4)), offset);
    w1 = v_fmadd(step, v_from_u8(_mm_and_si128(_mm_srl_epi16(_mm_loadu_si128((const __m128i*)(qs + 16)), shift), low4)),
                 offset);
  } else if constexpr (TYPE == 6) {
    const int j = (int)(b % 8), h = j / 4, t = j % 4;
    const uint8_t *ql = block + 64 * h + 32 * (t % 2), *qh = block + 128 + 32 * h;
    const int8_t* scales = (const int8_t*)(block + 192) + 2 * j;
    const float d = half_to_float(block + 208);
    w0 = v_mul(v_set1(d * (float)scales[0]), v_from_i8(q6_quants(ql, qh, 4 * (t / 2), 2 * t)));
    w1 = v_mul(v_set1(d * (float)scales[1]), v_from_i8(q6_quants(ql + 16, qh + 16, 4 * (t / 2), 2 * t)));
  } else if constexpr (TYPE == 2) {
    const V16 d = v_set1(half_to_float(block));
    const __m128i* q = (const __m128i*)(block + 2);
    w0 = v_mul(d, v_from_i8(_mm_loadu_si128(q)));
    w1 = v_mul(d, v_from_i8(_mm_loadu_si128(q + 1)));
  } else {
    const V16 d = v_set1(half_to_float(block));
    const bool has_min = TYPE == 1 || TYPE == 4;
    const V16 m = has_min ? v_set1(half_to_float(block + 2)) : v_mul(d, v_set1(TYPE == 3 ? -16.0f : -8.0f));
    __m128i low, high;
    if (TYPE == 3 || TYPE == 4) {
      q5_quants(block + (TYPE == 4 ? 4 : 2), low, high);
    } else {
      const __m128i v = _mm_loadu_si128((const __m128i*)(block + (TYPE == 1 ? 4 : 2)));
      low = _mm_and_si128(v, low4);
      high = _mm_and_si128(_mm_srli_epi16(v, 4), low4);
    }
    w0 = v_fmadd(d, v_from_u8(low), m);
    w1 = v_fmadd(d, v_from_u8(high), m);
  }
}

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
constexpr int64_t L1_X_BYTES = 32768;  // a group's rows of x stay in L1 (else the group is halved)
constexpr int COLUMN_TILE = 4;  // weight rows (output columns) a task takes at once

// Output columns worked on together by a group of M rows. One or two rows stream the weight one row at a
// time: each thread's share of the matrix is then read as one sequential stream, which the hardware
// prefetcher follows at near the full memory bandwidth; 4 interleaved weight rows (4 short streams of about
// 1 KB) read about half as fast from DRAM (2-core EPYC, Q4_0 / Q8_0 [6144, 2048], one row of x: 18 against
// 30 GB/s). Three or four rows interleave two columns: their chains of FMAs are then the limit.
// (A (row, column) pair's arithmetic does not depend on this: see dot_rows.)
#if defined(__AVX512F__)
template <int M> constexpr int columns_for() { return M == 3 || M == 4 ? 2 : 1; }
#else
template <int M> constexpr int columns_for() { return 1; }
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
      const uint8_t* row = w + c * row_bytes;
      _mm_prefetch((const char*)(row + block_offset(TYPE, b) + PREFETCH_BYTES), _MM_HINT_T0);
      decode<TYPE>(row, b, w0[c], w1[c]);
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

// ---- int8 activations: each row of x quantized per 32-value block (like llama.cpp's Q8_0 activations),
// integer block dot products, float accumulation of the block partials.
//
// A block of x: d = max|x| / 127, q = round(x * (1 / d)) (nearest, ties to even; q = 0 where d = 0).
// For a weight block with integers w (Q4: the nibbles 0..15, Q5: 0..31, Q8_0: the signed bytes, Q6_K: q - 32)
// the integer I = sum(w * q) is exact in int32, and
//   Q8_0: x . W = d_w d I;   Q4_0: d_w d (I - 8 sum(q));   Q4_1: d_w d I + m d sum(q);
//   Q5_0: d_w d (I - 16 sum(q));   Q5_1: as Q4_1;   Q4_K: (d sc) d I - (dmin m) d sum(q) (as Q4_1);
//   Q6_K: (d sc_0) d I_0 + (d sc_1) d I_1 (I_0 over elements 0..15, I_1 over 16..31).
// Blocks go in pairs (a, b) = (2p, 2p + 1) (an odd count's last one with a zero block b): one 256-bit
// register holds a's elements 0..15 and b's 0..15, a second one their 16..31, so lanes 0-3 sum a's
// products and lanes 4-7 b's (each lane 8 products: 4 per register). A (row, column) pair keeps 8 float
// lanes acc; per pair of blocks, in order: acc = fma(float(I_lane), d_w * d (of the lane's block), acc)
// (Q4_0: each lane's I_lane starts at -2 sum(q), so a block's 4 lanes add up to I - 8 sum(q); Q5_0: at
// -4 sum(q); Q4_1, Q5_1, Q4_K then acc = fma(m, d sum(q) / 4, acc), the min term spread over the block's 4
// lanes; Q6_K: two such fmas, see dot_rows_int8); the result is the sum
// of the lanes (hsum8's order) + bias. Only 256-bit integer and float operations: the AVX-512 build (VNNI
// vpdpbusd) and the AVX2 build (vpmaddubsw + vpmaddwd, the same lane sums) give the same bits.

constexpr int INT8_ACTIVATIONS = 16;  // or-ed into a product's type code: x quantized to int8 blocks

// x's rows as int8 blocks, `pairs` block pairs a row: q [M, pairs * 64] (per pair: a[0:16], b[0:16],
// a[16:32], b[16:32]); per (row, pair) the scale d, -2 sum(q) and d sum(q) / 4 of a and b as the pair's lanes
// take them: 8 values each, a's four times then b's (a plain load, no shuffle, per pair).
struct Int8Rows {
  const int8_t* q;
  const float* scales;
  const int32_t* starts;
  const float* min_terms;
  int64_t pairs;
  Int8Rows from_row(int64_t r0) const {
    const int64_t i = r0 * pairs * 8;
    return {q + r0 * pairs * 64, scales + i, starts + i, min_terms + i, pairs};
  }
};

inline float hmax8(__m256 a) {
  __m128 x = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  x = _mm_max_ps(x, _mm_movehl_ps(x, x));
  return _mm_cvtss_f32(_mm_max_ss(x, _mm_movehdup_ps(x)));
}

inline float hsum8(__m256 a) {
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  return _mm_cvtss_f32(_mm_add_ss(x, _mm_movehdup_ps(x)));
}

inline int32_t hsum8_epi32(__m256i a) {
  __m128i x = _mm_add_epi32(_mm256_castsi256_si128(a), _mm256_extracti128_si256(a, 1));
  x = _mm_add_epi32(x, _mm_unpackhi_epi64(x, x));
  return _mm_cvtsi128_si32(_mm_add_epi32(x, _mm_shuffle_epi32(x, 1)));
}

// One block of 32 floats -> int8: elements 0..15 at low, 16..31 at high; returns d, writes sum(q).
inline float quantize_block(const float* x, int8_t* low, int8_t* high, int32_t* sum) {
  __m256 v[4], amax = _mm256_setzero_ps();
  const __m256 sign_bit = _mm256_set1_ps(-0.0f);
  for (int i = 0; i < 4; ++i) {
    v[i] = _mm256_loadu_ps(x + 8 * i);
    amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign_bit, v[i]));
  }
  const float d = hmax8(amax) / 127.0f;
  const __m256 inverse = _mm256_set1_ps(d > 0.0f ? 1.0f / d : 0.0f);
  __m256i n[4];
  for (int i = 0; i < 4; ++i) n[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inverse));  // nearest, ties to even
  *sum = hsum8_epi32(_mm256_add_epi32(_mm256_add_epi32(n[0], n[1]), _mm256_add_epi32(n[2], n[3])));
  // packs work within 128-bit lanes: the dwords come out as n0[0:4] n1[0:4] n2[0:4] n3[0:4] n0[4:8] ...
  const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(n[0], n[1]), _mm256_packs_epi32(n[2], n[3]));
  const __m256i q = _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  _mm_storeu_si128((__m128i*)low, _mm256_castsi256_si128(q));
  _mm_storeu_si128((__m128i*)high, _mm256_extracti128_si256(q, 1));
  return d;
}

// The M rows of x [M, K] into `store` (resized; an odd count's last pair gets a zero block b).
inline Int8Rows quantize_rows(const float* x, int64_t M, int64_t K, std::vector<uint8_t>& store) {
  const int64_t blocks = K / 32, pairs = (blocks + 1) / 2, values = M * pairs * 8, q_bytes = M * pairs * 64;
  // 64-byte aligned, so that no 32-byte load of x straddles two cache lines (such loads slow multi-row
  // products by 25-30%)
  store.assign(q_bytes + 12 * values + 64, 0);
  uint8_t* base = store.data() + (64 - (uintptr_t)store.data() % 64) % 64;
  int8_t* q = (int8_t*)base;
  float* scales = (float*)(base + q_bytes);
  int32_t* starts = (int32_t*)(base + q_bytes + 4 * values);
  float* min_terms = (float*)(base + q_bytes + 8 * values);
  for (int64_t r = 0; r < M; ++r)
    for (int64_t j = 0; j < blocks; ++j) {  // block j: pair j / 2, half j % 2
      const int64_t i = (r * pairs + j / 2) * 8 + (j % 2) * 4;  // its 4 lanes
      int8_t* pair = q + (r * pairs + j / 2) * 64 + (j % 2) * 16;
      int32_t sum;
      const float d = quantize_block(x + r * K + j * 32, pair, pair + 32, &sum);
      for (int lane = 0; lane < 4; ++lane) {
        scales[i + lane] = d;
        starts[i + lane] = -2 * sum;
        min_terms[i + lane] = d * (float)sum * 0.25f;
      }
    }
  return {q, scales, starts, min_terms, pairs};
}

// sum over each lane's 4 byte products u (unsigned) * s (signed), added to acc
inline __m256i dot_u8_s8(__m256i acc, __m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(acc, u, s);
#elif defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(acc, u, s);
#else  // pairs of products fit int16: at most 2 * 31 * 127 (Q4, Q5) or 2 * 128 * 127 (|w| with signs moved to s)
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
#endif
}

// two values (a's, b's) -> lanes 0-3 a, lanes 4-7 b
inline __m256 spread_pair(__m128 ab) {
  return _mm256_permutevar8x32_ps(_mm256_castps128_ps256(ab), _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1));
}
inline __m256 halves_pair(const uint8_t* a, const uint8_t* b) {  // fp16 values at a and b
  uint16_t ha, hb;
  memcpy(&ha, a, 2);
  memcpy(&hb, b, 2);
  return spread_pair(_mm_cvtph_ps(_mm_cvtsi32_si128(ha | (uint32_t)hb << 16)));
}

// A pair of weight blocks as the integer dot takes them: unsigned bytes w0 (a's and b's elements 0..15),
// w1 (16..31) (Q4/Q5: the quants, Q8_0 / Q6_K: |q|), s0, s1 (Q8_0 / Q6_K: q, whose signs go onto x's
// bytes), the scales d of a and b in lanes 0-3 and 4-7 (Q6_K: of their elements 0..15), and m: their mins
// (Q4_1, Q5_1; Q4_K: -dmin m), or Q6_K's scales of elements 16..31 (one field for both: a third float
// register per pair slows the Q4 products by 3-5%).
struct WeightPair {
  __m256i w0, w1, s0, s1;
  __m256 d, m;
};

constexpr bool signed_quants(int type) { return type == 2 || type == 6; }
constexpr bool has_min(int type) { return type == 1 || type == 4 || type == 5; }

inline __m256i both_halves(__m128i a, __m128i b) { return _mm256_set_m128i(b, a); }  // a low, b high

// A super-block's scales as the pairs of its sub-blocks take them, decoded once per super-block and column:
// Q4_K: a = the 8 sub-blocks' d sc, b = their -(dmin m); Q6_K: a = d sc of its 16-weight groups 0..7, b = of
// 8..15 (the same float values as decoding them pair by pair: each is one exact product).
struct SuperScales {
  __m256 a, b;
};

template <int TYPE>
inline SuperScales load_super_scales(const uint8_t* s) {
  if constexpr (TYPE == 5) {  // scale_min_k4 for the 8 sub-blocks at once, a byte each
    uint32_t u[3];
    memcpy(u, s + 4, 12);
    const uint64_t sc = (u[0] & 0x3F3F3F3Fu) | (uint64_t)((u[2] & 0x0F0F0F0Fu) | ((u[0] >> 6) & 0x03030303u) << 4) << 32;
    const uint64_t m = (u[1] & 0x3F3F3F3Fu) | (uint64_t)(((u[2] >> 4) & 0x0F0F0F0Fu) | ((u[1] >> 6) & 0x03030303u) << 4) << 32;
    auto floats = [](uint64_t bytes) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)bytes))); };
    const __m256 d = _mm256_set1_ps(half_to_float(s)), dmin = _mm256_set1_ps(half_to_float(s + 2));
    return {_mm256_mul_ps(d, floats(sc)), _mm256_xor_ps(_mm256_mul_ps(dmin, floats(m)), _mm256_set1_ps(-0.0f))};
  } else {
    const __m256 d = _mm256_set1_ps(half_to_float(s + 208));
    const __m128i sc = _mm_loadu_si128((const __m128i*)(s + 192));
    return {_mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc))),
            _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(sc, 8))))};
  }
}

// lanes 0-3: v[i], lanes 4-7: v[k] (i and k constants: the index vector is a constant, not built per call)
template <int I, int K>
inline __m256 pick_pair(__m256 v) {
  return _mm256_permutevar8x32_ps(v, _mm256_setr_epi32(I, I, I, I, K, K, K, K));
}

// blocks 2p and 2p + 1 of the weight row at `row` (a row of `blocks` blocks; an odd count's last pair
// takes a zero block b); super-block types: `scales` of the pair's super-block, SUB = p % 4 (the pair's
// place in its super-block, a constant so that the scales are picked with constant indices)
template <int TYPE, int SUB>
inline WeightPair load_weight_pair(const uint8_t* row, int64_t p, int64_t blocks, const SuperScales& scales) {
  WeightPair w;
  if constexpr (TYPE == 5) {  // sub-blocks j, j + 1 of a super-block: the low and high nibbles of the same 32 bytes
    constexpr int j = 2 * SUB;
    w.d = pick_pair<j, j + 1>(scales.a);
    w.m = pick_pair<j, j + 1>(scales.b);
    const uint8_t* qs = row + block_offset(TYPE, 2 * p) + 16 + 16 * j;
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    const __m256i v = _mm256_loadu_si256((const __m256i*)qs);
    const __m256i low = _mm256_and_si256(v, low4), high = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
    w.w0 = _mm256_permute2x128_si256(low, high, 0x20);  // sub-block j's elements 0..15, then j + 1's
    w.w1 = _mm256_permute2x128_si256(low, high, 0x31);  // their 16..31
    return w;
  }
  if constexpr (TYPE == 6) {  // sub-blocks j, j + 1 (j even): ql's next 32 bytes, qh's same bytes two bits up
    const uint8_t* s = row + block_offset(TYPE, 2 * p);
    constexpr int j = 2 * SUB, h = j / 4, t = j % 4;
    const uint8_t *ql = s + 64 * h, *qh = s + 128 + 32 * h;
    constexpr int shift = 4 * (t / 2);
    const __m256i high_bits = _mm256_loadu_si256((const __m256i*)qh);
    const __m256i a = q6_quants32<shift, 2 * t>(ql, high_bits), b = q6_quants32<shift, 2 * t + 2>(ql + 32, high_bits);
    w.s0 = _mm256_permute2x128_si256(a, b, 0x20);  // a's elements 0..15, b's 0..15
    w.s1 = _mm256_permute2x128_si256(a, b, 0x31);  // 16..31 of each
    w.w0 = _mm256_abs_epi8(w.s0);
    w.w1 = _mm256_abs_epi8(w.s1);
    const __m256 half = h ? scales.b : scales.a;  // groups 2j .. 2j + 3 sit at 2t .. 2t + 3 of it
    w.d = pick_pair<2 * t, 2 * t + 2>(half);
    w.m = pick_pair<2 * t + 1, 2 * t + 3>(half);
    return w;
  }
  static const uint8_t zero[34] = {};
  const uint8_t* a = row + block_offset(TYPE, 2 * p);
  const uint8_t* b = 2 * p + 1 < blocks ? a + block_bytes(TYPE) : zero;
  w.d = halves_pair(a, b);
  auto both = [&](int offset) {
    return both_halves(_mm_loadu_si128((const __m128i*)(a + offset)), _mm_loadu_si128((const __m128i*)(b + offset)));
  };
  if (TYPE == 2) {
    w.s0 = both(2);
    w.s1 = both(18);
    w.w0 = _mm256_abs_epi8(w.s0);
    w.w1 = _mm256_abs_epi8(w.s1);
  } else if (TYPE == 3 || TYPE == 4) {  // the nibbles as Q4's, or-ed with the fifth bits of both blocks' qh
    const int at = TYPE == 4 ? 4 : 2;
    const __m256i v = both(at + 4), low4 = _mm256_set1_epi8(0x0F);
    uint32_t qa, qb;
    memcpy(&qa, a + at, 4);
    memcpy(&qb, b + at, 4);
    const __m256i qh = both_halves(_mm_cvtsi32_si128((int)qa), _mm_cvtsi32_si128((int)qb));
    const __m256i select = _mm256_set1_epi64x((long long)0x8040201008040201ULL), five = _mm256_set1_epi8(0x10);
    auto fifth = [&](int byte) {  // bytes `byte` and `byte + 1` of each qh, a bit per byte, as 0x10 or 0
      const __m256i spread = _mm256_shuffle_epi8(qh, _mm256_setr_epi8(
          byte, byte, byte, byte, byte, byte, byte, byte, byte + 1, byte + 1, byte + 1, byte + 1, byte + 1, byte + 1,
          byte + 1, byte + 1, byte, byte, byte, byte, byte, byte, byte, byte, byte + 1, byte + 1, byte + 1, byte + 1,
          byte + 1, byte + 1, byte + 1, byte + 1));
      return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, select), select), five);
    };
    w.w0 = _mm256_or_si256(_mm256_and_si256(v, low4), fifth(0));
    w.w1 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v, 4), low4), fifth(2));
  } else {
    const __m256i v = both(TYPE == 1 ? 4 : 2), low4 = _mm256_set1_epi8(0x0F);
    w.w0 = _mm256_and_si256(v, low4);
    w.w1 = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
  }
  if (has_min(TYPE)) w.m = halves_pair(a + 2, b + 2);
  return w;
}

// As dot_rows, from int8 rows (row r of x at x.from_row(r)): every (row, column) pair runs the loop over
// block pairs of the section comment, whatever M and C are. Q6_K (a scale per 16 weights) takes the
// products of w0 and of w1 as two integer sums, each with its scales: acc = fma(I0, d0 d, acc), then
// acc = fma(I1, d1 d, acc).
// One block pair p of dot_rows_int8 (SUB: as load_weight_pair's) into acc.
template <int TYPE, int M, int C, int SUB>
inline void pair_step_int8(const Int8Rows& x, const uint8_t* w, int64_t row_bytes, int64_t blocks, int64_t p,
                           const SuperScales* scales, __m256 (&acc)[C][M]) {
  WeightPair wp[C];
  for (int c = 0; c < C; ++c) {
    const uint8_t* row = w + c * row_bytes;
    // (super-block types: the pair's share of its super-block's bytes, so that every cache line is prefetched)
    const int64_t at = is_super_block(TYPE) ? 2 * p * block_bytes(TYPE) / 8 : block_offset(TYPE, 2 * p);
    _mm_prefetch((const char*)(row + at + PREFETCH_BYTES), _MM_HINT_T0);
    wp[c] = load_weight_pair<TYPE, SUB>(row, p, blocks, scales[is_super_block(TYPE) ? c : 0]);
  }
  for (int r = 0; r < M; ++r) {
    const int64_t i = (r * x.pairs + p) * 8;
    const int8_t* q = x.q + (r * x.pairs + p) * 64;
    const __m256i q0 = _mm256_loadu_si256((const __m256i*)q), q1 = _mm256_loadu_si256((const __m256i*)(q + 32));
    const __m256 d = _mm256_loadu_ps(x.scales + i);
    // Q4_0: -2 sum(q) a lane (its block's 4 lanes: -8 sum(q)); Q5_0: twice that (-16 sum(q))
    const __m256i start = TYPE == 0 ? _mm256_loadu_si256((const __m256i*)(x.starts + i))
                          : TYPE == 3 ? _mm256_slli_epi32(_mm256_loadu_si256((const __m256i*)(x.starts + i)), 1)
                                      : _mm256_setzero_si256();
    for (int c = 0; c < C; ++c) {
      const __m256i u0 = signed_quants(TYPE) ? _mm256_sign_epi8(q0, wp[c].s0) : q0;
      const __m256i u1 = signed_quants(TYPE) ? _mm256_sign_epi8(q1, wp[c].s1) : q1;
      if (TYPE == 6) {
        const __m256 lanes0 = _mm256_cvtepi32_ps(dot_u8_s8(_mm256_setzero_si256(), wp[c].w0, u0));
        const __m256 lanes1 = _mm256_cvtepi32_ps(dot_u8_s8(_mm256_setzero_si256(), wp[c].w1, u1));
        acc[c][r] = _mm256_fmadd_ps(lanes0, _mm256_mul_ps(wp[c].d, d), acc[c][r]);
        acc[c][r] = _mm256_fmadd_ps(lanes1, _mm256_mul_ps(wp[c].m, d), acc[c][r]);
      } else {
        const __m256 lanes = _mm256_cvtepi32_ps(dot_u8_s8(dot_u8_s8(start, wp[c].w0, u0), wp[c].w1, u1));
        acc[c][r] = _mm256_fmadd_ps(lanes, _mm256_mul_ps(wp[c].d, d), acc[c][r]);
      }
      if (has_min(TYPE)) acc[c][r] = _mm256_fmadd_ps(wp[c].m, _mm256_loadu_ps(x.min_terms + i), acc[c][r]);
    }
  }
}

// As dot_rows, from int8 rows (row r of x at x.from_row(r)): every (row, column) pair runs the loop over
// block pairs of the section comment, whatever M and C are. Q6_K (a scale per 16 weights) takes the
// products of w0 and of w1 as two integer sums, each with its scales: acc = fma(I0, d0 d, acc), then
// acc = fma(I1, d1 d, acc). Super-block types go a super-block (4 pairs) at a time.
template <int TYPE, int M, int C>
inline void dot_rows_int8(const Int8Rows& x, const uint8_t* w, int64_t row_bytes, int64_t blocks, const float* add,
                          float* y, int64_t N) {
  __m256 acc[C][M];
  SuperScales scales[is_super_block(TYPE) ? C : 1];  // (super-block types) each column's current super-block's
  for (int c = 0; c < C; ++c)
    for (int r = 0; r < M; ++r) acc[c][r] = _mm256_setzero_ps();
  if constexpr (is_super_block(TYPE)) {
    for (int64_t p = 0; p < x.pairs; p += 4) {  // (a row of whole super-blocks: pairs is a multiple of 4)
      for (int c = 0; c < C; ++c) scales[c] = load_super_scales<TYPE>(w + c * row_bytes + block_offset(TYPE, 2 * p));
      pair_step_int8<TYPE, M, C, 0>(x, w, row_bytes, blocks, p, scales, acc);
      pair_step_int8<TYPE, M, C, 1>(x, w, row_bytes, blocks, p + 1, scales, acc);
      pair_step_int8<TYPE, M, C, 2>(x, w, row_bytes, blocks, p + 2, scales, acc);
      pair_step_int8<TYPE, M, C, 3>(x, w, row_bytes, blocks, p + 3, scales, acc);
    }
  } else {
    for (int64_t p = 0; p < x.pairs; ++p) pair_step_int8<TYPE, M, C, 0>(x, w, row_bytes, blocks, p, scales, acc);
  }
  for (int c = 0; c < C; ++c)
    for (int r = 0; r < M; ++r) y[r * N + c] = hsum8(acc[c][r]) + add[c];
}

// x as a product reads it: float rows [M, K], or (int8 activations) their int8 blocks.
struct Activations {
  const float* f;
  Int8Rows q;
  int64_t K, blocks;
  Activations from_row(int64_t r0) const { return {f + r0 * K, q.from_row(r0), K, blocks}; }  // rows r0 on
};

template <int TYPE, bool INT8, int M, int C>
inline void dot_tile(const Activations& x, const uint8_t* w, int64_t row_bytes, const float* add, float* y,
                     int64_t N) {
  if constexpr (INT8) dot_rows_int8<TYPE, M, C>(x.q, w, row_bytes, x.blocks, add, y, N);
  else dot_rows<TYPE, M, C>(x.f, w, row_bytes, x.blocks, x.K, add, y, N);
}

// `cols` <= COLUMN_TILE consecutive columns for M rows: in steps of columns_for<M>(), then one by one.
template <int TYPE, bool INT8, int M>
inline void tile_columns(const Activations& x, const uint8_t* w, int64_t row_bytes, const float* add, float* y,
                         int64_t N, int cols) {
  constexpr int C = columns_for<M>();
  int c = 0;
  for (; c + C <= cols; c += C) dot_tile<TYPE, INT8, M, C>(x, w + c * row_bytes, row_bytes, add + c, y + c, N);
  for (; c < cols; ++c) dot_tile<TYPE, INT8, M, 1>(x, w + c * row_bytes, row_bytes, add + c, y + c, N);
}

template <int TYPE, bool INT8>
inline void tile_group(int m, const Activations& x, const uint8_t* w, int64_t row_bytes, const float* add, float* y,
                       int64_t N, int cols) {
  switch (m) {
    case 1: tile_columns<TYPE, INT8, 1>(x, w, row_bytes, add, y, N, cols); return;
    case 2: tile_columns<TYPE, INT8, 2>(x, w, row_bytes, add, y, N, cols); return;
    case 3: tile_columns<TYPE, INT8, 3>(x, w, row_bytes, add, y, N, cols); return;
    case 4: tile_columns<TYPE, INT8, 4>(x, w, row_bytes, add, y, N, cols); return;
    case 5: tile_columns<TYPE, INT8, 5>(x, w, row_bytes, add, y, N, cols); return;
    case 6: tile_columns<TYPE, INT8, 6>(x, w, row_bytes, add, y, N, cols); return;
    case 7: tile_columns<TYPE, INT8, 7>(x, w, row_bytes, add, y, N, cols); return;
    default: tile_columns<TYPE, INT8, 8>(x, w, row_bytes, add, y, N, cols); return;
  }
}

// The rows of x go in groups of ROW_GROUP (half as many when those rows of x would not fit in L1); for
// each group, tasks of COLUMN_TILE weight rows split over the threads, the same tiles to the same thread
// for every group. A group's x stays in L1 while the weights stream through it, each block decoded once
// per group, and a thread's share of a weight stays in its L2 from one group to the next. A row's result
// never depends on how many rows share the call: every (row, column) pair is the same chain of FMAs.
// INT8: the rows are first quantized to int8 blocks (each row on its own), then multiplied as such.
// Row r of y starts at y + r * ldy (ldy >= N).
template <int TYPE, bool INT8>
int gemm_rows(const float* x, const uint8_t* w, const float* bias, float* y, int64_t M, int64_t N, int64_t K,
              int64_t ldy, int threads) {
  if (M < 1) return 1;
  const int64_t blocks = K / 32, row_bytes = row_bytes_of(TYPE, blocks);
  const int64_t tiles = (N + COLUMN_TILE - 1) / COLUMN_TILE;
  const int64_t x_bytes = INT8 ? 1 : (int64_t)sizeof(float);  // per value of x
  const int64_t group = ROW_GROUP * K * x_bytes <= L1_X_BYTES ? ROW_GROUP : ROW_GROUP / 2;
  thread_local std::vector<uint8_t> int8_store;
  const Activations rows{x, INT8 ? quantize_rows(x, M, K, int8_store) : Int8Rows{}, K, blocks};
#pragma omp parallel num_threads(threads) if (threads > 1 && N >= 64)
  for (int64_t r0 = 0; r0 < M; r0 += group) {
    const int m = (int)std::min(M - r0, group);
    const Activations group_rows = rows.from_row(r0);
#pragma omp for schedule(static) nowait
    for (int64_t t = 0; t < tiles; ++t) {
      const int64_t n = t * COLUMN_TILE;
      const int cols = (int)(N - n < COLUMN_TILE ? N - n : COLUMN_TILE);
      float add[COLUMN_TILE] = {0.0f, 0.0f, 0.0f, 0.0f};
      for (int c = 0; bias && c < cols; ++c) add[c] = bias[n + c];
      tile_group<TYPE, INT8>(m, group_rows, w + n * row_bytes, row_bytes, add, y + r0 * ldy + n, ldy, cols);
    }
  }
  return 0;
}

// One block type's product (see flashtree_block_gemm), row r of y at y + r * ldy.
int block_gemm(int code, const float* x, const uint8_t* w, const float* bias, float* y, int64_t M, int64_t N,
               int64_t K, int64_t ldy, int threads) {
  const int type = code & ~INT8_ACTIVATIONS;
  if (K % (type == 5 || type == 6 ? 256 : 32) != 0) return 1;
  switch (code) {
#define FLASHTREE_GEMM_CASES(T)                                                     \
    case T: return gemm_rows<T, false>(x, w, bias, y, M, N, K, ldy, threads); \
    case INT8_ACTIVATIONS | T: return gemm_rows<T, true>(x, w, bias, y, M, N, K, ldy, threads);
    FLASHTREE_GEMM_CASES(0) FLASHTREE_GEMM_CASES(1) FLASHTREE_GEMM_CASES(2) FLASHTREE_GEMM_CASES(3)
    FLASHTREE_GEMM_CASES(4) FLASHTREE_GEMM_CASES(5) FLASHTREE_GEMM_CASES(6)
#undef FLASHTREE_GEMM_CASES
    case F32_ROWS: return gemm_rows<F32_ROWS, false>(x, w, bias, y, M, N, K, ldy, threads);
  }
  return 1;
}

template <int TYPE>
void dequantize(const uint8_t* w, float* out, int64_t N, int64_t K, int threads) {
  const int64_t blocks = K / 32, row_bytes = row_bytes_of(TYPE, blocks);
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && N >= 64)
  for (int64_t n = 0; n < N; ++n)
    for (int64_t b = 0; b < blocks; ++b) {
      V16 w0, w1;
      decode<TYPE>(w + n * row_bytes, b, w0, w1);
      v_store(out + n * K + b * 32, w0);
      v_store(out + n * K + b * 32 + 16, w1);
    }
}

// ---- fused small ops of a decoder layer (fp32, rows = tokens); see fused.py
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

// sum = x + residual; out = sum * rsqrt(mean(sum^2) + eps) * weight, per row of width values (sum may be
// residual itself: each element is read before it is written).
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

// Attention of each row's N new tokens over its cache positions 0 .. lengths[b] + N - 1 (committed
// context, then the new tokens' own entries): query i sees every committed entry (the last
// `window` ones when window > 0) and new token t where new_mask[b, i, t]. q, out: [B, H, N, D].
// Position j of slot s lives on page table[s * table_stride + j / page_size] at offset
// j % page_size (the cache views are [pages, KVH, page_size, D] with the given element strides).
// One task per (row, head) on `threads` threads; a task reads each key and value once for all N
// queries, and every query's sums run over the keys in the same order as in a one-query call, so a
// query's result never depends on how many queries share the call.
void flashtree_tree_attention(const float* q, const float* k_cache, const float* v_cache, const int64_t* table,
                              const int64_t* slots, const int64_t* lengths, const uint8_t* new_mask, float* out,
                              int64_t rows, int64_t new_tokens, int64_t heads, int64_t kv_heads, int64_t head_dim,
                              int64_t window, float scale, int64_t table_stride, int64_t page_size,
                              int64_t page_stride, int64_t head_stride, int64_t pos_stride, int threads) {
  const int64_t group = heads / kv_heads, n = new_tokens;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && rows * heads > 1)
  for (int64_t task = 0; task < rows * heads; ++task) {
    const int64_t b = task / heads, h = task % heads;
    const int64_t committed = lengths[b], total = committed + n;
    const int64_t oldest = window > 0 && committed > window ? committed - window : 0;
    const int64_t* pages = table + slots[b] * table_stride;
    const int64_t head_offset = (h / group) * head_stride;
    // body(j, entry) for the keys oldest .. total - 1 in order, one table lookup per page
    auto for_each_key = [&](const float* cache, auto&& body) {
      for (int64_t j = oldest; j < total;) {
        const int64_t page = j / page_size, page_end = std::min(total, (page + 1) * page_size);
        const float* entry = cache + pages[page] * page_stride + head_offset + (j - page * page_size) * pos_stride;
        for (; j < page_end; ++j, entry += pos_stride) body(j, entry);
      }
    };
    const float* qh = q + (b * heads + h) * n * head_dim;
    float* oh = out + (b * heads + h) * n * head_dim;
    const uint8_t* sees = new_mask + b * n * n;
    std::vector<float> scores(n * total), top(n, -INFINITY), sums(n, 0.0f);
    for_each_key(k_cache, [&](int64_t j, const float* kj) {
      for (int64_t i = 0; i < n; ++i) {
        float s = -INFINITY;
        if (j < committed || sees[i * n + (j - committed)]) s = dot_product(qh + i * head_dim, kj, head_dim) * scale;
        scores[i * total + j] = s;
        top[i] = s > top[i] ? s : top[i];
      }
    });
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
    for_each_key(v_cache, [&](int64_t j, const float* vj) {
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
    });
    for (int64_t i = 0; i < n; ++i) {
      const float inv = sums[i] > 0.0f ? 1.0f / sums[i] : 0.0f;
      for (int64_t d = 0; d < head_dim; ++d) oh[i * head_dim + d] *= inv;
    }
  }
}

// code: the block type (0 Q4_0, 1 Q4_1, 2 Q8_0, 3 Q5_0, 4 Q5_1, 5 Q4_K, 6 Q6_K; K a multiple of 256 for
// the last two), or-ed with INT8_ACTIVATIONS to quantize x to int8 blocks first; or MIXED_PARTS (with or
// without INT8_ACTIVATIONS): w is then not blocks but a table of int64 {parts, then per part: its type,
// the address of its blocks, its rows}, the parts' rows stacked in order (a fused product whose matrices
// have different types, e.g. q/k Q4_K and v Q6_K); each part is its own product of the type's kernel into
// its columns of y, so every output keeps the arithmetic of its own type. Returns 0 on success, 1 for an
// unsupported code or row count.
constexpr int MIXED_PARTS = 32;

int flashtree_block_gemm(int code, const float* x, const uint8_t* w, const float* bias, float* y, int64_t M,
                         int64_t N, int64_t K, int threads) {
  if (code & MIXED_PARTS) {
    const int64_t* table = (const int64_t*)w;
    int64_t column = 0;
    for (int64_t i = 0; i < table[0]; ++i) {
      const int64_t* part = table + 1 + 3 * i;
      const int part_code = (int)part[0] | (code & INT8_ACTIVATIONS);
      if ((part[0] & ~(int64_t)7) || column + part[2] > N
          || block_gemm(part_code, x, (const uint8_t*)part[1], bias ? bias + column : nullptr, y + column, M, part[2],
                        K, N, threads))
        return 1;
      column += part[2];
    }
    return column == N ? 0 : 1;
  }
  return block_gemm(code, x, w, bias, y, M, N, K, N, threads);
}

// A sparse-MoE router (models/moe.py): per row t of x [T, H], logits[e] = x[t] . gate[e] (one dot_product over
// H in order, so a row's routing never depends on T), probabilities = softmax in float32 (the max subtracted,
// expf, the sum in expert order), the k most probable experts (ties: the lower id first) into ids [T, k] in
// falling order and their probabilities into weights [T, k], divided by their sum (in rank order) when
// `normalize`.
void flashtree_moe_route(const float* x, const float* gate, int64_t* ids, float* weights, int64_t T, int64_t E,
                         int64_t H, int64_t k, int normalize, int threads) {
  std::vector<float> logits(T * E);
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && T * E >= 256)
  for (int64_t i = 0; i < T * E; ++i) logits[i] = dot_product(x + i / E * H, gate + i % E * H, H);
  for (int64_t t = 0; t < T; ++t) {
    float* p = logits.data() + t * E;
    float top = p[0], sum = 0.0f;
    for (int64_t e = 1; e < E; ++e) top = std::max(top, p[e]);
    for (int64_t e = 0; e < E; ++e) sum += (p[e] = expf(p[e] - top));
    for (int64_t e = 0; e < E; ++e) p[e] /= sum;
    float chosen = 0.0f;
    std::vector<char> taken(E, 0);
    for (int64_t r = 0; r < k; ++r) {
      int64_t best = -1;  // (a NaN never wins a comparison: all-NaN rows take the lowest ids)
      for (int64_t e = 0; e < E; ++e)
        if (!taken[e] && (best < 0 || p[e] > p[best])) best = e;
      taken[best] = 1;
      ids[t * k + r] = best;
      weights[t * k + r] = p[best];
      chosen += p[best];
    }
    if (normalize)
      for (int64_t r = 0; r < k; ++r) weights[t * k + r] /= chosen;
  }
}

// The routed experts of one sparse-MoE layer in one call (models/moe.py): x [T, hidden] (the normed
// input), ids / weights [T, k] (each row's experts and their weights), experts [E, 4] (per expert: gate-up
// code and operand, down code and operand, as flashtree_block_gemm takes them); out [T, hidden]. Each
// expert some row chose runs, in ascending expert order, on its rows gathered into one block: the gate-up
// product, silu * up, the down product; then each of its rows gets out[t] += y * weight, the product
// rounded before the sum (asm barrier: never contracted into an fma). The same functions and the same
// order as the per-expert path, so the results are bit-identical to it. Returns 1 for an expert id out of
// range or a product the kernel refuses.
int flashtree_moe_experts(const float* x, const int64_t* ids, const float* weights, const int64_t* experts, float* out,
                          int64_t T, int64_t k, int64_t num_experts, int64_t hidden, int64_t inter, int threads) {
  std::vector<int64_t> start(num_experts + 1, 0);
  for (int64_t i = 0; i < T * k; ++i) {
    if (ids[i] < 0 || ids[i] >= num_experts) return 1;
    ++start[ids[i] + 1];
  }
  for (int64_t e = 0; e < num_experts; ++e) start[e + 1] += start[e];
  std::vector<int64_t> routed(T * k), fill(start.begin(), start.end() - 1);  // (row * k + rank) by expert
  for (int64_t i = 0; i < T * k; ++i) routed[fill[ids[i]]++] = i;
  int64_t widest = 0;
  for (int64_t e = 0; e < num_experts; ++e) widest = std::max(widest, start[e + 1] - start[e]);
  std::vector<float> rows(widest * hidden), gate_up(widest * 2 * inter), act(widest * inter), y(widest * hidden);
  std::fill(out, out + T * hidden, 0.0f);
  for (int64_t e = 0; e < num_experts; ++e) {
    const int64_t n = start[e + 1] - start[e];
    if (n == 0) continue;
    const int64_t* entry = routed.data() + start[e];
    for (int64_t j = 0; j < n; ++j)
      memcpy(rows.data() + j * hidden, x + entry[j] / k * hidden, hidden * sizeof(float));
    const int64_t* f = experts + 4 * e;
    if (flashtree_block_gemm((int)f[0], rows.data(), (const uint8_t*)f[1], nullptr, gate_up.data(), n, 2 * inter,
                             hidden, threads))
      return 1;
    flashtree_silu_mul(gate_up.data(), act.data(), n, inter);
    if (flashtree_block_gemm((int)f[2], act.data(), (const uint8_t*)f[3], nullptr, y.data(), n, hidden, inter,
                             threads))
      return 1;
    for (int64_t j = 0; j < n; ++j) {
      const float w = weights[entry[j]];
      float* o = out + entry[j] / k * hidden;
      const float* yj = y.data() + j * hidden;
      for (int64_t h = 0; h < hidden; ++h) {
        float product = yj[h] * w;
        asm("" : "+x"(product));
        o[h] += product;
      }
    }
  }
  return 0;
}

// One sparse-MoE layer's MLP on its normed input x [T, H] (the per-op path and the layer stack both call
// it): the router, then the routed experts (flashtree_moe_route, flashtree_moe_experts). moe [6]: the
// router's float32 weight [E, H], the experts' table [E, 4], E, k, normalize, the experts' width.
int flashtree_moe_layer(const float* x, const int64_t* moe, float* out, int64_t T, int64_t H, int threads) {
  const int64_t E = moe[2], k = moe[3];
  std::vector<int64_t> ids(T * k);
  std::vector<float> weights(T * k);
  flashtree_moe_route(x, (const float*)moe[0], ids.data(), weights.data(), T, E, H, k, (int)moe[4], threads);
  return flashtree_moe_experts(x, ids.data(), weights.data(), (const int64_t*)moe[1], out, T, k, E, H, moe[5],
                               threads);
}

// The decoder layers of a forward in one call (see layer_stack.py; T = rows x new tokens): for each
// layer, attention of the normed input h (qkv block product, q/k norm + rotary + KV write, tree
// attention, o product), the fused residual add + norm, the MLP (gate-up product, silu * up, down
// product) and the next layer's residual add + norm. Each step is the function the per-op path calls
// with the same operands, so the results are bit-identical to it.
// - layers [L * LAYER_FIELDS]: per layer the input-norm weight, the post-attention-norm weight, the
//   qk-norm weight (or 0), the qkv bias (or 0), then (code, blocks) of qkv, o, gate-up and down (the code
//   as flashtree_block_gemm takes it); a MoE layer's gate-up code is MOE_LAYER and its next field its
//   flashtree_moe_layer table (the down fields unused);
// - dims: hidden, heads, kv_heads, head_dim, intermediate; scale: the attention's score scale;
// - K of layer l at k_cache + l * layer_stride, V at v_cache + l * layer_stride (page / head /
//   position strides as in flashtree_tree_attention);
// - h: layer 0's normed input [T, hidden]; residual: layer 0's input. On return mlp_out holds the
//   last layer's MLP output and residual its residual (their sum is the last layer's output);
// - capture[l] (or 0): where layer l's input goes, for l >= 1: token t's hidden values to row
//   capture_rows[t] (t when capture_rows is 0) of capture_stride floats each, a row below capture_limit
//   (rows out of range refuse the call before anything is written: status 2);
// - flat_of (or 0: a padded forward, T = rows x new tokens): the rows' entries packed into T = packed_tokens
//   flat tokens (models/packing.py). h, residual, mlp_out and the captures then hold the T flat tokens, and
//   each layer spreads its qkv to the [rows, new tokens] entries for the rotary, KV write and attention
//   (flat_of[e]: entry e's flat token, packed_tokens where it is not packed: it takes the last flat token's
//   values, as TokenPacking.scatter) and takes each flat token's attention output back from its entry
//   (padded_of[t], rows x new tokens for a flat pad token: it takes the last entry's, as TokenPacking.gather).
constexpr int LAYER_FIELDS = 12;
constexpr int64_t MOE_LAYER = -1;  // a MoE layer's gate-up code: its next field is its flashtree_moe_layer table

int flashtree_layer_stack(const int64_t* layers, int64_t num_layers, const int64_t* dims, float eps,
                          float qk_eps, float scale, float* h, float* residual, float* mlp_out, float* const* capture,
                          const int64_t* capture_rows, int64_t capture_stride, int64_t capture_limit,
                          const float* cos_table, const float* sin_table, const int64_t* positions,
                          const int64_t* write_pages, const int64_t* write_offsets, float* k_cache, float* v_cache,
                          int64_t layer_stride, int64_t page_stride, int64_t head_stride, int64_t pos_stride,
                          const int64_t* table, const int64_t* slots, const int64_t* lengths,
                          const uint8_t* new_mask, int64_t table_stride, int64_t page_size, int64_t rows,
                          int64_t new_tokens, int threads, const int64_t* flat_of, const int64_t* padded_of,
                          int64_t packed_tokens) {
  const int64_t hidden = dims[0], heads = dims[1], kv_heads = dims[2], head_dim = dims[3], inter = dims[4];
  const int64_t P = rows * new_tokens, T = flat_of ? packed_tokens : P;  // entries, tokens the products run
  const int64_t qkv_width = (heads + 2 * kv_heads) * head_dim, q_width = heads * head_dim;
  for (int64_t t = 0; t < T; ++t) {
    const int64_t row = capture_rows ? capture_rows[t] : t;
    if (row < 0 || row >= capture_limit) return 2;
  }
  std::vector<float> qkv(T * qkv_width), q(P * q_width), att(P * q_width), o(T * q_width), x(T * hidden);
  std::vector<float> spread(flat_of ? P * qkv_width : 0), entries_o(flat_of ? P * q_width : 0);  // (packed)
  float* o_entries = flat_of ? entries_o.data() : o.data();  // [P, H * D]
  std::vector<float> gate_up(T * 2 * inter), act(T * inter);
  for (int64_t l = 0; l < num_layers; ++l) {
    const int64_t* f = layers + l * LAYER_FIELDS;
    const float *input_norm = (const float*)f[0], *post_norm = (const float*)f[1];
    const float *qk_norm = (const float*)f[2], *qkv_bias = (const float*)f[3];
    float* k_layer = k_cache + l * layer_stride;
    float* v_layer = v_cache + l * layer_stride;
    if (l > 0) {  // this layer's input: previous MLP output + residual, normed
      flashtree_add_rms_norm(mlp_out, residual, input_norm, residual, h, T, hidden, eps);  // (the sum in place)
      if (capture[l])
        for (int64_t t = 0; t < T; ++t)
          memcpy(capture[l] + (capture_rows ? capture_rows[t] : t) * capture_stride, residual + t * hidden,
                 hidden * sizeof(float));
    }
    if (flashtree_block_gemm((int)f[4], h, (const uint8_t*)f[5], qkv_bias, qkv.data(), T, qkv_width, hidden, threads))
      return 1;
    const float* entry_qkv = qkv.data();  // [P, qkv_width]
    if (flat_of) {
      for (int64_t e = 0; e < P; ++e)
        memcpy(spread.data() + e * qkv_width, qkv.data() + std::min(flat_of[e], T - 1) * qkv_width,
               qkv_width * sizeof(float));
      entry_qkv = spread.data();
    }
    flashtree_qkv_rope_write(entry_qkv, qk_norm, cos_table, sin_table, positions, write_pages, write_offsets,
                             q.data(), k_layer, v_layer, P, new_tokens, heads, kv_heads, head_dim, qk_eps,
                             page_stride, head_stride, pos_stride);
    flashtree_tree_attention(q.data(), k_layer, v_layer, table, slots, lengths, new_mask, att.data(), rows,
                             new_tokens, heads, kv_heads, head_dim, 0, scale, table_stride, page_size, page_stride,
                             head_stride, pos_stride, threads);
    for (int64_t b = 0; b < rows; ++b)  // [B, H, N, D] -> [B, N, H * D]
      for (int64_t hh = 0; hh < heads; ++hh)
        for (int64_t n = 0; n < new_tokens; ++n)
          memcpy(o_entries + ((b * new_tokens + n) * heads + hh) * head_dim,
                 att.data() + ((b * heads + hh) * new_tokens + n) * head_dim, head_dim * sizeof(float));
    if (flat_of)
      for (int64_t t = 0; t < T; ++t)
        memcpy(o.data() + t * q_width, o_entries + std::min(padded_of[t], P - 1) * q_width, q_width * sizeof(float));
    if (flashtree_block_gemm((int)f[6], o.data(), (const uint8_t*)f[7], nullptr, x.data(), T, hidden, q_width,
                             threads))
      return 1;
    flashtree_add_rms_norm(x.data(), residual, post_norm, residual, h, T, hidden, eps);
    if (f[8] == MOE_LAYER) {
      if (flashtree_moe_layer(h, (const int64_t*)f[9], mlp_out, T, hidden, threads)) return 1;
      continue;
    }
    if (flashtree_block_gemm((int)f[8], h, (const uint8_t*)f[9], nullptr, gate_up.data(), T, 2 * inter, hidden,
                             threads))
      return 1;
    flashtree_silu_mul(gate_up.data(), act.data(), T, inter);
    if (flashtree_block_gemm((int)f[10], act.data(), (const uint8_t*)f[11], nullptr, mlp_out, T, hidden, inter,
                             threads))
      return 1;
  }
  return 0;
}

int flashtree_block_dequantize(int type, const uint8_t* w, float* out, int64_t N, int64_t K, int threads) {
  if (K % (type == 5 || type == 6 ? 256 : 32) != 0) return 1;
  switch (type) {
    case 0: dequantize<0>(w, out, N, K, threads); return 0;
    case 1: dequantize<1>(w, out, N, K, threads); return 0;
    case 2: dequantize<2>(w, out, N, K, threads); return 0;
    case 3: dequantize<3>(w, out, N, K, threads); return 0;
    case 4: dequantize<4>(w, out, N, K, threads); return 0;
    case 5: dequantize<5>(w, out, N, K, threads); return 0;
    case 6: dequantize<6>(w, out, N, K, threads); return 0;
    case F32_ROWS: dequantize<F32_ROWS>(w, out, N, K, threads); return 0;
  }
  return 1;
}

}
