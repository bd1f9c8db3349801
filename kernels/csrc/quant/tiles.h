// kaiten_cpu::quant_linear (../quant_linear_cpu.cpp): the weight's tile layout (engine_worker/model/quant_tiles.py), its
// dequantization, and what every method shares.
#pragma once

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include "../aten_ops.h"
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <type_traits>

namespace kaiten::quant {

using Vec = at::vec::Vectorized<float>;
constexpr int VL = Vec::size();
#if defined(CPU_CAPABILITY_AVX512)
using RawVec = __m512;        // Vec's register, for arrays of accumulators
#elif defined(CPU_CAPABILITY_AVX2)
using RawVec = __m256;
#else
using RawVec = Vec;
#endif
constexpr int kTileRows = 4;        // weight rows a tile (quant_tiles.TILE_ROWS)
// Fully unrolled fixed-size loops let the compiler keep the vector arrays in registers.
#define UNROLL _Pragma("GCC unroll 16")

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
  float v[32];
  UNROLL
  for (int i = 0; i < 16; ++i) {
    v[i] = static_cast<float>(p[i] & 0x0F);
    v[i + 16] = static_cast<float>(p[i] >> 4);
  }
  UNROLL
  for (int j = 0; j < 32 / VL; ++j) q[j] = Vec::loadu(v + j * VL);
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

inline void half_to_float(const uint16_t* src, float* dst, int64_t n) {
  int64_t i = 0;
#if defined(__F16C__)
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
#endif
  for (; i < n; ++i) dst[i] = static_cast<float>(c10::Half(src[i], c10::Half::from_bits()));
}

struct Tiles {
  const uint8_t* data;
  int64_t n, k, groups, tiles, tile_bytes;
  int scale_bytes;   // 2: fp16, 4: fp32
  bool has_mins;

  const uint8_t* tile(int64_t t) const { return data + t * tile_bytes; }
  int64_t scale_count() const { return groups * kTileRows; }
  const uint8_t* ints(const uint8_t* tile) const { return tile + scale_count() * scale_bytes * (has_mins ? 2 : 1); }
};

// A packed weight's tiles tensor checked against its format (bits, group, has_mins) and n rows of k
// inputs, as the Tiles the kernels read; `op` names the caller in its errors.
inline Tiles tiles_of(const char* op, const at::Tensor& tiles, int64_t n, int64_t k, int64_t bits, int64_t group,
                      bool has_mins) {
  TORCH_CHECK(tiles.dim() == 2 && tiles.is_contiguous() && tiles.scalar_type() == at::kByte,
              op, ": tiles must be a contiguous uint8 matrix");
  TORCH_CHECK(((bits == 4 || bits == 5) && group == 32) || (bits == 8 && (group == 16 || group == 32)),
              op, ": unsupported format: ", bits, "-bit groups of ", group);
  TORCH_CHECK(k > 0 && k % group == 0, op, ": the weight's ", k, " features are not groups of ", group);
  const int64_t groups = k / group, tile_count = (n + kTileRows - 1) / kTileRows;
  TORCH_CHECK(tiles.size(0) == tile_count, op, ": ", tiles.size(0), " tiles for ", n, " rows");
  // tile bytes = groups * kTileRows * (integer bytes + scale bytes * (1 + has_mins))
  const int64_t per = tiles.size(1) / (groups * kTileRows) - group * bits / 8;
  const int64_t scale_bytes = per / (has_mins ? 2 : 1);
  TORCH_CHECK(tiles.size(1) % (groups * kTileRows) == 0 && (scale_bytes == 2 || scale_bytes == 4) &&
                  per == scale_bytes * (has_mins ? 2 : 1),
              op, ": tiles of ", tiles.size(1), " bytes do not match the format");
  return Tiles{tiles.data_ptr<uint8_t>(), n, k, groups, tile_count, tiles.size(1), static_cast<int>(scale_bytes),
               has_mins};
}

// A tile's scales and mins as fp32 [G][kTileRows]: fp16 ones widened into buf (2 x scale_count()).
struct TileScales {
  const float* scales;
  const float* mins;   // nullptr without mins

