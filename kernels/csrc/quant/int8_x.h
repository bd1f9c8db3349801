// kaiten_cpu::quant_linear (../quant_linear_cpu.cpp): int8 activations: x rounded to int8 per block of 32, and the
// integer vector operations that multiply it.
#pragma once

#include <numeric>
#include <vector>

#include "tiles.h"

namespace kaiten::quant {

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
#define KAITEN_INT8_ACTIVATIONS 1
// int8 activations (llama.cpp's way): each row of x quantized once per call to int8 per block of 32
// (scale amax / levels, nearest even), its integers multiplied with the stored ones as unsigned x
// signed bytes, summed by 4 into int32 lanes: by vpdpbusd with AVX512-VNNI (64 products an
// instruction), else by vpmaddubsw and vpmaddwd (pairs into int16, then into int32). The 4 weight
// rows of a tile's group load as whole vectors (16 bytes a row: int4, int8 groups of 16; else 32),
// so each lane holds one weight row's part of the group's dot: per group, a row's lanes summed, to
// fp32, times the row's scale and x's block scale, into an fp32 accumulator, and the mins times the
// rounded x's group sums: so the result is the exact weight times the rounded x, whose error is the
// weight's (centred) times x's rounding. (Mins times x's exact sums leave the
// integers' (0 to 15) times the rounding: SmolLM2's Q4_1 perplexity with every row so was 18.53
// against 18.30 exact.) int8 weights are signed: with VNNI they meet x as w + 128 (unsigned), and
// their mins less 128 times their scales take that back (panel_biased). Without VNNI x meets them rounded to 7 bits
// (levels 63, as PyTorch's fbgemm reduce_range does for the same instruction), so that the panel
// can hold x as x + 64, unsigned, against w's signed bytes as they are (a pair's sum, 2 * 127 * 128,
// fits int16): 2 instructions on the multiply pipes per 32 products, where x times w's sign against
// |w| took 3 (bench/kernels/int8_pipes.py); int8_block keeps that sign trick on the same 7-bit x.
struct Int8Rows {
  int64_t k, groups;
  std::vector<int8_t> q;      // [m][k]
  std::vector<float> d;       // [m][k / 32]: x ~ q * d
  std::vector<float> sums;    // [m][groups]: sums of the rounded x over the weight's groups (panel_mins)
  std::vector<int32_t> isums; // [m][k / 32]: the integers' sums, for the signed 5-bit weights (Ints5<true>)
};

#if defined(CPU_CAPABILITY_AVX512)
using IVec = __m512i;
inline IVec iload(const void* p) { return _mm512_loadu_si512(p); }
inline void istore(void* p, IVec v) { _mm512_storeu_si512(p, v); }
inline IVec low_nibbles(IVec b) { return _mm512_and_si512(b, _mm512_set1_epi8(0x0F)); }
inline IVec high_nibbles(IVec b) { return _mm512_and_si512(_mm512_srli_epi16(b, 4), _mm512_set1_epi8(0x0F)); }
// x's bytes of a group as each weight row meets them: 16 bytes in every 128-bit lane, or 32 in both halves.
inline IVec bcast16(const int8_t* p) { return _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline IVec bcast32(const int8_t* p) { return _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
inline Vec to_float(IVec v) { return Vec(_mm512_cvtepi32_ps(v)); }
inline IVec flip_sign_bits(IVec v) { return _mm512_xor_si512(v, _mm512_set1_epi8(static_cast<char>(0x80))); }
#else
using IVec = __m256i;
inline IVec iload(const void* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline void istore(void* p, IVec v) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), v); }
inline IVec low_nibbles(IVec b) { return _mm256_and_si256(b, _mm256_set1_epi8(0x0F)); }
inline IVec high_nibbles(IVec b) { return _mm256_and_si256(_mm256_srli_epi16(b, 4), _mm256_set1_epi8(0x0F)); }
inline IVec bcast16(const int8_t* p) { return _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline IVec bcast32(const int8_t* p) { return iload(p); }
inline Vec to_float(IVec v) { return Vec(_mm256_cvtepi32_ps(v)); }
inline IVec flip_sign_bits(IVec v) { return _mm256_xor_si256(v, _mm256_set1_epi8(static_cast<char>(0x80))); }
#endif
constexpr int kIntLanes = sizeof(IVec) / 4;
#if defined(__AVX512VNNI__)
constexpr bool kVnni = true;
#else
constexpr bool kVnni = false;
#endif
// x's integer levels against weights I: 7 bits for int8 weights without VNNI, else 8.
template <typename I>
constexpr int x_levels() { return !I::kInt4 && !kVnni ? 63 : 127; }
// Whether int8 weights meet x biased, as w + 128 (flip_sign_bits, VNNI), their mins less 128 times
// their scales taking that back.
template <typename I>
constexpr bool panel_biased() { return kVnni && !I::kInt4; }
// Whether a group's dot takes a min times x's group sum: the weight's, or that of panel_biased.
template <typename I>
bool panel_mins(const Tiles& w) { return w.has_mins || panel_biased<I>(); }

// Vector j of a tile's group's 4 rows of integers (qg) as the int8 kernels read them: the stored
// bytes, or the 5-bit layout's rows as the int8 tiles' bytes (one row a vector with AVX2, two with AVX-512).
template <typename I>
inline IVec group_vector(const uint8_t* qg, int j) {
  if constexpr (I::kFive) {
#if defined(CPU_CAPABILITY_AVX512)
    __m256i a, b;
    I::pair_int8s(qg, j, a, b);
    return _mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1);
#else
    return I::row_int8s(qg, j);
#endif
  } else {
    return iload(qg + j * sizeof(IVec));
  }
}

// Each int32 lane's dot of unsigned bytes u0 with signed s0 and u1 with s1 (4 each), where every
// product of u and s is at most 31 * 127 (int4 and 5-bit weights against x: 4 such products fit int16).
inline IVec dot_u4(IVec u0, IVec s0, IVec u1, IVec s1) {
#if defined(__AVX512VNNI__)
  return _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), u0, s0), u1, s1);
