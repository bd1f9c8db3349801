// kaiten_cpu::quant_linear (../quant_linear_cpu.cpp): int8 activations on AMX tiles, for the rows the int8 panel
// GEMM serves, with its bits.
#pragma once

#include "amx.h"
#include "int8_panel.h"

namespace kaiten::quant {

#if defined(KAITEN_INT8_ACTIVATIONS) && defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__AVX512VNNI__)
#define KAITEN_AMX_INT8 1

// Whether this process may use AMX's int8 products: amx_ready() and the CPU's AMX-INT8 (CPUID 7.0 EDX bit 25).
inline bool amx_int8_ready() {
  static const bool ready = [] {
    unsigned a, b, c, d;
    return amx_ready() && __get_cpuid_count(7, 0, &a, &b, &c, &d) && (d & (1u << 25));
  }();
  return ready;
}

// The int8 panel GEMM with each group's integer dots on the tiles: Int8Panel's panels as they lie
// are tdpbsud's B tiles (a quad of inputs by weight row is a tile row of 64 bytes, half a panel:
// G / 4 rows, 128 bytes apart), x's records its A tiles (kRows rows of a group's G integers, a
// record apart). tdpbsud multiplies signed x by the panel's unsigned bytes (int4 as 0-15, int8 as
// w + 128) and sums exactly, so a group's dots are vpdpbusd's. A chunk of kChunk groups is
// multiplied first, a C tile a group and half panel, stored as int32; then each output's
// accumulator scales the chunk's dots in by scale_group, as Int8Panel::rows does, group after group, so every
// output has Int8Panel's and int8_block's bits. Tiles: A and B two each, alternating, C four, so
// that no load waits for the product before it and two products run while one is stored.
// The epilogue bounds it: a convert, a multiply and two FMAs an output and group (int8_block's
// arithmetic), where the tiles' products cost little; so it runs at 1.08-1.19x the vector panel's
// rate at 256 rows, not at AMX bf16's (kAmxInt8Rows in ../quant_linear_cpu.cpp).
template <typename I, typename O>
struct AmxInt8Panel : Int8Panel<I, O> {
  using Base = Int8Panel<I, O>;
  using Base::G;
  using Base::kPanel;
  static constexpr int kRows = 16, kChunk = 8;
  static_assert(!Base::kCorr && kPanel == 32, "the VNNI panel: 32 weight rows, no start values");
  alignas(64) int32_t dots[kChunk][2][kRows * 16];    // [group][half panel][row of x][weight row]
  alignas(64) float acc[kRows][kPanel];

  explicit AmxInt8Panel(const Tiles& w) : Base(w) {
    TileConfig cfg;
    for (int t = 0; t < 8; ++t) {     // A 0-1, B 2-3, C 4-7
      cfg.rows[t] = t / 2 == 1 ? G / 4 : kRows;
      cfg.colsb[t] = t / 2 == 0 ? G : 64;
    }
    _tile_loadconfig(&cfg);
  }
  ~AmxInt8Panel() { _tile_release(); }
  AmxInt8Panel(const AmxInt8Panel&) = delete;
  AmxInt8Panel& operator=(const AmxInt8Panel&) = delete;

