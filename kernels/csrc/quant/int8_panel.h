// kaiten_cpu::quant_linear (../quant_linear_cpu.cpp): int8 activations on the panel GEMM, for more rows than
// int8_block serves well.
#pragma once

#include <cstring>
#include <vector>

#include "int8_x.h"
#include "panel_gemm.h"

namespace kaiten::quant {

#if defined(KAITEN_INT8_ACTIVATIONS)
// The int8 panel GEMM: int8 activations for more rows than int8_block serves well. x's rows are
// rounded as quantize_rows rounds them, each into a record of x_record_bytes(): its k integers
// (plus 64 where the panel meets them unsigned, x_unsigned), then per block of 32 its scale
// (fp32) and per weight group the rounded x's sum (fp32, where the panel has mins: their factor). Zero records are zero rows, so panel_gemm's padded tail needs
// nothing more (their products are not stored). A panel is
// 2 x kIntLanes weight rows, per group their scales and mins (fp32), then the group's integers
// by quads of inputs, [G / 4][kPanel][4] bytes, so one vector holds 4 inputs of kIntLanes weight
// rows and meets 4 bytes of a row of x broadcast to every lane: int4 as bytes 0-15 (vpmaddubsw
// pairs summed in int16 over a group: 8 x 2 x 15 x 127 fits; with VNNI vpdpbusd); int8 with VNNI
// as w + 128, and the panel's mins less 128 times the scales take back what that adds, in fp32
// with the weight's own mins (an int32 correction per row and group before the scaling made GCC
// spill the 24 accumulators, half the speed on a Zen 4); int8 without VNNI signed as stored,
// against x's 7-bit integers as x + 64 (x_levels), each quad by vpmaddubsw and vpmaddwd, and the
// group's dots start from -64 times each row's sum of the group's integers, stored after the
// scales and mins. Per group each row's int32 dots are scaled into fp32 accumulators, as in
// int8_block, and the output is written in x's dtype.
inline int64_t x_record_bytes(const Tiles& w) { return (w.k + 4 * (w.k / 32) + 4 * w.groups + 63) / 64 * 64; }

// Whether the int8 panel meets x as unsigned x + 64: int8 weights without VNNI (7-bit x).
template <typename I>
constexpr bool x_unsigned() { return x_levels<I>() == 63; }

template <typename I>
std::vector<int8_t> x_records(const Tiles& w, const float* x, int64_t m) {
  constexpr int G = I::kGroup;
  const int64_t ld = x_record_bytes(w);
  std::vector<int8_t> rec(m * ld);
  at::parallel_for(0, m, std::max<int64_t>(1, 16384 / w.k), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      int8_t* q = rec.data() + r * ld;
      float* d = reinterpret_cast<float*>(q + w.k);
      round_blocks(x + r * w.k, w.k / 32, x_levels<I>(), q, d);
      if (panel_mins<I>(w)) scaled_group_sums<G>(q, d, w.groups, d + w.k / 32);
      if constexpr (x_unsigned<I>())
        for (int64_t i = 0; i < w.k; ++i) q[i] = static_cast<int8_t>(q[i] + 64);
    }
  });
  return rec;
}

// 4 bytes of x in every int32 lane.
inline IVec bcast_quad(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
#if defined(CPU_CAPABILITY_AVX512)
  return _mm512_set1_epi32(v);
#else
  return _mm256_set1_epi32(v);
#endif
}

// The sum of a group's G signed weight bytes q (G: 16 or 32).
template <int G>
inline int32_t group_sum(const uint8_t* q) {
  const __m128i bias = _mm_set1_epi8(static_cast<char>(0x80));
  __m128i s = _mm_sad_epu8(_mm_xor_si128(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q)), bias), _mm_setzero_si128());
  if constexpr (G == 32)
    s = _mm_add_epi64(s, _mm_sad_epu8(_mm_xor_si128(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16)), bias),
                                      _mm_setzero_si128()));
  return static_cast<int32_t>(_mm_cvtsi128_si64(s) + _mm_extract_epi64(s, 1)) - 128 * G;
}

// acc plus the dots of a panel's weight bytes w with a quad of x in every lane: int16 pairs for
// int4 without VNNI (group_dot widens them), else int32.
template <typename I>
inline IVec quad_dot(IVec acc, IVec w, IVec xb) {
#if defined(__AVX512VNNI__)
  return _mm512_dpbusd_epi32(acc, w, xb);     // int8 weights stored as w + 128
#elif defined(CPU_CAPABILITY_AVX512)
  if constexpr (I::kInt4) return _mm512_add_epi16(acc, _mm512_maddubs_epi16(w, xb));
  return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(xb, w), _mm512_set1_epi16(1)));   // x + 64
#else
  if constexpr (I::kInt4) return _mm256_add_epi16(acc, _mm256_maddubs_epi16(w, xb));
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(xb, w), _mm256_set1_epi16(1)));   // x + 64
#endif
}

