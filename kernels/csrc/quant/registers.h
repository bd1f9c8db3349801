// kaiten_cpu::quant_linear (../quant_linear_cpu.cpp): few rows of x against each tile while it is in L1, the weight
// dequantized in registers: fp32 x exact (dots scaled per group, or each group dequantized first),
// bf16 x by vdpbf16ps on AVX512-BF16.
#pragma once

#include <ATen/Parallel.h>
#include <vector>

#include "../with_rows.h"
#include "tiles.h"

namespace kaiten::quant {

constexpr int kRowBlock = 4;        // rows of x per pass over a tile

// Calls block(NR, i0) over a tile's weight rows: all 4 at once where the R x 4 accumulators and R
// rows' x vectors fit the registers (AVX-512's 32; AVX2's 16 up to 2 rows of x), else 2 and 2.
template <int R, typename F>
inline void over_weight_rows(const F& block) {
  if constexpr (R <= 2 || VL == 16) {
    block(std::integral_constant<int, kTileRows>{}, 0);
  } else {
    block(std::integral_constant<int, kTileRows / 2>{}, 0);
    block(std::integral_constant<int, kTileRows / 2>{}, kTileRows / 2);
  }
}

template <int R, int NR>
inline void reduce_into(Vec (&acc)[R][NR], int i0, float (*y)[kTileRows]) {
  UNROLL
  for (int r = 0; r < R; ++r)
    UNROLL
    for (int i = 0; i < NR; ++i)
      y[r][i0 + i] = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, acc[r][i]);
}

// acc = 0 (Vectorized's default constructor leaves its lanes unset).
template <int R, int NR>
inline void set_zero(Vec (&acc)[R][NR]) {
  UNROLL
  for (int r = 0; r < R; ++r)
    UNROLL
    for (int i = 0; i < NR; ++i) acc[r][i] = Vec(0.f);
}

// Group g of R rows of x (row stride k) as I::kVecs vectors a row.
template <typename I, int R>
inline void load_x_group(const float* x, int64_t k, int64_t g, Vec (&xv)[R][I::kVecs]) {
  UNROLL
  for (int r = 0; r < R; ++r)
    UNROLL
    for (int j = 0; j < I::kVecs; ++j) xv[r][j] = Vec::loadu(x + r * k + g * I::kGroup + j * VL);
}

// The fp32 blocks: the tile's weight rows i0 .. i0 + NR against R rows of x (row stride k), into
// y[r][i0 + i], over R x NR independent FMA chains.

// From the stored integers, widened once for the R rows; each group's dot is scaled once (the mins
// come from add_mins).
template <typename I, int R, int NR>
inline void scaled_block(const Tiles& w, const uint8_t* q, const TileScales& s, int i0, const float* x,
                         float (*y)[kTileRows]) {
  Vec acc[R][NR];
  set_zero(acc);
  for (int64_t g = 0; g < w.groups; ++g) {
    const uint8_t* qg = q + g * kTileRows * I::kBytes;
    if (i0 == 0) prefetch_group<I>(qg);
    const float* sg = s.scales + g * kTileRows;
    Vec xv[R][I::kVecs];
    load_x_group<I, R>(x, w.k, g, xv);
    UNROLL
    for (int i = 0; i < NR; ++i) {
      Vec qv[I::kVecs];
      I::load_row(qg, i0 + i, qv);
      const Vec scale(sg[i0 + i]);
      UNROLL
      for (int r = 0; r < R; ++r) {
        Vec d = qv[0] * xv[r][0];
        UNROLL
        for (int j = 1; j < I::kVecs; ++j) d = at::vec::fmadd(qv[j], xv[r][j], d);
        acc[r][i] = at::vec::fmadd(d, scale, acc[r][i]);
      }
    }
  }
  reduce_into(acc, i0, y);
}

// Dequantizing first pays once a group's integers meet more rows of x than the group has vectors:
// per weight row and group, scaling each dot costs R * (kVecs + 1) FMAs, dequantizing first
// kVecs + R * kVecs (and takes the min in the same FMA). Chosen for a full block of rows, whatever
// the rows of the call, so that a row's result does not depend on them (issue #66).
template <typename I>
constexpr bool kDequantFirst = kRowBlock > I::kVecs;

// Each group dequantized first, the mins with it.
template <typename I, int R, int NR>
inline void dequantizing_block(const Tiles& w, const uint8_t* q, const TileScales& s, int i0, const float* x,
                               float (*y)[kTileRows]) {
  Vec acc[R][NR];
  set_zero(acc);
  for (int64_t g = 0; g < w.groups; ++g) {
    if (i0 == 0) prefetch_group<I>(q + g * kTileRows * I::kBytes);
    Vec xv[R][I::kVecs];
    load_x_group<I, R>(x, w.k, g, xv);
    UNROLL
    for (int i = 0; i < NR; ++i) {
      Vec wv[I::kVecs];
      dequantize_group<I>(q, s, g, i0 + i, wv);
      UNROLL
      for (int r = 0; r < R; ++r)
        UNROLL
        for (int j = 0; j < I::kVecs; ++j) acc[r][i] = at::vec::fmadd(wv[j], xv[r][j], acc[r][i]);
    }
  }
  reduce_into(acc, i0, y);
}

