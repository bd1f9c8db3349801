// kaiten_cpu::quant_linear: y = x W^T with W stored as GGUF blocks repacked (shared/gguf_quant.py):
//   int4: qweight uint8 [N, K/2], per group of 32 byte i = element i (low nibble) | element i+16 (high)
//   int8: qweight int8 [N, K], groups of 16 or 32
// each group with an fp32 scale and, optionally, an fp32 min: w = q * scale + min.
//
// Three methods, chosen by the number of rows m of x (thresholds from the caller, measured by
// bench/quant_linear.py):
// * m >= min_dense_rows (prefill, large decode batches): chunks of weight rows are dequantized
//   into scratch and multiplied in x's dtype by at::mm (oneDNN/MKL), whose blocked GEMM is faster
//   once a dequantized weight is reused by enough rows.
// * else m <= max_int8_rows, int8 activations (as llama.cpp's q8 dot products): each row of x is
//   quantized once per call to int8 per block of 32 (scale amax / 127, round to nearest even),
//   then integer dot products against the stored integers (AVX2 maddubs + madd, or VNNI dpbusd),
//   scaled per group in fp32; a min adds min * (the exact fp32 sum of x over the group).
// * else in fp32 registers: weights are dequantized in registers, one group
//   of a few weight rows at a time, and multiplied into up to kRowBlock rows of x at once.
//   The last two keep no dequantized copy in memory, so a step reads the weights as stored (4.5
//   or 8.5 bits a weight instead of 16 or 32). Threads split the output features.
//
// One source for AVX-512 and AVX2 (at::vec::Vectorized<float>, with the byte unpacking in the
// matching intrinsics; the integer dot products are 256-bit on both, with VNNI's dpbusd where the
// build has KAITEN_VNNI), and a portable fallback; the ISA comes from CPU_CAPABILITY_* as in
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

// Threads split the output features; within a thread, R rows of x at a time (up to kRowBlock)
// meet NR weight rows at a time: kernel.template block<R, NR>(r0, n) computes out[r0.., n..].
template <typename Kernel, int R, int NR>
void tile_rows(const Kernel& kernel, int64_t r0, int64_t n0, int64_t n1) {
  int64_t n = n0;
  for (; n + NR <= n1; n += NR) kernel.template block<R, NR>(r0, n);
  for (; n < n1; ++n) kernel.template block<R, 1>(r0, n);
}

template <typename Kernel>
void tiled(const Kernel& kernel, int64_t m, int64_t n_out, int64_t k) {
  const int64_t grain = std::max<int64_t>(8, 16384 / k);
  at::parallel_for(0, n_out, grain, [&](int64_t n0, int64_t n1) {
    for (int64_t r = 0; r < m; r += kRowBlock) {
      switch (std::min<int64_t>(kRowBlock, m - r)) {
        case 4: tile_rows<Kernel, 4, 2>(kernel, r, n0, n1); break;
        case 3: tile_rows<Kernel, 3, 2>(kernel, r, n0, n1); break;
        case 2: tile_rows<Kernel, 2, 4>(kernel, r, n0, n1); break;
        default: tile_rows<Kernel, 1, 4>(kernel, r, n0, n1); break;
      }
    }
  });
}

template <typename Grp>
struct Direct {
  const QuantWeight& w;
  const float* x;
  float* out;
  int64_t n_out;
  template <int R, int NR>
  void block(int64_t r0, int64_t n) const { direct_block<Grp, R, NR>(w, x, out, n_out, r0, n); }
};

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

// ---- int8 activations ----------------------------------------------------------------------
constexpr int kQ8Block = 32;   // inputs of x per int8 scale

// x quantized per row and block of 32: q [m, k] int8, d [m, k / 32] scales, sums [m, k / G] the
// fp32 sums of x over each weight group (for the mins).
struct QuantX {
  std::vector<int8_t> q;
  std::vector<float> d, sums;
  int64_t k, blocks, groups;
};

inline void quantize_row(const float* x, int64_t k, int group, int8_t* q, float* d, float* sums) {
  for (int64_t b = 0; b < k / kQ8Block; ++b) {
    const float* xb = x + b * kQ8Block;
    Vec v[kQ8Block / VL];
    Vec amax(0.f);
    UNROLL
    for (int j = 0; j < kQ8Block / VL; ++j) {
      v[j] = Vec::loadu(xb + j * VL);
      amax = at::vec::maximum(amax, v[j].abs());
    }
    const float a = at::vec::vec_reduce_all<float>([](Vec& p, Vec& r) { return at::vec::maximum(p, r); }, amax);
    const float db = a / 127.f, id = db != 0.f ? 1.f / db : 0.f;
    d[b] = db;
    float r[kQ8Block];
    UNROLL
    for (int j = 0; j < kQ8Block / VL; ++j) (v[j] * Vec(id)).round().store(r + j * VL);
    UNROLL
    for (int i = 0; i < kQ8Block; ++i) q[b * kQ8Block + i] = static_cast<int8_t>(r[i]);
  }
  for (int64_t g = 0; g < k / group; ++g) {
    const float* xg = x + g * group;
    sums[g] = at::vec::reduce_all<float>([](Vec& p, Vec& r) { return p + r; }, xg, group);
  }
}

