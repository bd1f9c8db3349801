// kaiten_cpu::quant_linear (../quant_linear_cpu.cpp): fp32 x on the panel GEMM: panels dequantized to fp32, FMAs.
#pragma once

#include "panel_gemm.h"

namespace kaiten::quant {

// fp32 x: panels of 2 VL weight rows, [k][2 VL] floats (each tile dequantized, then VL x VL blocks
// transposed), by FMAs; 12 rows of x a pass with AVX-512's 32 registers, 6 with AVX2's 16.
struct Fp32Panel {
  using X = float;
  using Out = float;
  using P = float;
  static constexpr int kPanel = 2 * VL, kRows = VL == 16 ? 12 : 6;
  std::vector<float> sbuf, rows_buf;     // rows_buf: the panel's rows [kPanel][k]

  explicit Fp32Panel(const Tiles& w) : sbuf(2 * w.scale_count()), rows_buf(kPanel * w.k) {}
  static int64_t panel_size(const Tiles& w) { return w.k * kPanel; }

  template <typename I>
  void pack(const Tiles& w, int64_t t0, float* panel) {
    for (int tt = 0; tt < kPanel / kTileRows; ++tt) {
      float* dst = rows_buf.data() + tt * kTileRows * w.k;
      if (t0 + tt < w.tiles)
        dequantize_tile<I>(w, w.tile(t0 + tt), sbuf.data(), dst);
      else
        std::fill_n(dst, kTileRows * w.k, 0.f);
    }
    for (int h = 0; h < 2; ++h)
      for (int64_t c = 0; c < w.k; c += VL)
        at::vec::transpose_mxn<float, VL, VL>(rows_buf.data() + h * VL * w.k + c, w.k, panel + c * kPanel + h * VL, kPanel);
  }

  template <int MR>
  void rows(const float* panel, const float* x, int64_t k, int64_t rows, float* out, int64_t n, int64_t n0) const {
    RawVec acc0[MR], acc1[MR];   // an array of at::vec's vectors this large GCC keeps in memory
    UNROLL
    for (int r = 0; r < MR; ++r) acc0[r] = acc1[r] = Vec(0.f);
    for (int64_t p = 0; p < k; ++p) {
      const Vec w0 = Vec::loadu(panel + p * kPanel), w1 = Vec::loadu(panel + p * kPanel + VL);
      UNROLL
      for (int r = 0; r < MR; ++r) {
        const Vec xv(x[r * k + p]);
        acc0[r] = at::vec::fmadd(xv, w0, Vec(acc0[r]));
        acc1[r] = at::vec::fmadd(xv, w1, Vec(acc1[r]));
      }
    }
    const int cols = static_cast<int>(std::min<int64_t>(kPanel, n - n0));
    UNROLL
    for (int r = 0; r < MR; ++r) {      // constant indices keep acc in registers
      if (r < rows) {
        Vec(acc0[r]).store(out + r * n + n0, std::min(VL, cols));
        if (cols > VL) Vec(acc1[r]).store(out + r * n + n0 + VL, cols - VL);
      }
    }
  }
};

template <typename I>
at::Tensor fp32_gemm(const Tiles& w, const at::Tensor& x) {
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  at::Tensor out = at::empty({x.size(0), w.n}, xf.options());
  panel_gemm<Fp32Panel, I>(w, xf.data_ptr<float>(), x.size(0), w.k, out.data_ptr<float>());
  return out.to(x.scalar_type());
}

}  // namespace kaiten::quant