  TileScales() : scales(nullptr), mins(nullptr) {}
  TileScales(const Tiles& w, const uint8_t* tile, float* buf) {
    const int64_t count = w.scale_count();
    const float* parts[2] = {nullptr, nullptr};
    for (int part = 0; part < (w.has_mins ? 2 : 1); ++part) {
      const uint8_t* src = tile + part * count * w.scale_bytes;
      if (w.scale_bytes == 4) {
        parts[part] = reinterpret_cast<const float*>(src);
      } else {
        half_to_float(reinterpret_cast<const uint16_t*>(src), buf + part * count, count);
        parts[part] = buf + part * count;
      }
    }
    scales = parts[0];
    mins = parts[1];
  }
};

// The stored integers of one row's group of G as G / VL fp32 vectors, in input order.
template <bool kIsInt4, int G>
struct Ints {
  static_assert(G % VL == 0 && (G == 32 || (!kIsInt4 && G == 16)), "int4 groups are 32, int8 groups 16 or 32");
  static constexpr bool kInt4 = kIsInt4;
  static constexpr int kGroup = G;
  static constexpr int kVecs = G / VL;
  static constexpr int kBytes = kInt4 ? G / 2 : G;
  static constexpr bool kFive = false;
  static constexpr bool kSignedFive = false;
  static constexpr int kInt8Bytes = kBytes;   // bytes of a row's group as the int8 kernels read them

  // Row i of a tile's group (qg) as kVecs fp32 vectors, in input order.
  static inline void load_row(const uint8_t* qg, int i, Vec* out) { load(qg + i * kBytes, out); }

  static inline void load(const uint8_t* p, Vec* out) {
    if constexpr (kInt4) {
      unpack_int4(p, out);
    } else {
      UNROLL
      for (int j = 0; j < kVecs; ++j) out[j] = unpack_int8(reinterpret_cast<const int8_t*>(p) + j * VL);
    }
  }
};

// The 5-bit layout (Q5_0, Q5_1, Q5_K; quant_tiles.py): a tile's group of 32 in 80 bytes (20 a row):
// the 4 rows' low nibbles as int4 stores them (16 bytes a row; byte i: element i low, i + 16 high),
// then the fifth bits, 8 bytes a pair of rows (0-1, 2-3) laid out for two 64-bit shifts: with the
// pair's 32 nibble bytes as one AVX2 vector, its low nibbles (elements 0-15 of both rows) and high
// nibbles (16-31) each take their fifth bits from the pair's 8 bytes broadcast to 4 qwords, qword Q
// shifted right by Q (low nibbles: byte k's bits 4-7 hold qword Q's byte k at bit 4 + Q) or left by
// 4 - Q (high nibbles: bits 0-3), then masked to bit 4. kSigned (no mins, Q5_0): the value is the
// 5 bits less 16, so the kernels see the integers the int8 tiles held and compute the same bytes.
template <bool kSigned>
struct Ints5 {
  static constexpr bool kInt4 = false;
  static constexpr bool kFive = true;
  static constexpr bool kSignedFive = kSigned;
  static constexpr int kGroup = 32;
  static constexpr int kVecs = 32 / VL;
  static constexpr int kBytes = 20;           // a row's share of a tile's group
  static constexpr int kInt8Bytes = 32;

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
  // Rows 2j and 2j + 1 of a tile's group (qg) as 5-bit values 0..31 in int4's order: lo holds
  // elements 0-15 of both rows, hi elements 16-31.
  static inline void pair(const uint8_t* qg, int j, __m256i& lo, __m256i& hi) {
    const __m256i nib = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qg + 32 * j)), lo4 = _mm256_set1_epi8(0x0F);
    int64_t bits;
    std::memcpy(&bits, qg + 64 + 8 * j, 8);
    const __m256i v = _mm256_set1_epi64x(bits), bit4 = _mm256_set1_epi8(0x10);
    lo = _mm256_or_si256(_mm256_and_si256(nib, lo4), _mm256_and_si256(_mm256_srlv_epi64(v, _mm256_setr_epi64x(0, 1, 2, 3)), bit4));
    hi = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(nib, 4), lo4),
                         _mm256_and_si256(_mm256_sllv_epi64(v, _mm256_setr_epi64x(4, 3, 2, 1)), bit4));
  }

  // Rows 2j and 2j + 1 as int8 values in input order (the int8 tiles' bytes).
  static inline void pair_int8s(const uint8_t* qg, int j, __m256i& a, __m256i& b) {
    __m256i lo, hi;
    pair(qg, j, lo, hi);
    a = _mm256_permute2x128_si256(lo, hi, 0x20);
    b = _mm256_permute2x128_si256(lo, hi, 0x31);
    if constexpr (kSigned) {
      a = _mm256_sub_epi8(a, _mm256_set1_epi8(16));
      b = _mm256_sub_epi8(b, _mm256_set1_epi8(16));
    }
  }

  static inline __m256i row_int8s(const uint8_t* qg, int i) {
    __m256i a, b;
    pair_int8s(qg, i / 2, a, b);
    return i % 2 ? b : a;
  }