QuantX quantize_x(const float* x, int64_t m, int64_t k, int group, bool with_sums) {
  QuantX xq{std::vector<int8_t>(m * k), std::vector<float>(m * (k / kQ8Block)),
            std::vector<float>(with_sums ? m * (k / group) : 0), k, k / kQ8Block, k / group};
  at::parallel_for(0, m, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      std::vector<float> scratch(with_sums ? 0 : xq.groups);
      float* sums = with_sums ? xq.sums.data() + r * xq.groups : scratch.data();
      quantize_row(x + r * k, k, group, xq.q.data() + r * k, xq.d.data() + r * xq.blocks, sums);
    }
  });
  return xq;
}

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
using I8x32 = __m256i;   // one block of 32 bytes
using F32x8 = __m256;    // 8 partial sums

inline I8x32 load_i8x32(const void* p) { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }
// 16 packed bytes as 32 values 0..15 in input order: low nibbles, then high
inline I8x32 load_int4(const uint8_t* p) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)), lo4 = _mm_set1_epi8(0x0F);
  return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(b, 4), lo4), _mm_and_si128(b, lo4));
}
inline I8x32 abs_i8(I8x32 w) { return _mm256_sign_epi8(w, w); }
inline I8x32 sign_i8(I8x32 x, I8x32 w) { return _mm256_sign_epi8(x, w); }   // x * sign(w)
// unsigned u times signed s: 8 int32 sums of 4 products (sums 0-3 cover bytes 0-15)
inline __m256i dot_us(I8x32 u, I8x32 s) {
#if defined(KAITEN_VNNI)
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}
inline F32x8 f32x8_zero() { return _mm256_setzero_ps(); }
// the scale of each of dot's sums: s_lo for sums 0-3, s_hi for 4-7
inline F32x8 scale2(float s_lo, float s_hi) { return _mm256_set_m128(_mm_set1_ps(s_hi), _mm_set1_ps(s_lo)); }
inline F32x8 scale1(float s) { return _mm256_set1_ps(s); }
inline F32x8 mul(F32x8 a, F32x8 b) { return _mm256_mul_ps(a, b); }
inline F32x8 fma_dot(__m256i dot, F32x8 scale, F32x8 acc) { return _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), scale, acc); }
inline float reduce_f32x8(F32x8 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}
#else
struct I8x32 { int16_t v[32]; };   // unsigned or signed bytes, widened
struct F32x8 { float v[8]; };
struct I32x8 { int32_t v[8]; };

inline I8x32 load_i8x32(const void* p) {
  I8x32 r;
  for (int i = 0; i < 32; ++i) r.v[i] = static_cast<const int8_t*>(p)[i];
  return r;
}
inline I8x32 load_int4(const uint8_t* p) {
  I8x32 r;
  for (int i = 0; i < 16; ++i) r.v[i] = p[i] & 0x0F, r.v[i + 16] = p[i] >> 4;
  return r;
}
inline I8x32 abs_i8(I8x32 w) {
  for (auto& e : w.v) e = static_cast<int16_t>(e < 0 ? -e : e);
  return w;
}
inline I8x32 sign_i8(I8x32 x, I8x32 w) {
  for (int i = 0; i < 32; ++i) x.v[i] = static_cast<int16_t>(w.v[i] < 0 ? -x.v[i] : w.v[i] == 0 ? 0 : x.v[i]);
  return x;
}
inline I32x8 dot_us(I8x32 u, I8x32 s) {
  I32x8 r{};
  for (int i = 0; i < 32; ++i) r.v[i / 4] += u.v[i] * s.v[i];
  return r;
}
inline F32x8 f32x8_zero() { return F32x8{}; }
inline F32x8 scale2(float s_lo, float s_hi) { return F32x8{{s_lo, s_lo, s_lo, s_lo, s_hi, s_hi, s_hi, s_hi}}; }
inline F32x8 scale1(float s) { return scale2(s, s); }
inline F32x8 mul(F32x8 a, F32x8 b) {
  for (int i = 0; i < 8; ++i) a.v[i] *= b.v[i];
  return a;
}
inline F32x8 fma_dot(I32x8 dot, F32x8 scale, F32x8 acc) {
  for (int i = 0; i < 8; ++i) acc.v[i] += static_cast<float>(dot.v[i]) * scale.v[i];
  return acc;
}
inline float reduce_f32x8(F32x8 v) {
  float s = 0.f;
  for (float e : v.v) s += e;
  return s;
}
#endif

// A block of 32 weights of a row as the unsigned operand of dot_us (int4: 0..15; int8: |w|,
// with x's signs flipped where w < 0), and its scales.
template <bool kInt4, int G>
struct Q8Weights {
  static_assert(G == 32 || (!kInt4 && G == 16), "int4 groups are 32, int8 groups 16 or 32");
  I8x32 u, w;

