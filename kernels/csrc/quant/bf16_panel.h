// kaiten_cpu::quant_linear (../quant_linear_cpu.cpp): bf16 x on the panel GEMM with AVX512-BF16: panels rounded to
// bf16, multiplied by vdpbf16ps.
#pragma once

#include "panel_gemm.h"

namespace kaiten::quant {

#if defined(__AVX512BF16__)
// Words p of 16 rows, r[i] = words 0-15 of row i, into r[p] = word p of rows 0-15.
inline void transpose16(__m512i (&r)[16]) {
  __m512i t[16];
  UNROLL
  for (int i = 0; i < 8; ++i) {        // pairs of rows: lane L = words 4L, 4L+1 (lo) or 4L+2, 4L+3 (hi) of both
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  UNROLL
  for (int i = 0; i < 4; ++i) {        // r[4i + c], lane L: word 4L + c of rows 4i .. 4i + 3
    r[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  UNROLL
  for (int c = 0; c < 4; ++c) {        // lane L of the 4 groups of rows into word 4L + c
    const __m512i u0 = _mm512_shuffle_i32x4(r[c], r[4 + c], 0x44), u1 = _mm512_shuffle_i32x4(r[c], r[4 + c], 0xEE);
    const __m512i v0 = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0x44), v1 = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0xEE);
    t[c] = _mm512_shuffle_i32x4(u0, v0, 0x88);
    t[4 + c] = _mm512_shuffle_i32x4(u0, v0, 0xDD);
    t[8 + c] = _mm512_shuffle_i32x4(u1, v1, 0x88);
    t[12 + c] = _mm512_shuffle_i32x4(u1, v1, 0xDD);
  }
  UNROLL
  for (int i = 0; i < 16; ++i) r[i] = t[i];
}

// bf16 x on AVX512-BF16: panels of 32 weight rows dequantized and rounded to bf16 (as the dense
// bf16 GEMM rounds its weights) as vdpbf16ps's operand, pairs of inputs by weight row ([k / 2][32]
// 32-bit words; a 16 x 16 word transpose), met by a row of x's pairs, 32 products a vdpbf16ps
// summed in fp32, 12 rows of x a pass; the output rounded to bf16.
struct Bf16Panel {
  using X = uint32_t;               // a row of x as pairs of bf16 inputs
  using Out = at::BFloat16;
  using P = uint32_t;
  static constexpr int kPanel = 32, kRows = 12;
  std::vector<float> sbuf;

  explicit Bf16Panel(const Tiles& w) : sbuf(16 / kTileRows * 2 * w.scale_count()) {}
  static int64_t panel_size(const Tiles& w) { return w.k / 2 * kPanel; }

  template <typename I>
  void pack(const Tiles& w, int64_t t0, uint32_t* panel) {
    constexpr int kTiles = 16 / kTileRows;     // a half of the panel: 16 rows
    for (int half = 0; half < kPanel / 16; ++half) {
      TileScales s[kTiles];
      const uint8_t* q[kTiles] = {};
      for (int tt = 0; tt < kTiles; ++tt) {
        const int64_t t = t0 + half * kTiles + tt;
        if (t >= w.tiles) continue;
        s[tt] = TileScales(w, w.tile(t), sbuf.data() + tt * 2 * w.scale_count());
        q[tt] = w.ints(w.tile(t));
      }
      for (int64_t c = 0; c < w.k; c += 32) {
        __m512i r[16];
        for (int tt = 0; tt < kTiles; ++tt) {
          if (!q[tt]) {
            UNROLL
            for (int i = 0; i < kTileRows; ++i) r[tt * kTileRows + i] = _mm512_setzero_si512();
            continue;
          }
          prefetch_32<I>(q[tt], c);
          UNROLL
          for (int i = 0; i < kTileRows; ++i) r[tt * kTileRows + i] = reinterpret_cast<__m512i>(dequantize_bf16<I>(q[tt], s[tt], c, i));
        }
        transpose16(r);
        UNROLL
        for (int p = 0; p < 16; ++p) _mm512_storeu_si512(panel + (c / 2 + p) * kPanel + half * 16, r[p]);
      }
    }
  }

  template <int MR>
  void rows(const uint32_t* panel, const uint32_t* x, int64_t words, int64_t rows, at::BFloat16* out, int64_t n,
            int64_t n0) const {
    __m512 acc[MR][2];
    UNROLL
    for (int r = 0; r < MR; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    for (int64_t p = 0; p < words; ++p) {
      const __m512bh w0 = reinterpret_cast<__m512bh>(_mm512_loadu_si512(panel + p * kPanel));
      const __m512bh w1 = reinterpret_cast<__m512bh>(_mm512_loadu_si512(panel + p * kPanel + 16));
      UNROLL
      for (int r = 0; r < MR; ++r) {
        const __m512bh xv = reinterpret_cast<__m512bh>(_mm512_set1_epi32(static_cast<int>(x[r * words + p])));
        acc[r][0] = _mm512_dpbf16_ps(acc[r][0], xv, w0);
        acc[r][1] = _mm512_dpbf16_ps(acc[r][1], xv, w1);
      }
    }
    const int64_t cols = std::min<int64_t>(kPanel, n - n0);
    const __mmask16 m0 = static_cast<__mmask16>((1u << std::min<int64_t>(16, cols)) - 1);
    const __mmask16 m1 = static_cast<__mmask16>((1u << std::max<int64_t>(0, cols - 16)) - 1);
    UNROLL
    for (int r = 0; r < MR; ++r) {      // constant indices keep acc in registers
      if (r < rows) {
        at::BFloat16* o = out + r * n + n0;
        _mm256_mask_storeu_epi16(o, m0, reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(acc[r][0])));
        _mm256_mask_storeu_epi16(o + 16, m1, reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(acc[r][1])));
      }
    }
  }
};

template <typename K, typename I>
at::Tensor bf16_gemm(const Tiles& w, const at::Tensor& x) {
  const at::Tensor xc = x.contiguous();
  at::Tensor out = at::empty({x.size(0), w.n}, x.options());
  panel_gemm<K, I>(w, reinterpret_cast<const uint32_t*>(xc.data_ptr<at::BFloat16>()), x.size(0), w.k / 2,
                   out.data_ptr<at::BFloat16>());
  return out;
}
#endif

}  // namespace kaiten::quant