#endif

  // Row i of a tile's group as int8 values in input order, by plain code (the portable build).
  static inline void row_int8s(const uint8_t* qg, int i, int8_t* out) {
    const uint8_t* v = qg + 64 + 8 * (i / 2);
    for (int e = 0; e < 32; ++e) {
      const int nibble = (qg[16 * i + e % 16] >> (e < 16 ? 0 : 4)) & 0x0F;
      const int q = 2 * (i % 2) + (e % 16) / 8, k = e % 8;       // the qword and byte e lands in
      const int high = (v[k] >> (e < 16 ? 4 + q : q)) & 1;
      out[e] = static_cast<int8_t>((nibble | (high << 4)) - (kSigned ? 16 : 0));
    }
  }

  // Row i of a tile's group (qg) as kVecs fp32 vectors, in input order.
  static inline void load_row(const uint8_t* qg, int i, Vec* out) {
#if defined(CPU_CAPABILITY_AVX512)
    const __m256i q = row_int8s(qg, i);
    out[0] = Vec(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(q))));
    out[1] = Vec(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(q, 1))));
#elif defined(CPU_CAPABILITY_AVX2)
    const __m256i q = row_int8s(qg, i);
    const __m128i h[2] = {_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1)};
    UNROLL
    for (int j = 0; j < 4; ++j)
      out[j] = Vec(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(j % 2 ? _mm_srli_si128(h[j / 2], 8) : h[j / 2])));
#else
    int8_t q[32];
    row_int8s(qg, i, q);
    UNROLL
    for (int j = 0; j < kVecs; ++j) out[j] = unpack_int8(q + j * VL);
#endif
  }
};

template <typename I>
struct IntsOf {
  using type = I;
};

// f(IntsOf<I>()) with I the integer reader of a format tiles_of accepted (f takes `auto tag` and
// reads I as typename decltype(tag)::type).
template <typename F>
auto with_ints(int64_t bits, int64_t group, bool has_mins, const F& f) {
  if (bits == 4) return f(IntsOf<Ints<true, 32>>());
  if (bits == 5 && has_mins) return f(IntsOf<Ints5<false>>());
  if (bits == 5) return f(IntsOf<Ints5<true>>());
  if (group == 32) return f(IntsOf<Ints<false, 32>>());
  return f(IntsOf<Ints<false, 16>>());
}

