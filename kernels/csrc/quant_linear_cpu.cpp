// kaiten_cpu::quant_linear: y = x W^T with W stored as GGUF blocks repacked (shared/gguf_quant.py):
//   int4: qweight uint8 [N, K/2], per group of 32 byte i = element i (low nibble) | element i+16 (high)
//   int8: qweight int8 [N, K], groups of 16 or 32
// each group with an fp32 scale and, optionally, an fp32 min: w = q * scale + min.
//
// Few rows (decode): weights are dequantized in registers, one group of a few weight rows at a
// time, and multiplied into up to kRowBlock rows of x at once; no dequantized copy exists in
// memory, so a step reads the weights as stored (4.5 or 8.5 bits a weight instead of 16 or 32).
// Threads split the output features. Many rows (prefill, large decode batches): chunks of weight
// rows are dequantized into scratch and multiplied in x's dtype by at::mm (oneDNN/MKL), whose
// blocked GEMM is faster once a dequantized weight is reused by enough rows (min_dense_rows,
// chosen by the caller from bench/quant_linear.py's measurements).
//
// One source for AVX-512 and AVX2 (at::vec::Vectorized<float>, with the byte unpacking in the
// matching intrinsics), and a portable fallback; the ISA comes from CPU_CAPABILITY_* as in
// paged_attention_cpu.cpp.
#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cstdint>

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int VL = Vec::size();
constexpr int kInt4Group = 32;
constexpr int kRowBlock = 4;        // rows of x per pass over a weight row
// Fully unrolled fixed-size loops let the compiler keep the vector arrays in registers.
#define UNROLL _Pragma("GCC unroll 16")
constexpr int64_t kChunkBytes = 4 << 20;   // fp32 scratch per dequantized chunk of weight rows

// The 32 values of an int4 group as 32 / VL vectors, in input order.
inline void unpack_int4(const uint8_t* p, Vec* q) {
#if defined(CPU_CAPABILITY_AVX512)
  const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  q[0] = Vec(_mm512_cvtepi32_ps(_mm512_and_si512(b, _mm512_set1_epi32(0x0F))));
  q[1] = Vec(_mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4)));
#elif defined(CPU_CAPABILITY_AVX2)
  UNROLL
  for (int h = 0; h < 2; ++h) {
    const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8 * h)));
    q[h] = Vec(_mm256_cvtepi32_ps(_mm256_and_si256(b, _mm256_set1_epi32(0x0F))));
    q[2 + h] = Vec(_mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4)));
  }
#else
  float v[kInt4Group];
  UNROLL
  for (int i = 0; i < kInt4Group / 2; ++i) {
    v[i] = static_cast<float>(p[i] & 0x0F);
    v[i + kInt4Group / 2] = static_cast<float>(p[i] >> 4);
  }
  UNROLL
  for (int j = 0; j < kInt4Group / VL; ++j) q[j] = Vec::loadu(v + j * VL);
#endif
}

// VL int8 values as one vector.
inline Vec unpack_int8(const int8_t* p) {
#if defined(CPU_CAPABILITY_AVX512)
  return Vec(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))));
#elif defined(CPU_CAPABILITY_AVX2)
  return Vec(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)))));
#else
  float v[VL];
  UNROLL
  for (int i = 0; i < VL; ++i) v[i] = static_cast<float>(p[i]);
  return Vec::loadu(v);
#endif
}

struct QuantWeight {
  const uint8_t* q;        // row-major; int4: K / 2 bytes a row, int8: K
  const float* scales;     // [N, K / group]
  const float* mins;       // [N, K / group] or nullptr
  int64_t k, groups, row_bytes;
};

// Dequantizes group g of a weight row into G / VL vectors (int4: G is 32).
template <bool kInt4, int G>
struct Group {
  static constexpr int kVecs = G / VL;
  static_assert(G % VL == 0, "a group must be whole vectors");