  inline void load(const QuantWeight& wt, int64_t n, int64_t b) {
    const uint8_t* row = wt.q + n * wt.row_bytes;
    if constexpr (kInt4) {
      u = load_int4(row + b * kQ8Block / 2);
    } else {
      w = load_i8x32(row + b * kQ8Block);
      u = abs_i8(w);
    }
  }
  inline I8x32 signed_x(I8x32 x) const {
    if constexpr (kInt4) return x; else return sign_i8(x, w);
  }
  // block b's scale (one group of 32; or two of 16, for the halves)
  static inline F32x8 scale(const QuantWeight& wt, int64_t n, int64_t b) {
    const float* s = wt.scales + n * wt.groups;
    if constexpr (G == 32) return scale1(s[b]); else return scale2(s[2 * b], s[2 * b + 1]);
  }
};

// out[r0 + r, n + i] for r < R, i < NR: each block of weights is loaded once for the R rows of x
// and each block of x once for the NR weight rows.
template <typename W, int R, int NR>
inline void q8_block(const QuantWeight& w, const QuantX& x, float* out, int64_t n_out, int64_t r0, int64_t n) {
  F32x8 acc[R][NR];
  UNROLL
  for (int r = 0; r < R; ++r)
    UNROLL
    for (int i = 0; i < NR; ++i) acc[r][i] = f32x8_zero();
  for (int64_t b = 0; b < x.blocks; ++b) {
    W wb[NR];
    F32x8 ws[NR];
    UNROLL
    for (int i = 0; i < NR; ++i) wb[i].load(w, n + i, b), ws[i] = W::scale(w, n + i, b);
    UNROLL
    for (int r = 0; r < R; ++r) {
      const I8x32 xv = load_i8x32(x.q.data() + (r0 + r) * x.k + b * kQ8Block);
      const F32x8 d = scale1(x.d[(r0 + r) * x.blocks + b]);
      UNROLL
      for (int i = 0; i < NR; ++i) acc[r][i] = fma_dot(dot_us(wb[i].u, wb[i].signed_x(xv)), mul(ws[i], d), acc[r][i]);
    }
  }
  UNROLL
  for (int r = 0; r < R; ++r)
    UNROLL
    for (int i = 0; i < NR; ++i) {
      float y = reduce_f32x8(acc[r][i]);
      if (w.mins) {
        const float* mins = w.mins + (n + i) * w.groups;
        const float* sums = x.sums.data() + (r0 + r) * x.groups;
        for (int64_t g = 0; g < w.groups; ++g) y += mins[g] * sums[g];
      }
      out[(r0 + r) * n_out + n + i] = y;
    }
}

template <typename W>
struct Q8 {
  const QuantWeight& w;
  const QuantX& x;
  float* out;
  int64_t n_out;
  template <int R, int NR>
  void block(int64_t r0, int64_t n) const { q8_block<W, R, NR>(w, x, out, n_out, r0, n); }
};

template <bool kInt4, int G>
at::Tensor run(const QuantWeight& w, const at::Tensor& x, int64_t n_out, int64_t max_int8_rows,
               int64_t min_dense_rows) {
  const int64_t m = x.size(0);
  if (m >= min_dense_rows) return dense_chunks<Group<kInt4, G>>(w, x, n_out);
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  at::Tensor out = at::empty({m, n_out}, xf.options());
  if (m <= max_int8_rows && w.k % kQ8Block == 0) {
    const QuantX xq = quantize_x(xf.data_ptr<float>(), m, w.k, G, w.mins != nullptr);
    tiled(Q8<Q8Weights<kInt4, G>>{w, xq, out.data_ptr<float>(), n_out}, m, n_out, w.k);
  } else {
    tiled(Direct<Group<kInt4, G>>{w, xf.data_ptr<float>(), out.data_ptr<float>(), n_out}, m, n_out, w.k);
  }
  return out.to(x.scalar_type());
}

at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                        const c10::optional<at::Tensor>& mins, int64_t max_int8_rows, int64_t min_dense_rows) {
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
    out = run<true, kInt4Group>(w, x2, n_out, max_int8_rows, min_dense_rows);
  else if (!int4 && group == 32)
    out = run<false, 32>(w, x2, n_out, max_int8_rows, min_dense_rows);
  else if (!int4 && group == 16)
    out = run<false, 16>(w, x2, n_out, max_int8_rows, min_dense_rows);
  else
    TORCH_CHECK(false, "quant_linear: unsupported group size ", group);
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = n_out;
  return out.view(shape);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kaiten_cpu, m) {
  m.def("quant_linear(Tensor x, Tensor qweight, Tensor scales, Tensor? mins, int max_int8_rows, int min_dense_rows) -> Tensor");
}

TORCH_LIBRARY_IMPL(kaiten_cpu, CPU, m) { m.impl("quant_linear", &quant_linear); }