// How far ahead of a group a thread asks for its tiles' bytes. The hardware prefetchers alone left
// a one-row decode at 8-12 GB/s where a plain read streams 24 (2-core Xeon with AMX, 2 threads,
// 30 layers' Q4_1 projections: 4.8 -> 4.7 ms in fp32 registers, 3.5 -> 2.9 ms with int8 x; Q8_0
// 10.4 -> 7.1 and 9.7 -> 6.0 ms; as good from 4 KiB to 8 KiB ahead). Past a matrix's end it is a
// harmless hint.
constexpr int64_t kPrefetchBytes = 4096;

// Asks for the bytes kPrefetchBytes past a tile's group qg (its 4 rows' integers).
template <typename I>
inline void prefetch_group(const uint8_t* qg) {
  UNROLL
  for (int j = 0; j < (kTileRows * I::kBytes + 63) / 64; ++j) __builtin_prefetch(qg + kPrefetchBytes + 64 * j);
}

// The weights of row `lane` of a tile in group g, q * scale + min, as I::kVecs fp32 vectors; q: the
// tile's integers.
template <typename I>
inline void dequantize_group(const uint8_t* q, const TileScales& s, int64_t g, int lane, Vec* out) {
  const int64_t at = g * kTileRows + lane;
  I::load_row(q + g * kTileRows * I::kBytes, lane, out);
  const Vec scale(s.scales[at]), min(s.mins ? s.mins[at] : 0.f);
  UNROLL
  for (int j = 0; j < I::kVecs; ++j) out[j] = at::vec::fmadd(out[j], scale, min);
}

// A tile's kTileRows weight rows dequantized into out [kTileRows][k], q * scale + min.
template <typename I>
void dequantize_tile(const Tiles& w, const uint8_t* tile, float* sbuf, float* out) {
  const TileScales s(w, tile, sbuf);
  const uint8_t* q = w.ints(tile);
  for (int i = 0; i < kTileRows; ++i)
    for (int64_t g = 0; g < w.groups; ++g) {
      if (i == 0) prefetch_group<I>(q + g * kTileRows * I::kBytes);
      Vec wv[I::kVecs];
      dequantize_group<I>(q, s, g, i, wv);
      UNROLL
      for (int j = 0; j < I::kVecs; ++j) wv[j].store(out + i * w.k + g * I::kGroup + j * VL);
    }
}

// A buffer of n T on 64-byte cache lines.
template <typename T>
struct Aligned {
  std::unique_ptr<T[], void (*)(void*)> p;
  explicit Aligned(int64_t n) : p(static_cast<T*>(std::aligned_alloc(64, (n * sizeof(T) + 63) / 64 * 64)), &std::free) {}
  T* data() const { return p.get(); }
};

// count (<= VL) floats of v into dst, rounded to nearest even where O is narrower.
template <typename O>
inline void store_as(const Vec& v, O* dst, int64_t count) {
  if constexpr (std::is_same_v<O, float>) {
    v.store(dst, static_cast<int>(count));
  } else {
    float f[VL];
    v.store(f);
    at::vec::convert(f, dst, count);
  }
}

#if defined(__AVX512BF16__)
// Asks for the bytes of a tile's group(s) holding inputs [c, c + 32).
template <typename I>
inline void prefetch_32(const uint8_t* q, int64_t c) {
  for (int h = 0; h < 32 / I::kGroup; ++h) prefetch_group<I>(q + (c / I::kGroup + h) * kTileRows * I::kBytes);
}

// Inputs [c, c + 32) of a tile's row `lane`, q * scale + min in fp32, rounded to bf16 (nearest
// even, as the dense bf16 GEMM rounds its weights); q: the tile's integers.
template <typename I>
inline __m512bh dequantize_bf16(const uint8_t* q, const TileScales& s, int64_t c, int lane) {
  Vec d[2];
  UNROLL
  for (int h = 0; h < 32 / I::kGroup; ++h) dequantize_group<I>(q, s, c / I::kGroup + h, lane, d + h * I::kVecs);
  return _mm512_cvtne2ps_pbh(d[1], d[0]);
}
#endif

}  // namespace kaiten::quant
