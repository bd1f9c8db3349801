// kaiten_cpu::bf16_linear: y = x W^T + b for fp32 x and a bf16-stored W [N, K], on CPUs whose
// matmuls run in fp32 (no AVX512-BF16/AMX): the weights stay bf16 in memory, half the bytes of an
// fp32 copy, and widen to fp32 on the way in. bf16 -> fp32 is exact (the bf16 bits are the high
// half of the fp32 ones), so results equal an fp32 matmul on the widened weights up to summation
// order.
//
// Few rows (decode): each weight vector is widened in registers and multiplied into up to
// kRowBlock rows of x at once over independent FMA chains, a few weight rows against every row of
// x before the next, so the weight streams once; threads split the output features.
// Many rows (prefill, large batches): chunks of weight rows are widened into fp32 scratch of about
// kChunkBytes and multiplied by at::mm (MKL/oneDNN), whose blocked GEMM wins once a widened weight
// is reused by enough rows (min_dense_rows, chosen by the caller from bench/kernels/bf16_linear.py).
//
// One source for AVX-512, AVX2 and portable code: at::vec's Vectorized<float> and load_to_float
// take their implementation from CPU_CAPABILITY_* as in the other kernels.
#include "aten_ops.h"

#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cstdint>

namespace {

using Vec = at::vec::Vectorized<float>;
using at::BFloat16;
constexpr int VL = Vec::size();
constexpr int kRowBlock = 4;               // rows of x per pass over a weight row
constexpr int64_t kChunkBytes = 4 << 20;   // fp32 scratch per widened chunk of weight rows
#define UNROLL _Pragma("GCC unroll 16")

struct Args {
  const BFloat16* w;   // [N, K] row-major
  const float* bias;   // [N] or nullptr
  const float* x;      // [M, K]
  float* out;          // [M, N]
  int64_t k, n_out;
};

// out[r0 + r, n + i] for r < R, i < NR; K's tail past the last whole vector is done in scalars.
template <int R, int NR>
inline void direct_block(const Args& a, int64_t r0, int64_t n) {
  Vec acc[R][NR];
  UNROLL
  for (int r = 0; r < R; ++r)
    UNROLL
    for (int i = 0; i < NR; ++i) acc[r][i] = Vec(0.f);
  const int64_t kv = a.k / VL * VL;
  for (int64_t c = 0; c < kv; c += VL) {
    Vec wv[NR];
    UNROLL
    for (int i = 0; i < NR; ++i) at::vec::load_to_float(a.w + (n + i) * a.k + c, wv[i]);
    UNROLL
    for (int r = 0; r < R; ++r) {
      const Vec xv = Vec::loadu(a.x + (r0 + r) * a.k + c);
      UNROLL
      for (int i = 0; i < NR; ++i) acc[r][i] = at::vec::fmadd(xv, wv[i], acc[r][i]);
    }
  }
  UNROLL
  for (int r = 0; r < R; ++r)
    UNROLL
    for (int i = 0; i < NR; ++i) {
      float s = at::vec::vec_reduce_all<float>([](Vec& u, Vec& v) { return u + v; }, acc[r][i]);
      const float* xr = a.x + (r0 + r) * a.k;
      const BFloat16* wr = a.w + (n + i) * a.k;
      for (int64_t c = kv; c < a.k; ++c) s += xr[c] * static_cast<float>(wr[c]);
      a.out[(r0 + r) * a.n_out + n + i] = a.bias ? s + a.bias[n + i] : s;
    }
}

// NR weight rows against every row of x, kRowBlock rows at a time: the NR rows stay in L1, so the
// weight streams from memory once whatever the number of rows.
template <int NR>
inline void all_rows(const Args& a, int64_t m, int64_t n) {
  for (int64_t r = 0; r < m; r += kRowBlock) {
    switch (std::min<int64_t>(kRowBlock, m - r)) {
      case 4: direct_block<4, NR>(a, r, n); break;
      case 3: direct_block<3, NR>(a, r, n); break;
      case 2: direct_block<2, NR>(a, r, n); break;
      default: direct_block<1, NR>(a, r, n); break;
    }
  }
}

// NR: weight rows per block, 4 for one or two rows of x (more independent FMA chains), 2 beyond
// (R x NR accumulators, NR weight vectors and one x vector fit AVX2's 16 registers).
template <int NR>
void direct_range(const Args& a, int64_t m, int64_t n0, int64_t n1) {
  int64_t n = n0;
  for (; n + NR <= n1; n += NR) all_rows<NR>(a, m, n);
  for (; n < n1; ++n) all_rows<1>(a, m, n);
}

void direct(const Args& a, int64_t m) {
  const int64_t grain = std::max<int64_t>(8, 16384 / a.k);
  at::parallel_for(0, a.n_out, grain, [&](int64_t n0, int64_t n1) {
    if (m <= 2)
      direct_range<4>(a, m, n0, n1);
    else
      direct_range<2>(a, m, n0, n1);
  });
}

// Chunks of weight rows widened (in parallel) into fp32 scratch, each multiplied by one at::mm
// (bias added by at::addmm), which spreads over the threads.
at::Tensor dense_chunks(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  const int64_t n_out = weight.size(0), k = weight.size(1);
  const int64_t chunk = std::min(n_out, std::max<int64_t>(64, kChunkBytes / (k * 4) / 64 * 64));
  if (chunk == n_out) {           // one chunk: widen the weight and multiply straight into out
    const at::Tensor wf = weight.to(at::kFloat);
    return bias ? at::addmm(*bias, x, wf.t()) : at::mm(x, wf.t());
  }
  at::Tensor out = at::empty({x.size(0), n_out}, x.options());
  at::Tensor scratch = at::empty({chunk, k}, x.options());
  for (int64_t n0 = 0; n0 < n_out; n0 += chunk) {
    const int64_t rows = std::min(chunk, n_out - n0);
    at::Tensor part = scratch.narrow(0, 0, rows);
    part.copy_(weight.narrow(0, n0, rows));            // bf16 -> fp32, vectorized and threaded by ATen
    at::Tensor y = bias ? at::addmm(bias->narrow(0, n0, rows), x, part.t()) : at::mm(x, part.t());
    out.narrow(1, n0, rows).copy_(y);
  }
  return out;
}

at::Tensor bf16_linear(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias,
                       int64_t min_dense_rows) {
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous() && weight.scalar_type() == at::kBFloat16,
              "bf16_linear: weight must be a contiguous bf16 matrix");
  const int64_t n_out = weight.size(0), k = weight.size(1);
  TORCH_CHECK(x.size(-1) == k, "bf16_linear: x has ", x.size(-1), " features, the weight ", k);
  if (bias) TORCH_CHECK(bias->dim() == 1 && bias->size(0) == n_out, "bf16_linear: bias must have ", n_out, " values");
  const at::Tensor xf = x.reshape({-1, k}).to(at::kFloat).contiguous();
  const c10::optional<at::Tensor> bf = bias ? c10::optional<at::Tensor>(bias->to(at::kFloat).contiguous()) : bias;
  const int64_t m = xf.size(0);
  at::Tensor out;
  if (m >= min_dense_rows) {
    out = dense_chunks(xf, weight, bf);
  } else {
    out = at::empty({m, n_out}, xf.options());
    const Args a{weight.data_ptr<BFloat16>(), bf ? bf->data_ptr<float>() : nullptr, xf.data_ptr<float>(),
                 out.data_ptr<float>(), k, n_out};
    direct(a, m);
  }
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = n_out;
  return out.to(x.scalar_type()).view(shape);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kaiten_cpu, m) {
  m.def("bf16_linear(Tensor x, Tensor weight, Tensor? bias, int min_dense_rows) -> Tensor");
}

TORCH_LIBRARY_IMPL(kaiten_cpu, CPU, m) { m.impl("bf16_linear", &bf16_linear); }