// y[i] += sum_g mins[g][i] * xsums[g][i] for a tile's rows i, as products of two runs of floats
// (the min's contribution: min * the sum of x over the group).
inline void add_mins(const float* mins, const float* xsums, int64_t count, float* y) {
  static_assert(VL % kTileRows == 0, "a vector holds whole groups");
  Vec acc[2] = {Vec(0.f), Vec(0.f)};
  int64_t i = 0;
  for (; i + 2 * VL <= count; i += 2 * VL)
    UNROLL
    for (int h = 0; h < 2; ++h) acc[h] = at::vec::fmadd(Vec::loadu(mins + i + h * VL), Vec::loadu(xsums + i + h * VL), acc[h]);
  for (; i < count; i += VL) {
    const int n = static_cast<int>(std::min<int64_t>(VL, count - i));
    acc[0] = at::vec::fmadd(Vec::loadu(mins + i, n), Vec::loadu(xsums + i, n), acc[0]);
  }
  float lanes[VL];
  (acc[0] + acc[1]).store(lanes);
  for (int l = 0; l < VL; ++l) y[l % kTileRows] += lanes[l];
}

// Tiles a thread's share holds at least (over_tiles, over_tile_runs).
inline int64_t tile_grain(const Tiles& w) { return std::max<int64_t>(2, 4096 / w.k); }

// y's rows r0 .. r0 + rows of tile t into out (in x's dtype O, nearest even, as Tensor::to).
template <typename O>
inline void store_tile(const Tiles& w, int64_t t, int64_t r0, int64_t rows, const float (*y)[kTileRows], O* out) {
  for (int64_t r = 0; r < rows; ++r)
    for (int i = 0; i < kTileRows && t * kTileRows + i < w.n; ++i)
      out[(r0 + r) * w.n + t * kTileRows + i] = static_cast<O>(y[r][i]);
}

// Threads split the tiles in equal shares, not by chunk_queue.h's chunks: few rows of x are bound
// by memory, and the chunks made a one-row decode step 1.14x as long (likely each new chunk
// restarting the prefetchers' streams; 2-core Xeon, bench/engine/engine_steps_ab.py). A thread meets each
// of its tiles with all m rows of x, kRowBlock rows at a time: block(s, tile, wt, r0, rows, y)
// fills y[r][0 .. kTileRows) for x's rows r0 .. r0 + rows from the tile (its scales widened to
// fp32 in s where kWiden); wt: the thread's scratch of `scratch` Ts, or nullptr. out is in x's
// dtype O, so no call converts a whole output.
template <typename T, bool kWiden = true, typename O, typename Block>
void over_tiles(const Tiles& w, int64_t m, int64_t scratch, O* out, const Block& block) {
  at::parallel_for(0, w.tiles, tile_grain(w), [&](int64_t t0, int64_t t1) {
    std::vector<float> sbuf(kWiden ? 2 * w.scale_count() : 0);
    std::vector<T> wt(scratch);
    float y[kRowBlock][kTileRows];
    for (int64_t t = t0; t < t1; ++t) {
      const uint8_t* tile = w.tile(t);
      const TileScales s = kWiden ? TileScales(w, tile, sbuf.data()) : TileScales();
      for (int64_t r0 = 0; r0 < m; r0 += kRowBlock) {
        const int64_t rows = std::min<int64_t>(kRowBlock, m - r0);
        block(s, tile, wt.empty() ? nullptr : wt.data(), r0, rows, y);
        store_tile(w, t, r0, rows, y, out);
      }
    }
  });
}

// over_tiles for a method that meets up to Run consecutive tiles at once, their scales as stored:
// block(t, run, r0, rows, y) fills y[j][r][0 .. kTileRows) for tiles t .. t + run and x's rows
// r0 .. r0 + rows. A thread's run of tiles meets all m rows of x, kRowBlock rows at a time.
template <int Run, typename O, typename Block>
void over_tile_runs(const Tiles& w, int64_t m, O* out, const Block& block) {
  at::parallel_for(0, w.tiles, tile_grain(w), [&](int64_t t0, int64_t t1) {
    float y[Run][kRowBlock][kTileRows];
    for (int64_t t = t0; t < t1; t += Run) {
      const int run = static_cast<int>(std::min<int64_t>(Run, t1 - t));
      for (int64_t r0 = 0; r0 < m; r0 += kRowBlock) {
        const int64_t rows = std::min<int64_t>(kRowBlock, m - r0);
        block(t, run, r0, rows, y);
        for (int j = 0; j < run; ++j) store_tile(w, t + j, r0, rows, y[j], out);
      }
    }
  });
}

