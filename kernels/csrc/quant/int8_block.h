// kaiten_cpu::quant_linear (../quant_linear_cpu.cpp): int8 activations, up to kInt8BlockRows rows of x a row at a time
// against 4 tiles at once (int8_block4), or one (int8_block) for a thread's last tiles.
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

// The integers of one tile's group as int8_block meets them, its 4 rows' scales and mins (with VNNI
// and int8 weights: less 128 times the scale, the dot being of w + 128). 5-bit weights without
// VNNI are met as int4's are, by their unsigned values 0..31 in int4's order (dot_u4; the signed
// ones' dots less 16 times x's sums): the same integers as from the int8 rows, a fifth of the
// instructions (bench/results/five_bit_tiles). With VNNI, as the int8 rows (w + 128), so that the
// rows stay the int8 panel's bit for bit.
template <typename I>
struct GroupInts {
  static constexpr bool kNibbles = I::kFive && !kVnni;
  static constexpr int NZ = kTileRows * (kNibbles ? 16 : I::kInt8Bytes) / sizeof(IVec);   // vectors of the 4 rows
  static constexpr bool kBiased = panel_biased<I>();
  IVec v[NZ], h[kNibbles ? NZ : 1];     // h: the 5-bit rows' elements 16-31
  __m128 scales, mins;

  // group g's integers in `tile`
  static const uint8_t* ints(const Tiles& w, const uint8_t* tile, int64_t g) {
    return w.ints(tile) + g * kTileRows * I::kBytes;
  }

  void load(const Tiles& w, const uint8_t* tile, int64_t g) {
    const uint8_t* qg = ints(w, tile, g);
    scales = load4(tile, w.scale_bytes, g);
    if constexpr (kNibbles) {
      five_nibbles<I>(qg, v, h);
    } else {
      UNROLL
      for (int i = 0; i < NZ; ++i) v[i] = kBiased ? flip_sign_bits(group_vector<I>(qg, i)) : group_vector<I>(qg, i);
    }
    mins = w.has_mins ? load4(tile + w.scale_count() * w.scale_bytes, w.scale_bytes, g) : _mm_setzero_ps();
    if constexpr (kBiased) mins = _mm_sub_ps(mins, _mm_mul_ps(_mm_set1_ps(128.f), scales));
  }
};

// One row of x's group as the int8 kernels meet it: elements 0-15 (low nibbles) in lo and 16-31 in
// hi, or the whole group's bytes in hi; its block scale, its rounded sum (the mins' factor) and the
// correction of the signed 5-bit weights' dots.
template <typename I>
struct GroupX {
  static constexpr bool kFix = GroupInts<I>::kNibbles && I::kSignedFive;
  IVec lo, hi;
  float d, sum;
  int32_t fix;

  GroupX(const Int8Rows& x, int64_t row, int64_t g) {
    const int8_t* xg = x.q.data() + row * x.k + g * I::kGroup;
    if constexpr (I::kInt4 || GroupInts<I>::kNibbles) {
      lo = bcast16(xg);
      hi = bcast16(xg + 16);
    } else {
      hi = I::kGroup == 32 ? bcast32(xg) : bcast16(xg);
    }
    const int64_t block = (row * x.k + g * I::kGroup) / 32;
    d = x.d[block];
    sum = x.sums.empty() ? 0.f : x.sums[row * x.groups + g];
    fix = kFix ? 16 * x.isums[block] : 0;
  }
};

// The int32 dots of a tile's group with one row of x: row i's parts in the i-th quarter of the lanes.
template <typename I, int NZ>
inline void group_dots(const GroupInts<I>& w, const GroupX<I>& x, IVec (&dot)[NZ]) {
  UNROLL
  for (int i = 0; i < NZ; ++i) {
    if constexpr (GroupInts<I>::kNibbles) dot[i] = dot_u4(w.v[i], x.lo, w.h[i], x.hi);
    else if constexpr (I::kInt4) dot[i] = dot_u4(low_nibbles(w.v[i]), x.lo, high_nibbles(w.v[i]), x.hi);
    else dot[i] = dot_s8(w.v[i], x.hi);
  }
}