// Holds acc in a register as it is: GCC otherwise reassociates a group's quad_dot sums (integer
// adds) into a tree whose partial sums outgrow AVX2's 16 registers and spill (Zen 3, one thread,
// 256 rows: Q4_1 74-77 GMAC/s with the tree, 83-86 without; Q8_0 47-56, then 56-58).
inline void in_order(IVec& acc) { __asm__("" : "+v"(acc)); }

// A group's int32 dots from quad_dot's sums.
template <typename I>
inline IVec group_dot(IVec dot) {
#if defined(__AVX512VNNI__)
  return dot;
#elif defined(CPU_CAPABILITY_AVX512)
  return I::kInt4 ? _mm512_madd_epi16(dot, _mm512_set1_epi16(1)) : dot;
#else
  return I::kInt4 ? _mm256_madd_epi16(dot, _mm256_set1_epi16(1)) : dot;
#endif
}

// A group's dots (int32 as fp32) of 16 weight rows scaled into acc: dot * (s * dx) + acc, then min *
// sum where the panel has mins (min: the panel's 16 fp32 mins, sum: x's group sum). Every int8
// panel kernel scales by this one expression, in group order, for int8_block's bits.
inline Vec scale_group(Vec dot, Vec s, Vec dx, Vec acc, bool mins, const uint8_t* min, const float* sum) {
  const Vec f = at::vec::fmadd(dot, s * dx, acc);
  return mins ? at::vec::fmadd(Vec::loadu(min), Vec(*sum), f) : f;
}

template <typename I, typename O>
struct Int8Panel {
  using X = int8_t;
  using Out = O;
  using P = uint8_t;
  static constexpr int G = I::kGroup;
  static constexpr bool kCorr = x_unsigned<I>();   // a group's dots start from -64 times its sums
  static constexpr int kPanel = 2 * kIntLanes;
  // rows of x a pass: two integer accumulators each, besides the two weight vectors, x's quad and
  // a product, in AVX2's 16 or AVX-512's 32 registers
  static constexpr int kRows = kIntLanes == 16 ? 12 : 6;
  static constexpr int64_t kQuadBytes = 4 * kPanel;   // a quad of inputs of the panel's rows
  int64_t k, groups;
  bool mins;
  std::vector<float> sbuf;

  explicit Int8Panel(const Tiles& w) : k(w.k), groups(w.groups), mins(panel_mins<I>(w)), sbuf(2 * w.scale_count()) {}
  // a group's bytes before its integers: scales, mins, then the dots' starting values (4 bytes a row)
  static int64_t start_offset(bool has_mins) { return 4 * kPanel * (has_mins ? 2 : 1); }
  static int64_t head_size(bool has_mins) { return start_offset(has_mins) + (kCorr ? 4 * kPanel : 0); }
  static int64_t group_size(bool has_mins) { return head_size(has_mins) + G / 4 * kQuadBytes; }
  static int64_t panel_size(const Tiles& w) { return w.groups * group_size(panel_mins<I>(w)); }

  template <typename>
  void pack(const Tiles& w, int64_t t0, uint8_t* panel) {
    const int64_t gs = group_size(mins);
    for (int tt = 0; tt < kPanel / kTileRows; ++tt) {
      const bool real = t0 + tt < w.tiles;
      const uint8_t* tile = real ? w.tile(t0 + tt) : nullptr;
      const TileScales s = real ? TileScales(w, tile, sbuf.data()) : TileScales();
      for (int64_t g = 0; g < w.groups; ++g) {
        float* sc = reinterpret_cast<float*>(panel + g * gs);
        for (int i = 0; i < kTileRows; ++i) {
          const float scale = real ? s.scales[g * kTileRows + i] : 0.f;
          sc[tt * kTileRows + i] = scale;
          if (mins)
            sc[kPanel + tt * kTileRows + i] = (real && w.has_mins ? s.mins[g * kTileRows + i] : 0.f) -
                                              (panel_biased<I>() ? 128.f * scale : 0.f);
        }
        const uint8_t* q = real ? w.ints(tile) + g * kTileRows * I::kBytes : nullptr;
        alignas(32) uint8_t widened[kTileRows * 32];
        if constexpr (I::kFive) {    // the 5-bit rows as the int8 tiles' bytes
          for (int j = 0; q && j < kTileRows / 2; ++j) {
            __m256i a, b;
            I::pair_int8s(q, j, a, b);
            _mm256_store_si256(reinterpret_cast<__m256i*>(widened + 64 * j), a);
            _mm256_store_si256(reinterpret_cast<__m256i*>(widened + 64 * j + 32), b);
          }
          if (q) q = widened;
        }
        if constexpr (kCorr) {
          int32_t* start = reinterpret_cast<int32_t*>(panel + g * gs + start_offset(mins));
          for (int i = 0; i < kTileRows; ++i) start[tt * kTileRows + i] = q ? -64 * group_sum<G>(q + i * I::kInt8Bytes) : 0;
        }
        uint8_t* ints = panel + g * gs + head_size(mins) + tt * kTileRows * 4;
        if constexpr (G == 32)
          pack_group(q, ints);
        else
          for (int qd = 0; qd < G / 4; ++qd)
            for (int i = 0; i < kTileRows; ++i)
              for (int b = 0; b < 4; ++b)
                ints[qd * kQuadBytes + i * 4 + b] = real ? panel_byte(q[i * I::kInt8Bytes + 4 * qd + b]) : panel_byte(0);
      }
    }
  }