  static inline void load(const QuantWeight& w, int64_t n, int64_t g, Vec* out) {
    const Vec scale(w.scales[n * w.groups + g]);
    const uint8_t* row = w.q + n * w.row_bytes;
    if constexpr (kInt4) {
      const Vec min(w.mins[n * w.groups + g]);
      unpack_int4(row + g * G / 2, out);
      UNROLL
      for (int j = 0; j < kVecs; ++j) out[j] = at::vec::fmadd(out[j], scale, min);
    } else {
      const int8_t* p = reinterpret_cast<const int8_t*>(row) + g * G;
      if (w.mins) {
        const Vec min(w.mins[n * w.groups + g]);
        UNROLL
        for (int j = 0; j < kVecs; ++j) out[j] = at::vec::fmadd(unpack_int8(p + j * VL), scale, min);
      } else {
        UNROLL
        for (int j = 0; j < kVecs; ++j) out[j] = unpack_int8(p + j * VL) * scale;
      }
    }
  }
};

// out[r0 + r, n + i] for r < R, i < NR: each weight vector is dequantized once for the R rows of
// x, and the R x NR accumulators are independent FMA chains.
template <typename Grp, int R, int NR>
inline void direct_block(const QuantWeight& w, const float* x, float* out, int64_t n_out, int64_t r0, int64_t n) {
  Vec acc[R][NR];
  UNROLL
  for (int r = 0; r < R; ++r)
    UNROLL
    for (int i = 0; i < NR; ++i) acc[r][i] = Vec(0.f);
  for (int64_t g = 0; g < w.groups; ++g) {
    Vec wv[NR][Grp::kVecs];
    UNROLL
    for (int i = 0; i < NR; ++i) Grp::load(w, n + i, g, wv[i]);
    UNROLL
    for (int j = 0; j < Grp::kVecs; ++j) {
      UNROLL
      for (int r = 0; r < R; ++r) {
        const Vec xv = Vec::loadu(x + (r0 + r) * w.k + g * Grp::kVecs * VL + j * VL);
        UNROLL
        for (int i = 0; i < NR; ++i) acc[r][i] = at::vec::fmadd(xv, wv[i][j], acc[r][i]);
      }
    }
  }
  UNROLL
  for (int r = 0; r < R; ++r)
    UNROLL
    for (int i = 0; i < NR; ++i)
      out[(r0 + r) * n_out + n + i] =
          at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, acc[r][i]);
}

template <typename Grp, int R, int NR>
void direct_rows(const QuantWeight& w, const float* x, float* out, int64_t n_out, int64_t r0, int64_t n0,
                 int64_t n1) {
  int64_t n = n0;
  for (; n + NR <= n1; n += NR) direct_block<Grp, R, NR>(w, x, out, n_out, r0, n);
  for (; n < n1; ++n) direct_block<Grp, R, 1>(w, x, out, n_out, r0, n);
}

template <typename Grp>
void direct(const QuantWeight& w, const float* x, float* out, int64_t m, int64_t n_out) {
  const int64_t grain = std::max<int64_t>(8, 16384 / w.k);
  at::parallel_for(0, n_out, grain, [&](int64_t n0, int64_t n1) {
    for (int64_t r = 0; r < m; r += kRowBlock) {
      switch (std::min<int64_t>(kRowBlock, m - r)) {
        case 4: direct_rows<Grp, 4, 2>(w, x, out, n_out, r, n0, n1); break;
        case 3: direct_rows<Grp, 3, 2>(w, x, out, n_out, r, n0, n1); break;
        case 2: direct_rows<Grp, 2, 4>(w, x, out, n_out, r, n0, n1); break;
        default: direct_rows<Grp, 1, 4>(w, x, out, n_out, r, n0, n1); break;
      }
    }
  });
}