// R rows of x (from r0) against tile t, into y[r][i]. Each row's result is the int8 panel GEMM's
// (int8_panel.h) bit for bit, so a row's output does not depend on which of the two serves the call
// (issue #66): per group, each weight row's whole integer dot to fp32, times its scale times x's
// block scale added by one FMA, then its min times x's rounded group sum by another. Those two FMAs
// chain a tile's sum from group to group, so a call meets 4 tiles at once where it can (int8_block4).
template <typename I, int R>
inline void int8_block(const Tiles& w, int64_t t, const Int8Rows& x, int64_t r0, float (*y)[kTileRows]) {
  constexpr int NZ = GroupInts<I>::NZ;
  const bool with_mins = panel_mins<I>(w);
  const uint8_t* tile = w.tile(t);
  __m128 acc[R];
  UNROLL
  for (int r = 0; r < R; ++r) acc[r] = _mm_setzero_ps();
  for (int64_t g = 0; g < w.groups; ++g) {
    prefetch_group<I>(GroupInts<I>::ints(w, tile, g));
    GroupInts<I> gw;
    gw.load(w, tile, g);
    UNROLL
    for (int r = 0; r < R; ++r) {
      const GroupX<I> gx(x, r0 + r, g);
      IVec dot[NZ];
      group_dots(gw, gx, dot);
      __m128i d = row_dots(dot);
      if constexpr (GroupX<I>::kFix) d = _mm_sub_epi32(d, _mm_set1_epi32(gx.fix));
      acc[r] = _mm_fmadd_ps(_mm_cvtepi32_ps(d), _mm_mul_ps(gw.scales, _mm_set1_ps(gx.d)), acc[r]);
      if (with_mins) acc[r] = _mm_fmadd_ps(gw.mins, _mm_set1_ps(gx.sum), acc[r]);
    }
  }
  UNROLL
  for (int r = 0; r < R; ++r) _mm_storeu_ps(y[r], acc[r]);
}

// int8_block4 keeps 4 tiles' 16 rows in kWide vectors (one with AVX-512, two with AVX2), tile j's
// rows 0-3 in its 128-bit lane j of them.
constexpr int kWide = 16 / kIntLanes;

#if defined(CPU_CAPABILITY_AVX512)
// Each row's parts of a tile's group dot (group_dots) in one 128-bit lane: row i in lane i.
template <int NZ>
inline void rows_in_lanes(const IVec (&dot)[NZ], IVec (&out)[kWide]) {
  if constexpr (NZ == 1) {
    out[0] = dot[0];
  } else {
    static_assert(NZ == 2, "a group's 4 rows fill 1 or 2 vectors");
    // rows 0 and 1 in dot[0]'s halves, 2 and 3 in dot[1]'s: each half's two lanes summed
    out[0] = _mm512_add_epi32(_mm512_shuffle_i64x2(dot[0], dot[1], _MM_SHUFFLE(2, 0, 2, 0)),
                              _mm512_shuffle_i64x2(dot[0], dot[1], _MM_SHUFFLE(3, 1, 3, 1)));
  }
}

// Per 128-bit lane, the sums of a's, b's, c's and d's 4 int32 in that lane.
inline IVec lane_sums4(IVec a, IVec b, IVec c, IVec d) {
  const IVec ab = _mm512_add_epi32(_mm512_unpacklo_epi32(a, b), _mm512_unpackhi_epi32(a, b));
  const IVec cd = _mm512_add_epi32(_mm512_unpacklo_epi32(c, d), _mm512_unpackhi_epi32(c, d));
  return _mm512_add_epi32(_mm512_unpacklo_epi64(ab, cd), _mm512_unpackhi_epi64(ab, cd));
}