#elif defined(CPU_CAPABILITY_AVX512)
  return _mm512_madd_epi16(_mm512_add_epi16(_mm512_maddubs_epi16(u0, s0), _mm512_maddubs_epi16(u1, s1)), _mm512_set1_epi16(1));
#else
  return _mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(u0, s0), _mm256_maddubs_epi16(u1, s1)), _mm256_set1_epi16(1));
#endif
}

// Each int32 lane's dot of int8 weight bytes w with signed x (4 each): w + 128 with VNNI
// (panel_biased), else signed.
inline IVec dot_s8(IVec w, IVec x) {
#if defined(__AVX512VNNI__)
  return _mm512_dpbusd_epi32(_mm512_setzero_si512(), w, x);
#elif defined(CPU_CAPABILITY_AVX512)
  const IVec sx = _mm512_mask_sub_epi8(x, _mm512_movepi8_mask(w), _mm512_setzero_si512(), x);
  return _mm512_madd_epi16(_mm512_maddubs_epi16(_mm512_abs_epi8(w), sx), _mm512_set1_epi16(1));
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w)), _mm256_set1_epi16(1));
#endif
}

// 32 floats of x times inv, rounded to nearest even, into q (|x * inv| <= 127).
inline void round_block(const float* x, float inv, int8_t* q) {
#if defined(CPU_CAPABILITY_AVX512)
  const __m512 s = _mm512_set1_ps(inv);
  UNROLL
  for (int h = 0; h < 2; ++h)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16 * h),
                     _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(x + 16 * h), s))));
#else
  const __m256 s = _mm256_set1_ps(inv);
  __m256i v[4];
  UNROLL
  for (int h = 0; h < 4; ++h) v[h] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + 8 * h), s));
  // packs work within 128-bit halves: the bytes come out as 4-byte runs 0, 2, 4, 6, 1, 3, 5, 7
  const __m256i b = _mm256_packs_epi16(_mm256_packs_epi32(v[0], v[1]), _mm256_packs_epi32(v[2], v[3]));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
#endif
}

inline float block_amax(const float* x) {
  Vec m = Vec::loadu(x).abs();
  UNROLL
  for (int j = 1; j < 32 / VL; ++j) m = at::vec::maximum(m, Vec::loadu(x + j * VL).abs());
  float lanes[VL];
  m.store(lanes);
  return *std::max_element(lanes, lanes + VL);
}

// The 4 rows' scales (or mins) of group g, fp16 or fp32, as fp32.
inline __m128 load4(const uint8_t* p, int bytes, int64_t g) {
  if (bytes == 4) return _mm_loadu_ps(reinterpret_cast<const float*>(p) + g * kTileRows);
  return _mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + g * kTileRows * 2)));
}

// `blocks` blocks of 32 floats of x rounded to int8 into q (per block: scale amax / levels,
// nearest even), their scales into d.
inline void round_blocks(const float* x, int64_t blocks, int levels, int8_t* q, float* d) {
  const float lv = static_cast<float>(levels);
  for (int64_t b = 0; b < blocks; ++b) {
    const float amax = block_amax(x + b * 32);
    d[b] = amax / lv;
    round_block(x + b * 32, amax > 0.f ? lv / amax : 0.f, q + b * 32);
  }
}

// The rounded x's sums over `count` groups of G (the mins' factor): each group's integers summed,
// times its block's scale.
template <int G>
inline void scaled_group_sums(const int8_t* q, const float* d, int64_t count, float* sums) {
  for (int64_t i = 0; i < count; ++i) {
    int32_t sum = 0;
    for (int j = 0; j < G; ++j) sum += q[i * G + j];
    sums[i] = static_cast<float>(sum) * d[i * G / 32];
  }
}

template <typename I>
Int8Rows quantize_rows(const Tiles& w, const float* x, int64_t m) {
  Int8Rows r{w.k, w.groups, std::vector<int8_t>(m * w.k), std::vector<float>(m * w.k / 32),
             std::vector<float>(panel_mins<I>(w) ? m * w.groups : 0)};
  round_blocks(x, m * w.k / 32, x_levels<I>(), r.q.data(), r.d.data());
  scaled_group_sums<I::kGroup>(r.q.data(), r.d.data(), static_cast<int64_t>(r.sums.size()), r.sums.data());
  if constexpr (I::kSignedFive) {
    r.isums.resize(m * w.k / 32);
    for (int64_t b = 0; b < m * w.k / 32; ++b)
      r.isums[b] = std::accumulate(r.q.begin() + 32 * b, r.q.begin() + 32 * (b + 1), int32_t{0});
  }
  return r;
}
#endif

}  // namespace kaiten::quant
