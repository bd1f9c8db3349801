// kaiten_cpu::quant_linear (../quant_linear_cpu.cpp): int8 activations, up to kInt8BlockRows rows of x a row at a time
// against each tile (int8_block).
#pragma once

#include "int8_x.h"
#include "registers.h"

namespace kaiten::quant {

#if defined(KAITEN_INT8_ACTIVATIONS)
// A group's 4 weight rows fill NZ integer vectors, each row lanes_of_row(NZ) int32 lanes of them.
constexpr int lanes_of_row(int nz) { return kIntLanes * nz / kTileRows; }

// The row that each of those lanes' dots belongs to.
template <int NZ>
struct RowOfLane {
  alignas(64) int32_t row[NZ][kIntLanes] = {};
  constexpr RowOfLane() {
    for (int j = 0; j < NZ; ++j)
      for (int l = 0; l < kIntLanes; ++l) row[j][l] = (j * kIntLanes + l) / lanes_of_row(NZ);
  }
};
template <int NZ>
constexpr RowOfLane<NZ> kRowOfLane{};

// R rows of x (from r0) against a tile, into y[r][i].
template <typename I, int R>
inline void int8_block(const Tiles& w, const uint8_t* tile, const Int8Rows& x, int64_t r0, float (*y)[kTileRows]) {
  constexpr int G = I::kGroup;
  constexpr int NZ = kTileRows * I::kBytes / sizeof(IVec);   // vectors of a group's 4 rows
  constexpr int L = lanes_of_row(NZ);
  const uint8_t* mins = w.has_mins ? tile + w.scale_count() * w.scale_bytes : nullptr;
  const uint8_t* q = w.ints(tile);
  IVec row_of_lane[NZ];
  UNROLL
  for (int j = 0; j < NZ; ++j) row_of_lane[j] = iload(kRowOfLane<NZ>.row[j]);
  Vec acc[R][NZ];
  __m128 macc[R];
  UNROLL
  for (int r = 0; r < R; ++r) {
    macc[r] = _mm_setzero_ps();
    UNROLL
    for (int j = 0; j < NZ; ++j) acc[r][j] = Vec(0.f);
  }
  for (int64_t g = 0; g < w.groups; ++g) {
    const __m128 s4 = load4(tile, w.scale_bytes, g);
    Vec sv[NZ];
    UNROLL
    for (int j = 0; j < NZ; ++j) sv[j] = spread4(s4, row_of_lane[j]);
    const uint8_t* qg = q + g * kTileRows * I::kBytes;
    prefetch_group<I>(qg);
    IVec wv[NZ];
    UNROLL
    for (int j = 0; j < NZ; ++j) wv[j] = iload(qg + j * sizeof(IVec));
    const __m128 m4 = mins ? load4(mins, w.scale_bytes, g) : _mm_setzero_ps();
    UNROLL
    for (int r = 0; r < R; ++r) {
      const int64_t row = r0 + r;
      const int8_t* xg = x.q.data() + row * x.k + g * G;
      const Vec dx(x.d[(row * x.k + g * G) / 32]);
      IVec dot[NZ];
      if constexpr (I::kInt4) {
        const IVec x0 = bcast16(xg), x1 = bcast16(xg + 16);     // elements 0-15 (low nibbles), 16-31
        UNROLL
        for (int j = 0; j < NZ; ++j) dot[j] = dot_u4(low_nibbles(wv[j]), x0, high_nibbles(wv[j]), x1);
      } else {
        const IVec xb = G == 32 ? bcast32(xg) : bcast16(xg);
        const IVec c = kVnni ? iload(x.corr.data() + (row * x.groups + g) * kIntLanes) : IVec{};
        UNROLL
        for (int j = 0; j < NZ; ++j) dot[j] = dot_s8(c, wv[j], xb);
      }
      UNROLL
      for (int j = 0; j < NZ; ++j) acc[r][j] = at::vec::fmadd(to_float(dot[j]), sv[j] * dx, acc[r][j]);
      if (mins) macc[r] = _mm_fmadd_ps(m4, _mm_set1_ps(x.sums[row * x.groups + g]), macc[r]);
    }
  }
  UNROLL
  for (int r = 0; r < R; ++r) {
    float lanes[NZ * VL], m[kTileRows];
    UNROLL
    for (int j = 0; j < NZ; ++j) acc[r][j].store(lanes + VL * j);
    _mm_storeu_ps(m, macc[r]);
    UNROLL
    for (int i = 0; i < kTileRows; ++i) {
      float sum = m[i];
      UNROLL
      for (int l = 0; l < L; ++l) sum += lanes[i * L + l];
      y[r][i] = sum;
    }
  }
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
