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

// Two tiles' row_dots as one vector, tile a's 4 rows in the low half. On AVX2 the two tiles share
// the last steps: for int4 groups three hadds and a permute serve both, where row_dots takes two
// hadds, an extract and an unpack each.
template <int NZ>
inline __m256i row_dots2(const IVec (&a)[NZ], const IVec (&b)[NZ]) {
#if !defined(CPU_CAPABILITY_AVX512)
  if constexpr (NZ == 2) {
    const __m256i c = _mm256_hadd_epi32(_mm256_hadd_epi32(a[0], a[1]), _mm256_hadd_epi32(b[0], b[1]));  // a0 a2 b0 b2, a1 a3 b1 b3
    return _mm256_permutevar8x32_epi32(c, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  } else if constexpr (NZ == 4) {
    const __m256i ha = _mm256_hadd_epi32(_mm256_hadd_epi32(a[0], a[1]), _mm256_hadd_epi32(a[2], a[3]));   // rows 0 1 2 3 twice
    const __m256i hb = _mm256_hadd_epi32(_mm256_hadd_epi32(b[0], b[1]), _mm256_hadd_epi32(b[2], b[3]));
    return _mm256_add_epi32(_mm256_permute2x128_si256(ha, hb, 0x20), _mm256_permute2x128_si256(ha, hb, 0x31));
  }
#endif
  return _mm256_set_m128i(row_dots(b), row_dots(a));
}

// A group's integer dots of x's row `row` with the tile's 4 weight rows wv.
template <typename I, int NZ>
inline void group_dots(const IVec (&wv)[NZ], const Int8Rows& x, int64_t row, int64_t g, IVec (&dot)[NZ]) {
  const int8_t* xg = x.q.data() + row * x.k + g * I::kGroup;
  if constexpr (I::kInt4) {
    const IVec x0 = bcast16(xg), x1 = bcast16(xg + 16);     // elements 0-15 (low nibbles), 16-31
    UNROLL
    for (int j = 0; j < NZ; ++j) dot[j] = dot_u4(low_nibbles(wv[j]), x0, high_nibbles(wv[j]), x1);
  } else {
    const IVec xb = I::kGroup == 32 ? bcast32(xg) : bcast16(xg);
    UNROLL
    for (int j = 0; j < NZ; ++j) dot[j] = dot_s8(wv[j], xb);
  }
}

// R rows of x (from r0) against T consecutive tiles (the first at `first`; T = 1 or even), into
// y[t * R + r][i]. Each row's result is the int8 panel GEMM's (int8_panel.h) bit for bit, so a
// row's output does not depend on which of the two serves the call (issue #66): per group, each
// weight row's whole integer dot to fp32, times its scale times x's block scale added by one FMA,
// then its min (with VNNI and int8 weights: less 128 times the scale, the dot being of w + 128)
// times x's rounded group sum by another. Those two FMAs a group are one dependent chain for each
// tile and row: tiles go in pairs, one 8-lane vector a pair, and T tiles at once interleave T / 2
// chains, so that at one or two rows the FMAs' latency hides behind the other pairs'
// (bench/results/quant_linear/README.md#few-rows).
template <typename I, int T, int R>
inline void int8_block(const Tiles& w, const uint8_t* first, const Int8Rows& x, int64_t r0, float (*y)[kTileRows]) {
  static_assert(T == 1 || T % 2 == 0, "tiles go in pairs");
  constexpr int P = (T + 1) / 2;                             // tile pairs (a lone tile in a pair's low half)
  constexpr int NZ = kTileRows * I::kBytes / sizeof(IVec);   // vectors of a group's 4 rows
  constexpr bool kBiased = panel_biased<I>();
  const bool with_mins = w.has_mins || kBiased;
  __m256 acc[P][R];
  UNROLL
  for (int p = 0; p < P; ++p)
    UNROLL
    for (int r = 0; r < R; ++r) acc[p][r] = _mm256_setzero_ps();
  for (int64_t g = 0; g < w.groups; ++g) {
    UNROLL
    for (int p = 0; p < P; ++p) {
      constexpr int H = T == 1 ? 1 : 2;
      __m128 s4[2], m4[2];
      IVec wv[2][NZ];
      UNROLL
      for (int h = 0; h < H; ++h) {
        const uint8_t* tile = first + (2 * p + h) * w.tile_bytes;
        const uint8_t* qg = w.ints(tile) + g * kTileRows * I::kBytes;
        prefetch_group<I>(qg);
        UNROLL
        for (int j = 0; j < NZ; ++j) {
          wv[h][j] = iload(qg + j * sizeof(IVec));
          if constexpr (kBiased) wv[h][j] = flip_sign_bits(wv[h][j]);
        }
        s4[h] = load4(tile, w.scale_bytes, g);
        m4[h] = w.has_mins ? load4(tile + w.scale_count() * w.scale_bytes, w.scale_bytes, g) : _mm_setzero_ps();
        if constexpr (kBiased) m4[h] = _mm_sub_ps(m4[h], _mm_mul_ps(_mm_set1_ps(128.f), s4[h]));
      }
      const __m256 s8 = T == 1 ? _mm256_zextps128_ps256(s4[0]) : _mm256_set_m128(s4[1], s4[0]);
      const __m256 m8 = T == 1 ? _mm256_zextps128_ps256(m4[0]) : _mm256_set_m128(m4[1], m4[0]);
      UNROLL
      for (int r = 0; r < R; ++r) {
        const int64_t row = r0 + r;
        IVec dot[2][NZ];
        UNROLL
        for (int h = 0; h < H; ++h) group_dots<I>(wv[h], x, row, g, dot[h]);
        const __m256i d8 = T == 1 ? _mm256_zextsi128_si256(row_dots(dot[0])) : row_dots2(dot[0], dot[1]);
        const __m256 dx = _mm256_set1_ps(x.d[(row * x.k + g * I::kGroup) / 32]);
        acc[p][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d8), _mm256_mul_ps(s8, dx), acc[p][r]);
        if (with_mins) acc[p][r] = _mm256_fmadd_ps(m8, _mm256_set1_ps(x.sums[row * x.groups + g]), acc[p][r]);
      }
    }
  }
  UNROLL
  for (int p = 0; p < P; ++p)
    UNROLL
    for (int r = 0; r < R; ++r) {
      _mm_storeu_ps(y[2 * p * R + r], _mm256_castps256_ps128(acc[p][r]));
      if constexpr (T > 1) _mm_storeu_ps(y[(2 * p + 1) * R + r], _mm256_extractf128_ps(acc[p][r], 1));
    }
}