  // A weight byte as the panel holds it.
  static uint8_t panel_byte(uint8_t b) { return kVnni && !I::kInt4 ? b ^ 0x80 : b; }

  // A tile's group of 32 (4 rows' bytes, q; nullptr: zeros) into its 4 rows' quads of the panel:
  // a 4 x 8 transpose of 32-bit quads, quad qd of the 4 rows as 16 bytes at dst + qd * kQuadBytes.
  static void pack_group(const uint8_t* q, uint8_t* dst) {
    __m256i r[kTileRows];
    for (int i = 0; i < kTileRows; ++i) {
      if (!q) {
        r[i] = _mm256_set1_epi8(static_cast<char>(panel_byte(0)));
      } else if constexpr (I::kInt4) {   // byte j: element j (low nibble) and j + 16 (high)
        const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + i * 16)), lo4 = _mm_set1_epi8(0x0F);
        r[i] = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(b, 4), lo4), _mm_and_si128(b, lo4));
      } else {
        r[i] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + i * 32));
        if constexpr (kVnni) r[i] = _mm256_xor_si256(r[i], _mm256_set1_epi8(static_cast<char>(0x80)));
      }
    }
    // 128-bit lane h of the results: quads (a, a + 4) of rows 0-3, a = 0..3
    const __m256i lo01 = _mm256_unpacklo_epi32(r[0], r[1]), hi01 = _mm256_unpackhi_epi32(r[0], r[1]);
    const __m256i lo23 = _mm256_unpacklo_epi32(r[2], r[3]), hi23 = _mm256_unpackhi_epi32(r[2], r[3]);
    const __m256i quads[4] = {_mm256_unpacklo_epi64(lo01, lo23), _mm256_unpackhi_epi64(lo01, lo23),
                              _mm256_unpacklo_epi64(hi01, hi23), _mm256_unpackhi_epi64(hi01, hi23)};
    for (int a = 0; a < 4; ++a) {
      _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + a * kQuadBytes), _mm256_castsi256_si128(quads[a]));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + (a + 4) * kQuadBytes), _mm256_extracti128_si256(quads[a], 1));
    }
  }

  template <int MR>
  void rows(const uint8_t* panel, const int8_t* x, int64_t ld, int64_t rows, O* out, int64_t n, int64_t n0) const {
    const int64_t gs = group_size(mins);
    RawVec acc0[MR], acc1[MR];
    UNROLL
    for (int r = 0; r < MR; ++r) acc0[r] = acc1[r] = Vec(0.f);
    for (int64_t g = 0; g < groups; ++g) {
      const uint8_t* pg = panel + g * gs;
      const uint8_t* ints = pg + head_size(mins);
      const uint8_t* start = pg + start_offset(mins);
      IVec dot0[MR], dot1[MR];
      UNROLL
      for (int r = 0; r < MR; ++r) {
        dot0[r] = kCorr ? iload(start) : IVec{};
        dot1[r] = kCorr ? iload(start + sizeof(IVec)) : IVec{};
      }
      UNROLL
      for (int qd = 0; qd < G / 4; ++qd) {
        const uint8_t* quad = ints + qd * kQuadBytes;
        const IVec w0 = iload(quad), w1 = iload(quad + sizeof(IVec));
        UNROLL
        for (int r = 0; r < MR; ++r) {
          const IVec xb = bcast_quad(x + r * ld + g * G + 4 * qd);
          dot0[r] = quad_dot<I>(dot0[r], w0, xb);
          dot1[r] = quad_dot<I>(dot1[r], w1, xb);
          in_order(dot0[r]);
          in_order(dot1[r]);
        }
      }
      const Vec s0 = Vec::loadu(pg), s1 = Vec::loadu(pg + 4 * VL);
      UNROLL
      for (int r = 0; r < MR; ++r) {
        const float* d = reinterpret_cast<const float*>(x + r * ld + k);
        const Vec dx(d[g * G / 32]);
        acc0[r] = scale_group(to_float(group_dot<I>(dot0[r])), s0, dx, Vec(acc0[r]), mins, pg + 4 * kPanel, d + k / 32 + g);
        acc1[r] = scale_group(to_float(group_dot<I>(dot1[r])), s1, dx, Vec(acc1[r]), mins, pg + 4 * kPanel + 4 * VL,
                              d + k / 32 + g);
      }
    }
    const int cols = static_cast<int>(std::min<int64_t>(kPanel, n - n0));
    UNROLL
    for (int r = 0; r < MR; ++r) {
      if (r < rows) {
        store_as(Vec(acc0[r]), out + r * n + n0, std::min(VL, cols));
        if (cols > VL) store_as(Vec(acc1[r]), out + r * n + n0 + VL, cols - VL);
      }
    }
  }
};
#endif

}  // namespace kaiten::quant