  // Groups [g0, g1)'s dots of kRows rows of x into dots: item j is half panel j / count and group
  // g0 + j % count; its product is stored two items later, so that two products are in flight
  // while one is stored. (Tile numbers must be literals.)
  void multiply(const uint8_t* panel, const int8_t* x, int64_t ld, int64_t g0, int64_t g1) {
    const int64_t gs = Base::group_size(this->mins), head = Base::head_size(this->mins);
    const int64_t count = g1 - g0, items = 2 * count;
    const auto item_dots = [&](int64_t j) { return dots[j % count][j / count]; };
#define KAITEN_AMX_INT8_ITEM(A, B, C, C_STORE)                                                 \
    do {                                                                                        \
      const int64_t g = g0 + j % count, h = j / count;                                          \
      _tile_loadd(A, x + g * G, ld);                                                            \
      _tile_loadd(B, panel + g * gs + head + 64 * h, Base::kQuadBytes);                         \
      _tile_zero(C);                                                                            \
      _tile_dpbsud(C, A, B);                                                                    \
      if (j >= 2) _tile_stored(C_STORE, item_dots(j - 2), 64);                                  \
    } while (0)
    for (int64_t j = 0; j < items; ++j) {
      switch (j % 4) {
        case 0: KAITEN_AMX_INT8_ITEM(0, 2, 4, 6); break;
        case 1: KAITEN_AMX_INT8_ITEM(1, 3, 5, 7); break;
        case 2: KAITEN_AMX_INT8_ITEM(0, 2, 6, 4); break;
        default: KAITEN_AMX_INT8_ITEM(1, 3, 7, 5); break;
      }
    }
#undef KAITEN_AMX_INT8_ITEM
    // the last two items' products: C tiles 4 + (items - 2) % 4 and 4 + (items - 1) % 4
    if (items % 4 == 2) {
      _tile_stored(4, item_dots(items - 2), 64);
      _tile_stored(5, item_dots(items - 1), 64);
    } else {
      _tile_stored(6, item_dots(items - 2), 64);
      _tile_stored(7, item_dots(items - 1), 64);
    }
  }

  // The dots of groups [g0, g1) scaled into acc, group after group, kBlock rows of x at a time
  // (their 2 x kBlock accumulators in registers, independent chains).
  template <int MR>
  void scale(const uint8_t* panel, const int8_t* x, int64_t ld, int64_t g0, int64_t g1) {
    constexpr int kBlock = 4;
    const int64_t gs = Base::group_size(this->mins), k = this->k;
    const bool mins = this->mins;
    for (int r0 = 0; r0 < MR; r0 += kBlock) {
      const float* d[kBlock];
      RawVec a[kBlock][2];
      for (int i = 0; i < kBlock; ++i) {
        d[i] = reinterpret_cast<const float*>(x + (r0 + i) * ld + k);     // past MR: padding, not stored
        a[i][0] = Vec::loadu(acc[r0 + i]);
        a[i][1] = Vec::loadu(acc[r0 + i] + VL);
      }
      for (int64_t g = g0; g < g1; ++g) {
        const uint8_t* pg = panel + g * gs;
        const Vec s0 = Vec::loadu(pg), s1 = Vec::loadu(pg + 4 * VL);
        const int32_t* dg0 = dots[g - g0][0] + 16 * r0;
        const int32_t* dg1 = dots[g - g0][1] + 16 * r0;
        UNROLL
        for (int i = 0; i < kBlock; ++i) {
          const Vec dx(d[i][g * G / 32]);
          a[i][0] = scale_group(to_float(_mm512_load_si512(dg0 + 16 * i)), s0, dx, Vec(a[i][0]), mins,
                                pg + 4 * kPanel, d[i] + k / 32 + g);
          a[i][1] = scale_group(to_float(_mm512_load_si512(dg1 + 16 * i)), s1, dx, Vec(a[i][1]), mins,
                                pg + 4 * kPanel + 4 * VL, d[i] + k / 32 + g);
        }
      }
      for (int i = 0; i < kBlock; ++i) {
        Vec(a[i][0]).store(acc[r0 + i]);
        Vec(a[i][1]).store(acc[r0 + i] + VL);
      }
    }
  }

  template <int MR>
  void rows(const uint8_t* panel, const int8_t* x, int64_t ld, int64_t rows, O* out, int64_t n, int64_t n0) {
    std::fill_n(&acc[0][0], kRows * kPanel, 0.f);
    for (int64_t g0 = 0; g0 < this->groups; g0 += kChunk) {
      const int64_t g1 = std::min<int64_t>(this->groups, g0 + kChunk);
      multiply(panel, x, ld, g0, g1);
      scale<MR>(panel, x, ld, g0, g1);
    }
    const int cols = static_cast<int>(std::min<int64_t>(kPanel, n - n0));
    for (int64_t r = 0; r < rows; ++r) {
      store_as(Vec::loadu(acc[r]), out + r * n + n0, std::min(VL, cols));
      if (cols > VL) store_as(Vec::loadu(acc[r] + VL), out + r * n + n0 + VL, cols - VL);
    }
  }
};
#endif

}  // namespace kaiten::quant