// Tiles a call of int8_block takes at once for R rows of x: enough FMA chains to hide their latency
// (4 for one row of int4 weights; int8 weights' groups fill twice the registers).
template <typename I, int R>
constexpr int kSpanTiles = R == 1 && I::kInt4 ? 4 : 2;

// m rows of x against every tile, kRowBlock rows and kSpanTiles tiles a call (the last, short span
// a tile a call: the same operations per output).
template <typename I, typename O>
void int8_spans(const Tiles& w, const Int8Rows& x, int64_t m, O* out) {
  constexpr int T = 4;                        // tiles a task's span; a call takes kSpanTiles of them
  const int64_t grain = std::max<int64_t>(1, std::max<int64_t>(2, 4096 / w.k) / T);
  at::parallel_for(0, (w.tiles + T - 1) / T, grain, [&](int64_t s0, int64_t s1) {
    float y[T * kRowBlock][kTileRows];
    for (int64_t s = s0; s < s1; ++s) {
      const int64_t t0 = s * T, n = std::min<int64_t>(T, w.tiles - t0);
      for (int64_t r0 = 0; r0 < m; r0 += kRowBlock) {
        const int64_t rows = std::min<int64_t>(kRowBlock, m - r0);
        with_rows_upto<kRowBlock>(rows, [&](auto R) {
          constexpr int S = kSpanTiles<I, R>;
          int64_t t = 0;
          for (; t + S <= n; t += S) int8_block<I, S, R>(w, w.tile(t0 + t), x, r0, y + t * R);
          for (; t < n; ++t) int8_block<I, 1, R>(w, w.tile(t0 + t), x, r0, y + t * R);
        });
        for (int64_t t = 0; t < n; ++t)
          for (int64_t r = 0; r < rows; ++r)
            for (int i = 0; i < kTileRows && (t0 + t) * kTileRows + i < w.n; ++i)
              out[(r0 + r) * w.n + (t0 + t) * kTileRows + i] = static_cast<O>(y[t * rows + r][i]);   // nearest even, as Tensor::to
      }
    }
  });
}

template <typename I, typename O>
void int8_activations(const Tiles& w, const float* x, int64_t m, O* out) {
  int8_spans<I>(w, quantize_rows<I>(w, x, m), m, out);
}
#endif

}  // namespace kaiten::quant