// 4 tiles' rows_in_lanes (parts[j]: tile j) as each row's whole dot, tile j's 4 rows in lane j.
inline void tile_dots4(const IVec (&parts)[4][kWide], IVec (&out)[kWide]) {
  const IVec rows = lane_sums4(parts[0][0], parts[1][0], parts[2][0], parts[3][0]);   // lane i: row i of tiles 0-3
  out[0] = _mm512_permutexvar_epi32(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), rows);
}

inline void lanes4(__m128 a, __m128 b, __m128 c, __m128 d, Vec (&out)[kWide]) {
  out[0] = Vec(_mm512_insertf32x4(_mm512_insertf32x4(_mm512_insertf32x4(_mm512_castps128_ps512(a), b, 1), c, 2), d, 3));
}

inline IVec less(IVec v, int32_t c) { return _mm512_sub_epi32(v, _mm512_set1_epi32(c)); }
#else
// Each row's parts of a tile's group dot (group_dots) in one 128-bit lane: rows 0 and 1 in out[0]'s
// lanes, 2 and 3 in out[1]'s.
template <int NZ>
inline void rows_in_lanes(const IVec (&dot)[NZ], IVec (&out)[kWide]) {
  if constexpr (NZ == 2) {
    out[0] = dot[0];
    out[1] = dot[1];
  } else {
    static_assert(NZ == 4, "a group's 4 rows fill 2 or 4 vectors");
    // a row a vector: its two lanes summed
    UNROLL
    for (int h = 0; h < 2; ++h)
      out[h] = _mm256_add_epi32(_mm256_permute2x128_si256(dot[2 * h], dot[2 * h + 1], 0x20),
                                _mm256_permute2x128_si256(dot[2 * h], dot[2 * h + 1], 0x31));
  }
}

inline IVec lane_sums4(IVec a, IVec b, IVec c, IVec d) {
  const IVec ab = _mm256_add_epi32(_mm256_unpacklo_epi32(a, b), _mm256_unpackhi_epi32(a, b));
  const IVec cd = _mm256_add_epi32(_mm256_unpacklo_epi32(c, d), _mm256_unpackhi_epi32(c, d));
  return _mm256_add_epi32(_mm256_unpacklo_epi64(ab, cd), _mm256_unpackhi_epi64(ab, cd));
}

// As the AVX-512 tile_dots4, tiles 0 and 1 in out[0], 2 and 3 in out[1].
inline void tile_dots4(const IVec (&parts)[4][kWide], IVec (&out)[kWide]) {
  const IVec r01 = lane_sums4(parts[0][0], parts[1][0], parts[2][0], parts[3][0]);   // lanes: rows 0, 1 of tiles 0-3
  const IVec r23 = lane_sums4(parts[0][1], parts[1][1], parts[2][1], parts[3][1]);
  const IVec p = _mm256_permute2x128_si256(r01, r23, 0x20), q = _mm256_permute2x128_si256(r01, r23, 0x31);   // rows 0|2, 1|3
  out[0] = _mm256_permute4x64_epi64(_mm256_unpacklo_epi32(p, q), _MM_SHUFFLE(3, 1, 2, 0));
  out[1] = _mm256_permute4x64_epi64(_mm256_unpackhi_epi32(p, q), _MM_SHUFFLE(3, 1, 2, 0));
}

inline void lanes4(__m128 a, __m128 b, __m128 c, __m128 d, Vec (&out)[kWide]) {
  out[0] = Vec(_mm256_set_m128(b, a));
  out[1] = Vec(_mm256_set_m128(d, c));
}

inline IVec less(IVec v, int32_t c) { return _mm256_sub_epi32(v, _mm256_set1_epi32(c)); }
#endif

// Where a thread reading 4 tiles at once asks for the bytes ahead: prefetch_group's 4 KiB ahead of a
// group lies in the run of 4 tiles itself (a tile is 1.4 KiB of SmolLM2's Q4_1, 2.4 of its Q8_0),
// so each group asks for its share of the tiles kRunsAhead runs on, the 4 tiles' bytes in one
// stream: a one-row output layer of 49152 x 576 (28 MB, from memory) read at half the speed
// without it (bench/results/kernel_ab/int8_tiles4_e6effd3_zen4.md).
constexpr int64_t kRunsAhead = 2;

