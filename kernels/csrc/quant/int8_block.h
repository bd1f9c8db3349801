// kaiten_cpu::quant_linear (../quant_linear_cpu.cpp): int8 activations, up to kInt8BlockRows rows of x a row at a time
// against each tile (int8_block).
#pragma once

#include "int8_x.h"
#include "registers.h"

namespace kaiten::quant {

#if defined(KAITEN_INT8_ACTIVATIONS)
// The 4 weight rows' int32 dots of a group, from the NZ vectors that hold them (row i in the i-th
// quarter of their lanes, in order), as one vector: integer sums, exact in any order.
template <int NZ>
inline __m128i row_dots(const IVec (&dot)[NZ]) {
  constexpr int H = NZ * kIntLanes / 8;   // 256-bit halves: 2 rows each (H = 2) or 1 (H = 4)
#if defined(CPU_CAPABILITY_AVX512)
  __m256i h[H];
  UNROLL
  for (int j = 0; j < NZ; ++j) {
    h[2 * j] = _mm512_castsi512_si256(dot[j]);
    h[2 * j + 1] = _mm512_extracti64x4_epi64(dot[j], 1);
  }
#else
  const IVec (&h)[H] = dot;
#endif
  if constexpr (H == 2) {
    const __m256i a = _mm256_hadd_epi32(h[0], h[1]);   // 128-bit halves: rows 0 0 2 2, 1 1 3 3
    const __m256i b = _mm256_hadd_epi32(a, a);         // rows 0 2 0 2, 1 3 1 3
    return _mm_unpacklo_epi32(_mm256_castsi256_si128(b), _mm256_extracti128_si256(b, 1));
  } else {
    static_assert(H == 4, "a group's 4 rows fill 2 or 4 halves");
    const __m256i a = _mm256_hadd_epi32(_mm256_hadd_epi32(h[0], h[1]), _mm256_hadd_epi32(h[2], h[3]));   // rows 0 1 2 3 twice
    return _mm_add_epi32(_mm256_castsi256_si128(a), _mm256_extracti128_si256(a, 1));
  }
}

// A tile's group of 5-bit rows (qg) as int4's vectors hold them (row i in the i-th quarter of the
// lanes), their values 0..31: elements 0-15 in lo, 16-31 in hi.
template <typename I, int NZ>
inline void five_nibbles(const uint8_t* qg, IVec (&lo)[NZ], IVec (&hi)[NZ]) {
#if defined(CPU_CAPABILITY_AVX512)
  __m256i l[2], h[2];
  I::pair(qg, 0, l[0], h[0]);
  I::pair(qg, 1, l[1], h[1]);
  lo[0] = _mm512_inserti64x4(_mm512_castsi256_si512(l[0]), l[1], 1);
  hi[0] = _mm512_inserti64x4(_mm512_castsi256_si512(h[0]), h[1], 1);
#else
  UNROLL
  for (int j = 0; j < NZ; ++j) I::pair(qg, j, lo[j], hi[j]);
#endif
}

// R rows of x (from r0) against a tile, into y[r][i]. Each row's result is the int8 panel GEMM's
// (int8_panel.h) bit for bit, so a row's output does not depend on which of the two serves the call
// (issue #66): per group, each weight row's whole integer dot to fp32, times its scale times x's
// block scale added by one FMA, then its min (with VNNI and int8 weights: less 128 times the scale,
// the dot being of w + 128) times x's rounded group sum by another.
template <typename I, int R>
inline void int8_block(const Tiles& w, const uint8_t* tile, const Int8Rows& x, int64_t r0, float (*y)[kTileRows]) {
  constexpr int G = I::kGroup;
  // 5-bit weights without VNNI met as int4's are, by their unsigned values 0..31 in int4's order
  // (dot_u4; the signed ones' dots less 16 times x's sums): the same integers as from the int8
  // rows, a fifth of the instructions (bench/results/five_bit_tiles). With VNNI, as the int8 rows
  // (w + 128), so that the rows stay the int8 panel's bit for bit.
  constexpr bool kNibbles = I::kFive && !kVnni;
  constexpr int NZ = kTileRows * (kNibbles ? 16 : I::kInt8Bytes) / sizeof(IVec);   // vectors of a group's 4 rows
  constexpr bool kBiased = panel_biased<I>();
  const uint8_t* mins = w.has_mins ? tile + w.scale_count() * w.scale_bytes : nullptr;
  const bool with_mins = mins || kBiased;
  const uint8_t* q = w.ints(tile);
  __m128 acc[R];
  UNROLL
  for (int r = 0; r < R; ++r) acc[r] = _mm_setzero_ps();
  for (int64_t g = 0; g < w.groups; ++g) {
    const __m128 s4 = load4(tile, w.scale_bytes, g);
    const uint8_t* qg = q + g * kTileRows * I::kBytes;
    prefetch_group<I>(qg);
    IVec wv[NZ], wh[kNibbles ? NZ : 1];   // wh: the 5-bit rows' elements 16-31
    if constexpr (kNibbles) {
      five_nibbles<I>(qg, wv, wh);
    } else {
      UNROLL
      for (int j = 0; j < NZ; ++j) {
        wv[j] = group_vector<I>(qg, j);
        if constexpr (kBiased) wv[j] = flip_sign_bits(wv[j]);
      }
    }
    __m128 m4 = mins ? load4(mins, w.scale_bytes, g) : _mm_setzero_ps();
    if constexpr (kBiased) m4 = _mm_sub_ps(m4, _mm_mul_ps(_mm_set1_ps(128.f), s4));
    UNROLL
    for (int r = 0; r < R; ++r) {
      const int64_t row = r0 + r;
      const int8_t* xg = x.q.data() + row * x.k + g * G;
      IVec dot[NZ];
      if constexpr (I::kInt4 || kNibbles) {
        const IVec x0 = bcast16(xg), x1 = bcast16(xg + 16);     // elements 0-15 (low nibbles), 16-31
        UNROLL
        for (int j = 0; j < NZ; ++j)
          dot[j] = kNibbles ? dot_u4(wv[j], x0, wh[j], x1) : dot_u4(low_nibbles(wv[j]), x0, high_nibbles(wv[j]), x1);
      } else {
        const IVec xb = G == 32 ? bcast32(xg) : bcast16(xg);
        UNROLL
        for (int j = 0; j < NZ; ++j) dot[j] = dot_s8(wv[j], xb);
      }
      const __m128 dx = _mm_set1_ps(x.d[(row * x.k + g * G) / 32]);
      __m128i d = row_dots(dot);
      if constexpr (kNibbles && I::kSignedFive) d = _mm_sub_epi32(d, _mm_set1_epi32(16 * x.isums[(row * x.k + g * G) / 32]));
      acc[r] = _mm_fmadd_ps(_mm_cvtepi32_ps(d), _mm_mul_ps(s4, dx), acc[r]);
      if (with_mins) acc[r] = _mm_fmadd_ps(m4, _mm_set1_ps(x.sums[row * x.groups + g]), acc[r]);
    }
  }
  UNROLL
  for (int r = 0; r < R; ++r) _mm_storeu_ps(y[r], acc[r]);
}

template <typename I, typename O>
void int8_activations(const Tiles& w, const float* x, int64_t m, O* out) {
  const Int8Rows xq = quantize_rows<I>(w, x, m);
  over_tiles<float, false>(w, m, 0, out,
                           [&](const TileScales&, const uint8_t* tile, float*, int64_t r0, int64_t rows, float(*y)[kTileRows]) {
    with_rows_upto<kRowBlock>(rows, [&](auto R) { int8_block<I, R>(w, tile, xq, r0, y); });
  });
}
#endif

}  // namespace kaiten::quant