// Chunks of weight rows dequantized (in parallel) into scratch of about kChunkBytes, each then
// multiplied in x's dtype (bf16 GEMMs for bf16 x) by one at::mm, which spreads over the threads.
template <typename Grp>
at::Tensor dense_chunks(const QuantWeight& w, const at::Tensor& x, int64_t n_out) {
  const int64_t chunk = std::min(n_out, std::max<int64_t>(64, kChunkBytes / (w.k * 4) / 64 * 64));
  at::Tensor out = at::empty({x.size(0), n_out}, x.options());
  at::Tensor scratch = at::empty({chunk, w.k}, x.options().dtype(at::kFloat));
  float* buf = scratch.data_ptr<float>();
  for (int64_t n0 = 0; n0 < n_out; n0 += chunk) {
    const int64_t rows = std::min(chunk, n_out - n0);
    at::parallel_for(0, rows, 16, [&](int64_t i0, int64_t i1) {
      for (int64_t i = i0; i < i1; ++i) {
        for (int64_t g = 0; g < w.groups; ++g) {
          Vec wv[Grp::kVecs];
          Grp::load(w, n0 + i, g, wv);
          UNROLL
          for (int j = 0; j < Grp::kVecs; ++j) wv[j].store(buf + i * w.k + (g * Grp::kVecs + j) * VL);
        }
      }
    });
    out.narrow(1, n0, rows).copy_(at::mm(x, scratch.narrow(0, 0, rows).to(x.scalar_type()).t()));
  }
  return out;
}

template <typename Grp>
at::Tensor run(const QuantWeight& w, const at::Tensor& x, int64_t n_out, int64_t min_dense_rows) {
  const int64_t m = x.size(0);
  if (m >= min_dense_rows) return dense_chunks<Grp>(w, x, n_out);
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  at::Tensor out = at::empty({m, n_out}, xf.options());
  direct<Grp>(w, xf.data_ptr<float>(), out.data_ptr<float>(), m, n_out);
  return out.to(x.scalar_type());
}

at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                        const c10::optional<at::Tensor>& mins, int64_t min_dense_rows) {
  TORCH_CHECK(qweight.dim() == 2 && qweight.is_contiguous(), "quant_linear: qweight must be a contiguous matrix");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous(), "quant_linear: scales must be fp32");
  const bool int4 = qweight.scalar_type() == at::kByte;
  TORCH_CHECK(int4 || qweight.scalar_type() == at::kChar, "quant_linear: qweight must be uint8 (int4) or int8");
  const int64_t n_out = qweight.size(0), k = int4 ? 2 * qweight.size(1) : qweight.size(1);
  TORCH_CHECK(x.size(-1) == k, "quant_linear: x has ", x.size(-1), " features, the weight ", k);
  TORCH_CHECK(scales.size(0) == n_out && k % scales.size(1) == 0, "quant_linear: scales do not match the weight");
  const int64_t group = k / scales.size(1);
  TORCH_CHECK(!int4 || mins.has_value(), "quant_linear: int4 weights need mins");
  if (mins) TORCH_CHECK(mins->sizes() == scales.sizes() && mins->scalar_type() == at::kFloat && mins->is_contiguous(),
                        "quant_linear: mins must match scales");
  const QuantWeight w{static_cast<const uint8_t*>(qweight.data_ptr()), scales.data_ptr<float>(),
                      mins ? mins->data_ptr<float>() : nullptr, k, scales.size(1), qweight.size(1)};
  const at::Tensor x2 = x.reshape({-1, k});
  at::Tensor out;
  if (int4 && group == kInt4Group)
    out = run<Group<true, kInt4Group>>(w, x2, n_out, min_dense_rows);
  else if (!int4 && group == 32)
    out = run<Group<false, 32>>(w, x2, n_out, min_dense_rows);
  else if (!int4 && group == 16)
    out = run<Group<false, 16>>(w, x2, n_out, min_dense_rows);
  else
    TORCH_CHECK(false, "quant_linear: unsupported group size ", group);
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = n_out;
  return out.view(shape);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kaiten_cpu, m) {
  m.def("quant_linear(Tensor x, Tensor qweight, Tensor scales, Tensor? mins, int min_dense_rows) -> Tensor");
}

TORCH_LIBRARY_IMPL(kaiten_cpu, CPU, m) { m.impl("quant_linear", &quant_linear); }