inline void prefetch_runs_ahead(const Tiles& w, int64_t t, int64_t g) {
  const int64_t share = (4 * w.tile_bytes + w.groups - 1) / w.groups;     // a group's share of a run's bytes
  const uint8_t* run = w.tile(t + 4 * kRunsAhead) + g * share;
  for (int64_t b = 0; b < share; b += 64) __builtin_prefetch(run + b);
}

// int8_block of 4 tiles: their sums in the lanes of kWide vectors, so that 16 rows' horizontal sums
// take 10 instructions with AVX-512 (24 with AVX2) where row_dots took 5 (8) a row of 4, and each
// FMA serves 4 tiles (2). Each lane computes what int8_block's does, in the same order: the same bits.
template <typename I, int R>
inline void int8_block4(const Tiles& w, int64_t t, const Int8Rows& x, int64_t r0, float (*y)[kRowBlock][kTileRows]) {
  constexpr int NZ = GroupInts<I>::NZ;
  const bool with_mins = panel_mins<I>(w);
  Vec acc[R][kWide];
  UNROLL
  for (int r = 0; r < R; ++r) {
    UNROLL
    for (int v = 0; v < kWide; ++v) acc[r][v] = Vec(0.f);
  }
  for (int64_t g = 0; g < w.groups; ++g) {
    prefetch_runs_ahead(w, t, g);
    GroupInts<I> gw[4];
    UNROLL
    for (int j = 0; j < 4; ++j) gw[j].load(w, w.tile(t + j), g);
    Vec scales[kWide], mins[kWide];
    lanes4(gw[0].scales, gw[1].scales, gw[2].scales, gw[3].scales, scales);
    lanes4(gw[0].mins, gw[1].mins, gw[2].mins, gw[3].mins, mins);
    UNROLL
    for (int r = 0; r < R; ++r) {
      const GroupX<I> gx(x, r0 + r, g);
      IVec parts[4][kWide], d[kWide];
      UNROLL
      for (int j = 0; j < 4; ++j) {
        IVec dot[NZ];
        group_dots(gw[j], gx, dot);
        rows_in_lanes(dot, parts[j]);
      }
      tile_dots4(parts, d);
      UNROLL
      for (int v = 0; v < kWide; ++v) {
        if constexpr (GroupX<I>::kFix) d[v] = less(d[v], gx.fix);
        acc[r][v] = at::vec::fmadd(to_float(d[v]), scales[v] * Vec(gx.d), acc[r][v]);
        if (with_mins) acc[r][v] = at::vec::fmadd(mins[v], Vec(gx.sum), acc[r][v]);
      }
    }
  }
  UNROLL
  for (int r = 0; r < R; ++r) {
    float lanes[4 * kTileRows];
    UNROLL
    for (int v = 0; v < kWide; ++v) acc[r][v].store(lanes + v * VL);
    UNROLL
    for (int j = 0; j < 4; ++j) std::memcpy(y[j][r], lanes + j * kTileRows, sizeof(y[j][r]));
  }
}

template <typename I, typename O>
void int8_activations(const Tiles& w, const float* x, int64_t m, O* out) {
  const Int8Rows xq = quantize_rows<I>(w, x, m);
  over_tile_runs<4>(w, m, out, [&](int64_t t, int run, int64_t r0, int64_t rows, auto& y) {
    with_rows_upto<kRowBlock>(rows, [&](auto R) {
      int j = 0;
      for (; j + 4 <= run; j += 4) int8_block4<I, R>(w, t + j, xq, r0, y + j);
      for (; j < run; ++j) int8_block<I, R>(w, t + j, xq, r0, y[j]);
    });
  });
}
#endif

}  // namespace kaiten::quant