// x's sum over each group of G, kTileRows times over (the layout of a tile's mins): [m][G][kTileRows].
inline std::vector<float> group_sums(const float* x, int64_t m, int64_t k, int64_t group) {
  std::vector<float> sums(m * k / group * kTileRows);
  for (int64_t i = 0; i < static_cast<int64_t>(sums.size()) / kTileRows; ++i)
    std::fill_n(sums.data() + i * kTileRows, kTileRows,
                at::vec::reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, x + i * group, group));
  return sums;
}

// fp32 x in registers, each block of rows by its method (kDequantFirst).
template <typename I, typename O>
void registers(const Tiles& w, const float* x, int64_t m, O* out) {
  // x's sum over each group, kTileRows times over (the layout of a tile's mins), for add_mins
  const bool sums = w.has_mins && !kDequantFirst<I>;
  const std::vector<float> xsums = sums ? group_sums(x, m, w.k, I::kGroup) : std::vector<float>();
  over_tiles<float>(w, m, 0, out,
                    [&](const TileScales& s, const uint8_t* tile, float*, int64_t r0, int64_t rows, float(*y)[kTileRows]) {
    const uint8_t* q = w.ints(tile);
    const float* xr = x + r0 * w.k;
    with_rows_upto<kRowBlock>(rows, [&](auto R) {
      if constexpr (kDequantFirst<I>) {
        over_weight_rows<R>([&](auto NR, int i0) { dequantizing_block<I, R, NR>(w, q, s, i0, xr, y); });
      } else {
        over_weight_rows<R>([&](auto NR, int i0) { scaled_block<I, R, NR>(w, q, s, i0, xr, y); });
        if (s.mins)
          for (int r = 0; r < R; ++r) add_mins(s.mins, xsums.data() + (r0 + r) * w.scale_count(), w.scale_count(), y[r]);
      }
    });
  });
}

#if defined(__AVX512BF16__)
// bf16 x, R rows against a whole tile: 32 weights of a row at a time (one group or two) dequantized
// in fp32, rounded to bf16 (as the dense bf16 GEMM's weights are) and kept in wt where given, or
// read back from wt (kFromScratch); multiplied by vdpbf16ps, 32 products summed in fp32 each.
template <typename I, int R, bool kFromScratch>
inline void bf16_block(const Tiles& w, const uint8_t* q, const TileScales& s, const at::BFloat16* x,
                       at::BFloat16* wt, float (*y)[kTileRows]) {
  static_assert(VL == 16, "AVX-512 only");
  __m512 acc[R][kTileRows];
  UNROLL
  for (int r = 0; r < R; ++r)
    UNROLL
    for (int i = 0; i < kTileRows; ++i) acc[r][i] = _mm512_setzero_ps();
  const int64_t k = w.k;
  for (int64_t c = 0; c < k; c += 32) {
    if constexpr (!kFromScratch) prefetch_32<I>(q, c);
    __m512bh wv[kTileRows];
    UNROLL
    for (int i = 0; i < kTileRows; ++i) {
      if constexpr (kFromScratch) {
        wv[i] = reinterpret_cast<__m512bh>(_mm512_loadu_si512(wt + i * k + c));
      } else {
        wv[i] = dequantize_bf16<I>(q, s, c, i);
        if (wt) _mm512_storeu_si512(wt + i * k + c, reinterpret_cast<__m512i>(wv[i]));
      }
    }
    UNROLL
    for (int r = 0; r < R; ++r) {
      const __m512bh xv = reinterpret_cast<__m512bh>(_mm512_loadu_si512(x + r * k + c));
      UNROLL
      for (int i = 0; i < kTileRows; ++i) acc[r][i] = _mm512_dpbf16_ps(acc[r][i], xv, wv[i]);
    }
  }
  UNROLL
  for (int r = 0; r < R; ++r)
    UNROLL
    for (int i = 0; i < kTileRows; ++i) y[r][i] = _mm512_reduce_add_ps(acc[r][i]);
}

// bf16 x with more rows than a group has vectors: the first kRowBlock rows dequantize each tile into
// the thread's scratch (where there are more rows), the later ones read it.
template <typename I>
void bf16_registers(const Tiles& w, const at::BFloat16* x, int64_t m, at::BFloat16* out) {
  over_tiles<at::BFloat16>(w, m, m > kRowBlock ? kTileRows * w.k : 0, out,
                           [&](const TileScales& s, const uint8_t* tile, at::BFloat16* wt, int64_t r0, int64_t rows,
                               float(*y)[kTileRows]) {
    const uint8_t* q = w.ints(tile);
    with_rows_upto<kRowBlock>(rows, [&](auto R) {
      if (r0 == 0)
        bf16_block<I, R, false>(w, q, s, x, wt, y);
      else
        bf16_block<I, R, true>(w, q, s, x + r0 * w.k, wt, y);
    });
  });
}
#endif

}  // namespace kaiten::quant
