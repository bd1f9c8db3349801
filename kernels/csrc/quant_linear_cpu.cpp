// kaiten_cpu::quant_linear: y = x W^T with W's GGUF blocks in tiles of kTileRows weight rows
// (engine_worker/model/quant_tiles.py), the tiles one after another, each
//   scales [G][kTileRows], then mins [G][kTileRows] where the format has them, both fp16 (where
//   that is exact: Q4_0, Q4_1, Q8_0) or fp32; then the stored integers [G][kTileRows][bytes],
// for the G groups of a row: int4 groups of 32 in 16 bytes (byte i: element i in the low nibble,
// i + 16 in the high), int8 groups of 16 or 32 bytes. An element is q * scale + min.
// A tile is one stream of bytes, read front to back, so a thread's share of W streams from memory
// as one run, and fp16 scales keep the tensor at the GGUF file's size (20 bytes per 32 int4
// weights, 34 per 32 int8).
//
// Six methods, chosen by the number of rows m of x and x's dtype (min_dense_rows and int8_rows
// from the caller, measured by bench/quant_linear.py):
// * m <= int8_rows, in an AVX-512 or AVX2 build: *int8 activations*, as llama.cpp computes: x
//   rounded to int8 per block of 32, integer dot products with the stored integers (vpdpbusd with
//   AVX512-VNNI, 64 byte products an instruction; else vpmaddubsw and vpmaddwd), scaled per group
//   in fp32. x is inexact (about 1% of the output's norm), the fewest instructions per weight. Up
//   to kInt8BlockRows rows a row at a time against each tile (int8_block); more by the *int8 panel
//   GEMM* (Int8Panel): panel_gemm's panels hold the stored integers reordered by quads of inputs,
//   each quad of a row of x broadcast against them.
// * m >= min_dense_rows (prefill, large decode batches), a GEMM, faster once a dequantized weight
//   is reused by enough rows:
//   - fp32 x, and bf16 x on AVX512-BF16 without AMX: our own *panel GEMM* (panel_gemm): panels of
//     weight rows dequantized into L2 scratch, laid out by input for the vector unit (fp32 FMAs,
//     or vdpbf16ps on the weights rounded to bf16), each met by all of x: nothing dequantized
//     leaves L2 and nothing is reordered for a library GEMM.
//   - bf16 x on a CPU with AMX: up to kAmxMaxRows rows, each 16 x 32 block of the weight
//     dequantized to bf16 into a tile, multiplied by tdpbf16ps into fp32 tiles (amx_bf16); past
//     that, the bf16 panels met by x on the tiles (AmxPanel).
//   - else (bf16 x without AVX512-BF16; fp16 x): chunks of weight rows dequantized into scratch
//     in x's dtype and multiplied by at::mm (oneDNN, dense_chunks).
// * else (but for the bf16 case below) in fp32 registers, with x exact, up to 4 rows of x meeting
//   a tile while it is in L1 (its scales widened once for them). With few rows, per group, the dot
//   product of x with the stored integers (widened to fp32) is scaled once: y = sum_g scale_g *
//   (x_g . q_g) + sum_g min_g * sum(x_g), the second from x's group sums, computed once per call;
//   with more rows than a group has vectors, the group is dequantized first (fewer FMAs,
//   kDequantFirst).
// * bf16 x with more rows than a group has vectors, on AVX512-BF16: each tile is dequantized once,
//   rounded to bf16 (as the dense bf16 GEMM rounds its weights) and kept in L1 scratch for all the
//   rows of x, multiplied by bf16 dot products (vdpbf16ps: 32 products per instruction, summed in
//   fp32), twice the multiplies of an fp32 FMA.
// Threads split the tiles (the panels).
//
// One source for AVX-512 and AVX2 (at::vec::Vectorized<float>, with the byte unpacking in the
// matching intrinsics) and a portable fallback; the ISA comes from CPU_CAPABILITY_* as in
// paged_attention_cpu.cpp.
#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <type_traits>
#include <vector>
#if defined(__AMX_TILE__)
#include <cpuid.h>
#include <sys/syscall.h>
#endif

namespace {

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
constexpr int kRowBlock = 4;        // rows of x per pass over a tile
// Fully unrolled fixed-size loops let the compiler keep the vector arrays in registers.
#define UNROLL _Pragma("GCC unroll 16")
constexpr int64_t kChunkBytes = 4 << 20;   // scratch per dequantized chunk of weight rows

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

  static inline void load(const uint8_t* p, Vec* out) {
    if constexpr (kInt4) {
      unpack_int4(p, out);
    } else {
      UNROLL
      for (int j = 0; j < kVecs; ++j) out[j] = unpack_int8(reinterpret_cast<const int8_t*>(p) + j * VL);
    }
  }
};

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
  I::load(q + at * I::kBytes, out);
  const Vec scale(s.scales[at]), min(s.mins ? s.mins[at] : 0.f);
  UNROLL
  for (int j = 0; j < I::kVecs; ++j) out[j] = at::vec::fmadd(out[j], scale, min);
}

// Calls f(R) with R = rows (1 .. kRowBlock) as a compile-time constant.
template <typename F>
inline void with_rows(int64_t rows, const F& f) {
  switch (rows) {
    case 4: f(std::integral_constant<int, 4>{}); break;
    case 3: f(std::integral_constant<int, 3>{}); break;
    case 2: f(std::integral_constant<int, 2>{}); break;
    default: f(std::integral_constant<int, 1>{}); break;
  }
}

// Calls block(NR, i0) over a tile's weight rows: all 4 at once where the R x 4 accumulators and R
// rows' x vectors fit the registers (AVX-512's 32; AVX2's 16 up to 2 rows of x), else 2 and 2.
template <int R, typename F>
inline void over_weight_rows(const F& block) {
  if constexpr (R <= 2 || VL == 16) {
    block(std::integral_constant<int, kTileRows>{}, 0);
  } else {
    block(std::integral_constant<int, kTileRows / 2>{}, 0);
    block(std::integral_constant<int, kTileRows / 2>{}, kTileRows / 2);
  }
}

template <int R, int NR>
inline void reduce_into(Vec (&acc)[R][NR], int i0, float (*y)[kTileRows]) {
  UNROLL
  for (int r = 0; r < R; ++r)
    UNROLL
    for (int i = 0; i < NR; ++i)
      y[r][i0 + i] = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, acc[r][i]);
}

// The fp32 blocks: the tile's weight rows i0 .. i0 + NR against R rows of x (row stride k), into
// y[r][i0 + i], over R x NR independent FMA chains.

// From the stored integers, widened once for the R rows; each group's dot is scaled once (the mins
// come from add_mins).
template <typename I, int R, int NR>
inline void scaled_block(const Tiles& w, const uint8_t* q, const TileScales& s, int i0, const float* x,
                         float (*y)[kTileRows]) {
  Vec acc[R][NR];
  UNROLL
  for (int r = 0; r < R; ++r)
    UNROLL
    for (int i = 0; i < NR; ++i) acc[r][i] = Vec(0.f);
  for (int64_t g = 0; g < w.groups; ++g) {
    const uint8_t* qg = q + g * kTileRows * I::kBytes;
    if (i0 == 0) prefetch_group<I>(qg);
    const float* sg = s.scales + g * kTileRows;
    Vec xv[R][I::kVecs];
    UNROLL
    for (int r = 0; r < R; ++r)
      UNROLL
      for (int j = 0; j < I::kVecs; ++j) xv[r][j] = Vec::loadu(x + r * w.k + g * I::kGroup + j * VL);
    UNROLL
    for (int i = 0; i < NR; ++i) {
      Vec qv[I::kVecs];
      I::load(qg + (i0 + i) * I::kBytes, qv);
      const Vec scale(sg[i0 + i]);
      UNROLL
      for (int r = 0; r < R; ++r) {
        Vec d = qv[0] * xv[r][0];
        UNROLL
        for (int j = 1; j < I::kVecs; ++j) d = at::vec::fmadd(qv[j], xv[r][j], d);
        acc[r][i] = at::vec::fmadd(d, scale, acc[r][i]);
      }
    }
  }
  reduce_into(acc, i0, y);
}

// Dequantizing first pays once a group's integers meet more rows of x than the group has vectors:
// per weight row and group, scaling each dot costs R * (kVecs + 1) FMAs, dequantizing first
// kVecs + R * kVecs (and takes the min in the same FMA).
template <typename I, int R>
constexpr bool kDequantFirst = R > I::kVecs;

// Each group dequantized first, the mins with it.
template <typename I, int R, int NR>
inline void dequantizing_block(const Tiles& w, const uint8_t* q, const TileScales& s, int i0, const float* x,
                               float (*y)[kTileRows]) {
  Vec acc[R][NR];
  UNROLL
  for (int r = 0; r < R; ++r)
    UNROLL
    for (int i = 0; i < NR; ++i) acc[r][i] = Vec(0.f);
  for (int64_t g = 0; g < w.groups; ++g) {
    if (i0 == 0) prefetch_group<I>(q + g * kTileRows * I::kBytes);
    Vec xv[R][I::kVecs];
    UNROLL
    for (int r = 0; r < R; ++r)
      UNROLL
      for (int j = 0; j < I::kVecs; ++j) xv[r][j] = Vec::loadu(x + r * w.k + g * I::kGroup + j * VL);
    UNROLL
    for (int i = 0; i < NR; ++i) {
      Vec wv[I::kVecs];
      dequantize_group<I>(q, s, g, i0 + i, wv);
      UNROLL
      for (int r = 0; r < R; ++r)
        UNROLL
        for (int j = 0; j < I::kVecs; ++j) acc[r][i] = at::vec::fmadd(wv[j], xv[r][j], acc[r][i]);
    }
  }
  reduce_into(acc, i0, y);
}

// y[i] += sum_g mins[g][i] * xsums[g][i] for a tile's rows i, as products of two runs of floats
// (the min's contribution: min * the sum of x over the group).
inline void add_mins(const float* mins, const float* xsums, int64_t count, float* y) {
  static_assert(VL % kTileRows == 0, "a vector holds whole groups");
  Vec acc[2] = {Vec(0.f), Vec(0.f)};
  int64_t i = 0;
  for (; i + 2 * VL <= count; i += 2 * VL)
    UNROLL
    for (int h = 0; h < 2; ++h) acc[h] = at::vec::fmadd(Vec::loadu(mins + i + h * VL), Vec::loadu(xsums + i + h * VL), acc[h]);
  for (; i < count; i += VL) {
    const int n = static_cast<int>(std::min<int64_t>(VL, count - i));
    acc[0] = at::vec::fmadd(Vec::loadu(mins + i, n), Vec::loadu(xsums + i, n), acc[0]);
  }
  float lanes[VL];
  (acc[0] + acc[1]).store(lanes);
  for (int l = 0; l < VL; ++l) y[l % kTileRows] += lanes[l];
}

// Threads split the tiles; a thread meets each of its tiles with all m rows of x, kRowBlock rows at
// a time: block(s, tile, wt, r0, rows, y) fills y[r][0 .. kTileRows) for x's rows r0 .. r0 + rows
// from the tile (its scales widened to fp32 in s where kWiden); wt: the thread's scratch of
// `scratch` Ts, or nullptr. out is in x's dtype O, so no call converts a whole output.
template <typename T, bool kWiden = true, typename O, typename Block>
void over_tiles(const Tiles& w, int64_t m, int64_t scratch, O* out, const Block& block) {
  const int64_t grain = std::max<int64_t>(2, 4096 / w.k);
  at::parallel_for(0, w.tiles, grain, [&](int64_t t0, int64_t t1) {
    std::vector<float> sbuf(kWiden ? 2 * w.scale_count() : 0);
    std::vector<T> wt(scratch);
    float y[kRowBlock][kTileRows];
    for (int64_t t = t0; t < t1; ++t) {
      const uint8_t* tile = w.tile(t);
      const TileScales s = kWiden ? TileScales(w, tile, sbuf.data()) : TileScales();
      for (int64_t r0 = 0; r0 < m; r0 += kRowBlock) {
        const int64_t rows = std::min<int64_t>(kRowBlock, m - r0);
        block(s, tile, wt.empty() ? nullptr : wt.data(), r0, rows, y);
        for (int64_t r = 0; r < rows; ++r)
          for (int i = 0; i < kTileRows && t * kTileRows + i < w.n; ++i)
            out[(r0 + r) * w.n + t * kTileRows + i] = static_cast<O>(y[r][i]);   // nearest even, as Tensor::to
      }
    }
  });
}

// x's sum over each group of G, kTileRows times over (the layout of a tile's mins): [m][G][kTileRows].
std::vector<float> group_sums(const float* x, int64_t m, int64_t k, int64_t group) {
  std::vector<float> sums(m * k / group * kTileRows);
  for (int64_t i = 0; i < static_cast<int64_t>(sums.size()) / kTileRows; ++i)
    std::fill_n(sums.data() + i * kTileRows, kTileRows,
                at::vec::reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, x + i * group, group));
  return sums;
}

// fp32 x in registers, each block of rows by its method (kDequantFirst).
template <typename I, typename O>
void registers(const Tiles& w, const float* x, int64_t m, O* out) {
  // x's sum over each group, kTileRows times over (the layout of a tile's mins), for add_mins,
  // where a block (the first or the last) scales its dots
  const int64_t first = std::min<int64_t>(m, kRowBlock), last = m - (m - 1) / kRowBlock * kRowBlock;
  const bool sums = w.has_mins && (first <= I::kVecs || last <= I::kVecs);
  const std::vector<float> xsums = sums ? group_sums(x, m, w.k, I::kGroup) : std::vector<float>();
  over_tiles<float>(w, m, 0, out,
                    [&](const TileScales& s, const uint8_t* tile, float*, int64_t r0, int64_t rows, float(*y)[kTileRows]) {
    const uint8_t* q = w.ints(tile);
    const float* xr = x + r0 * w.k;
    with_rows(rows, [&](auto R) {
      if constexpr (kDequantFirst<I, R>) {
        over_weight_rows<R>([&](auto NR, int i0) { dequantizing_block<I, R, NR>(w, q, s, i0, xr, y); });
      } else {
        over_weight_rows<R>([&](auto NR, int i0) { scaled_block<I, R, NR>(w, q, s, i0, xr, y); });
        if (s.mins)
          for (int r = 0; r < R; ++r) add_mins(s.mins, xsums.data() + (r0 + r) * w.scale_count(), w.scale_count(), y[r]);
      }
    });
  });
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

// bf16 x, R rows against a whole tile: 32 weights of a row at a time (one group or two) dequantized
// in fp32, rounded to bf16 (as the dense bf16 GEMM's weights are) and kept in wt where given, or
// read back from wt (kFromScratch); multiplied by vdpbf16ps, 32 products summed in fp32 each.
template <typename I, int R, bool kFromScratch>
inline void bf16_block(const Tiles& w, const uint8_t* q, const TileScales& s, const at::BFloat16* x,
                       at::BFloat16* wt, float (*y)[kTileRows]) {
  static_assert(VL == 16, "AVX-512 only");
  __m512 acc[R][kTileRows];
  UNROLL
  for (int r = 0; r < R; ++r)
    UNROLL
    for (int i = 0; i < kTileRows; ++i) acc[r][i] = _mm512_setzero_ps();
  const int64_t k = w.k;
  for (int64_t c = 0; c < k; c += 32) {
    if constexpr (!kFromScratch) prefetch_32<I>(q, c);
    __m512bh wv[kTileRows];
    UNROLL
    for (int i = 0; i < kTileRows; ++i) {
      if constexpr (kFromScratch) {
        wv[i] = reinterpret_cast<__m512bh>(_mm512_loadu_si512(wt + i * k + c));
      } else {
        wv[i] = dequantize_bf16<I>(q, s, c, i);
        if (wt) _mm512_storeu_si512(wt + i * k + c, reinterpret_cast<__m512i>(wv[i]));
      }
    }
    UNROLL
    for (int r = 0; r < R; ++r) {
      const __m512bh xv = reinterpret_cast<__m512bh>(_mm512_loadu_si512(x + r * k + c));
      UNROLL
      for (int i = 0; i < kTileRows; ++i) acc[r][i] = _mm512_dpbf16_ps(acc[r][i], xv, wv[i]);
    }
  }
  UNROLL
  for (int r = 0; r < R; ++r)
    UNROLL
    for (int i = 0; i < kTileRows; ++i) y[r][i] = _mm512_reduce_add_ps(acc[r][i]);
}

// bf16 x with more rows than a group has vectors: the first kRowBlock rows dequantize each tile into
// the thread's scratch (where there are more rows), the later ones read it.
template <typename I>
void bf16_registers(const Tiles& w, const at::BFloat16* x, int64_t m, at::BFloat16* out) {
  over_tiles<at::BFloat16>(w, m, m > kRowBlock ? kTileRows * w.k : 0, out,
                           [&](const TileScales& s, const uint8_t* tile, at::BFloat16* wt, int64_t r0, int64_t rows,
                               float(*y)[kTileRows]) {
    const uint8_t* q = w.ints(tile);
    with_rows(rows, [&](auto R) {
      if (r0 == 0)
        bf16_block<I, R, false>(w, q, s, x, wt, y);
      else
        bf16_block<I, R, true>(w, q, s, x + r0 * w.k, wt, y);
    });
  });
}
#endif

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
#define KAITEN_INT8_ACTIVATIONS 1
// int8 activations (llama.cpp's way): each row of x quantized once per call to int8 per block of 32
// (scale amax / 127, nearest even), its integers multiplied with the stored ones as unsigned x
// signed bytes, summed by 4 into int32 lanes: by vpdpbusd with AVX512-VNNI (64 products an
// instruction), else by vpmaddubsw and vpmaddwd (pairs into int16, then into int32). The 4 weight
// rows of a tile's group load as whole vectors (16 bytes a row: int4, int8 groups of 16; else 32),
// so each lane holds one weight row's part of the group's dot and takes that row's scale: per
// group, the dots to fp32, times the rows' scales and x's block scale, into fp32 accumulators, and
// the mins times the rounded x's group sums: so the result is the exact weight times the rounded
// x, whose error is the weight's (centred) times x's rounding. (Mins times x's exact sums leave the
// integers' (0 to 15) times the rounding: SmolLM2's Q4_1 perplexity with every row so was 18.53
// against 18.30 exact.) int8 weights are signed: with VNNI they meet x as w + 128 (unsigned), less
// 128 times x's bytes, the dot's starting value; without, as |w| against x times w's sign, so that
// a pair's sum fits int16 (128 * 127 * 2).
struct Int8Rows {
  int64_t k, groups;
  std::vector<int8_t> q;      // [m][k]
  std::vector<float> d;       // [m][k / 32]: x ~ q * d
  std::vector<float> sums;    // [m][groups]: sums of the rounded x over the weight's groups (with mins)
  std::vector<int32_t> corr;  // VNNI, int8 weights: [m][groups][kIntLanes]: -128 * the 4 bytes of x each lane meets
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
// Lane l of v4's 4 values as lanes[l], l < 16.
inline Vec spread4(__m128 v4, IVec lanes) { return Vec(_mm512_permutexvar_ps(lanes, _mm512_castps128_ps512(v4))); }
#else
using IVec = __m256i;
inline IVec iload(const void* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline void istore(void* p, IVec v) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), v); }
inline IVec low_nibbles(IVec b) { return _mm256_and_si256(b, _mm256_set1_epi8(0x0F)); }
inline IVec high_nibbles(IVec b) { return _mm256_and_si256(_mm256_srli_epi16(b, 4), _mm256_set1_epi8(0x0F)); }
inline IVec bcast16(const int8_t* p) { return _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline IVec bcast32(const int8_t* p) { return iload(p); }
inline Vec to_float(IVec v) { return Vec(_mm256_cvtepi32_ps(v)); }
inline Vec spread4(__m128 v4, IVec lanes) { return Vec(_mm256_permutevar8x32_ps(_mm256_castps128_ps256(v4), lanes)); }
#endif
constexpr int kIntLanes = sizeof(IVec) / 4;
#if defined(__AVX512VNNI__)
constexpr bool kVnni = true;
#else
constexpr bool kVnni = false;
#endif

// Each int32 lane's dot of unsigned bytes u0 with signed s0 and u1 with s1 (4 each), where every
// product of u and s is at most 15 * 127 (int4 weights against x).
inline IVec dot_u4(IVec u0, IVec s0, IVec u1, IVec s1) {
#if defined(__AVX512VNNI__)
  return _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), u0, s0), u1, s1);
#elif defined(CPU_CAPABILITY_AVX512)
  return _mm512_madd_epi16(_mm512_add_epi16(_mm512_maddubs_epi16(u0, s0), _mm512_maddubs_epi16(u1, s1)), _mm512_set1_epi16(1));
#else
  return _mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(u0, s0), _mm256_maddubs_epi16(u1, s1)), _mm256_set1_epi16(1));
#endif
}

// Each int32 lane's dot of signed bytes w (int8 weights) with signed x (4 each), from acc (VNNI's corr).
inline IVec dot_s8(IVec acc, IVec w, IVec x) {
#if defined(__AVX512VNNI__)
  return _mm512_dpbusd_epi32(acc, _mm512_xor_si512(w, _mm512_set1_epi8(static_cast<char>(0x80))), x);
#elif defined(CPU_CAPABILITY_AVX512)
  const IVec sx = _mm512_mask_sub_epi8(x, _mm512_movepi8_mask(w), _mm512_setzero_si512(), x);
  return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(_mm512_abs_epi8(w), sx), _mm512_set1_epi16(1)));
#else
  const IVec p = _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w));
  return _mm256_add_epi32(acc, _mm256_madd_epi16(p, _mm256_set1_epi16(1)));
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

// `blocks` blocks of 32 floats of x rounded to int8 into q (per block: scale amax / 127, nearest
// even), their scales into d.
inline void round_blocks(const float* x, int64_t blocks, int8_t* q, float* d) {
  for (int64_t b = 0; b < blocks; ++b) {
    const float amax = block_amax(x + b * 32);
    d[b] = amax / 127.f;
    round_block(x + b * 32, amax > 0.f ? 127.f / amax : 0.f, q + b * 32);
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
  constexpr int G = I::kGroup;
  constexpr bool kCorr = !I::kInt4 && kVnni;
  Int8Rows r{w.k, w.groups, std::vector<int8_t>(m * w.k), std::vector<float>(m * w.k / 32),
             std::vector<float>(w.has_mins ? m * w.groups : 0), std::vector<int32_t>(kCorr ? m * w.groups * kIntLanes : 0)};
  round_blocks(x, m * w.k / 32, r.q.data(), r.d.data());
  scaled_group_sums<G>(r.q.data(), r.d.data(), static_cast<int64_t>(r.sums.size()), r.sums.data());
#if defined(__AVX512VNNI__)
  const __m512i bias = _mm512_set1_epi8(static_cast<char>(0x80)), zero = _mm512_setzero_si512();
  for (int64_t i = 0; i < static_cast<int64_t>(r.corr.size()) / kIntLanes; ++i) {
    const int8_t* xg = r.q.data() + i * G;
    const __m512i xb = G == 32 ? bcast32(xg) : bcast16(xg);
    _mm512_storeu_si512(r.corr.data() + i * kIntLanes, _mm512_sub_epi32(zero, _mm512_dpbusd_epi32(zero, bias, xb)));
  }
#endif
  return r;
}

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
    with_rows(rows, [&](auto R) { int8_block<I, R>(w, tile, xq, r0, y); });
  });
}
#endif

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

// A group's bytes: a quarter of the core's L2 (1 MiB where the OS does not say). 2-core Xeon with
// AMX (2 MiB L2), bf16, Q4_1, gate_up 3072x576 / down 576x1536 at 256, 1024 and 2048 rows, time
// against oneDNN on the dense weight: groups of 192 KiB 1.11 / 0.59, 1.27 / 0.61, 1.56 / 1.10;
// 512 KiB 0.84 / 0.68, 1.05 / 0.49, 1.25 / 0.96; 1 MiB 0.84 / 0.77, 0.90 / 0.52, 1.18 / 0.92.
inline int64_t group_bytes() {
  static const int64_t bytes = [] {
    const long l2 = sysconf(_SC_LEVEL2_CACHE_SIZE);
    return static_cast<int64_t>(l2 > 0 ? l2 : 1 << 20) / 4;
  }();
  return bytes;
}

// The panel GEMMs, for many rows of x (prefill), in place of dequantized chunks into a library
// GEMM: no dequantized weight leaves L2 and nothing is reordered. Threads split the weight's panels
// of K::kPanel rows; each thread dequantizes a group of panels (about group_bytes()) into its
// scratch, laid out for the vector instructions (K::pack: kPanel / 2 weight rows a vector, by
// input), and meets them with all of x, K::kRows rows at a time (K::rows): each input of a row of
// x broadcast against a panel's two vectors, kRows x 2 accumulators summed over all of k, then
// stored as rows of the output. Those rows of x meet every panel of the group while they are in
// L1, so x, which outgrows L2 in a long prefill, is read once a group rather than once a panel.
// The last rows of x come from a copy padded with zero rows (a third, two thirds or all of kRows
// computed, the valid ones stored). x: m rows of `ld` elements of K::X.
template <typename K, typename I>
void panel_gemm(const Tiles& w, const typename K::X* x, int64_t m, int64_t ld, typename K::Out* out) {
  constexpr int R = K::kRows;
  constexpr int64_t kTiles = K::kPanel / kTileRows;
  const int64_t full = m / R * R, rest = m - full, size = K::panel_size(w);
  const int64_t group = std::clamp<int64_t>(group_bytes() / (size * sizeof(typename K::P)), 1, 32);
  std::vector<typename K::X> tail(rest ? R * ld : 0);
  std::copy(x + full * ld, x + m * ld, tail.begin());
  at::parallel_for(0, (w.tiles + kTiles - 1) / kTiles, 1, [&](int64_t b0, int64_t b1) {
    K kernel(w);
    Aligned<typename K::P> panels(group * size);
    typename K::Out* last = out + full * w.n;
    for (int64_t g0 = b0; g0 < b1; g0 += group) {
      const int64_t g1 = std::min(b1, g0 + group);
      for (int64_t b = g0; b < g1; ++b) kernel.template pack<I>(w, b * kTiles, panels.data() + (b - g0) * size);
      const auto meet = [&](auto mr, const typename K::X* xr, int64_t rows, typename K::Out* o) {
        for (int64_t b = g0; b < g1; ++b)
          kernel.template rows<decltype(mr)::value>(panels.data() + (b - g0) * size, xr, ld, rows, o, w.n, b * K::kPanel);
      };
      for (int64_t r0 = 0; r0 < full; r0 += R) meet(std::integral_constant<int, R>{}, x + r0 * ld, R, out + r0 * w.n);
      if (rest > 2 * R / 3)
        meet(std::integral_constant<int, R>{}, tail.data(), rest, last);
      else if (rest > R / 3)
        meet(std::integral_constant<int, 2 * R / 3>{}, tail.data(), rest, last);
      else if (rest > 0)
        meet(std::integral_constant<int, R / 3>{}, tail.data(), rest, last);
    }
  });
}

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

#if defined(KAITEN_INT8_ACTIVATIONS)
// The int8 panel GEMM: int8 activations for more rows than int8_block serves well. x's rows are
// rounded as quantize_rows rounds them, each into a record of x_record_bytes(): its k integers,
// then per block of 32 its scale (fp32) and per weight group the rounded x's sum (fp32, where
// the panel has mins: their factor). Zero records are zero rows, so panel_gemm's padded tail needs
// nothing more. A panel is
// 2 x kIntLanes weight rows, per group their scales and mins (fp32), then the group's integers
// by quads of inputs, [G / 4][kPanel][4] bytes, so one vector holds 4 inputs of kIntLanes weight
// rows and meets 4 bytes of a row of x broadcast to every lane: int4 as bytes 0-15 (vpmaddubsw
// pairs summed in int16 over a group: 8 x 2 x 15 x 127 fits; with VNNI vpdpbusd), int8 signed
// (|w| against x times w's sign, vpmaddwd each quad, each quad's |w| stored after its w: taken
// in the loop, 2 vpabsb a quad for 3 rows of x cost AVX2 on a Zen 4 1.01-1.08x the time at 32
// and 256 rows, bench/results/kernel_ab_zen4_avx2_absw.md; with VNNI as w + 128, and the panel's mins
// less 128 times the scales take back what that adds, in fp32 with the weight's own mins: an
// int32 correction per row and group before the scaling made GCC spill the 24 accumulators, half
// the speed on a Zen 4). Per group each row's int32 dots are scaled into fp32 accumulators, as in
// int8_block, and the output is written in x's dtype.
inline int64_t x_record_bytes(const Tiles& w) { return (w.k + 4 * (w.k / 32) + 4 * w.groups + 63) / 64 * 64; }

// Whether the int8 panel holds mins: the weight's, or the VNNI bias of int8 weights (w + 128).
template <typename I>
constexpr bool panel_biased() { return kVnni && !I::kInt4; }
template <typename I>
bool panel_mins(const Tiles& w) { return w.has_mins || panel_biased<I>(); }

template <typename I>
std::vector<int8_t> x_records(const Tiles& w, const float* x, int64_t m) {
  constexpr int G = I::kGroup;
  const int64_t ld = x_record_bytes(w);
  std::vector<int8_t> rec(m * ld);
  at::parallel_for(0, m, std::max<int64_t>(1, 16384 / w.k), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      int8_t* q = rec.data() + r * ld;
      float* d = reinterpret_cast<float*>(q + w.k);
      round_blocks(x + r * w.k, w.k / 32, q, d);
      if (panel_mins<I>(w)) scaled_group_sums<G>(q, d, w.groups, d + w.k / 32);
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

inline IVec iabs8(IVec v) {
#if defined(CPU_CAPABILITY_AVX512)
  return _mm512_abs_epi8(v);
#else
  return _mm256_abs_epi8(v);
#endif
}

// acc plus the dots of a panel's weight bytes w (a: their magnitudes, for the sign trick) with a
// quad of x in every lane: int16 pairs for int4 without VNNI (group_dot widens them), else int32.
template <typename I>
inline IVec quad_dot(IVec acc, IVec w, IVec a, IVec xb) {
#if defined(__AVX512VNNI__)
  return _mm512_dpbusd_epi32(acc, w, xb);     // int8 weights stored as w + 128
#elif defined(CPU_CAPABILITY_AVX512)
  if constexpr (I::kInt4) return _mm512_add_epi16(acc, _mm512_maddubs_epi16(w, xb));
  const IVec sx = _mm512_mask_sub_epi8(xb, _mm512_movepi8_mask(w), _mm512_setzero_si512(), xb);
  return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(a, sx), _mm512_set1_epi16(1)));
#else
  if constexpr (I::kInt4) return _mm256_add_epi16(acc, _mm256_maddubs_epi16(w, xb));
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(a, _mm256_sign_epi8(xb, w)), _mm256_set1_epi16(1)));
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

template <typename I, typename O>
struct Int8Panel {
  using X = int8_t;
  using Out = O;
  using P = uint8_t;
  static constexpr int G = I::kGroup;
  static constexpr bool kSignTrick = !I::kInt4 && !kVnni;   // int8 weights without VNNI
  static constexpr int kPanel = 2 * kIntLanes;
  // rows of x a pass: two integer accumulators each, besides the two weight vectors (and their
  // magnitudes for the sign trick), in AVX2's 16 or AVX-512's 32 registers
  static constexpr int kRows = kIntLanes == 16 ? (kSignTrick ? 6 : 12) : (kSignTrick ? 3 : 6);
  // bytes of a quad of inputs of the panel's rows: their weight bytes, then for the sign trick
  // their magnitudes (stored, not taken in the loop, where vpabsb competes with the multiplies)
  static constexpr int64_t kQuadBytes = 4 * kPanel * (kSignTrick ? 2 : 1);
  int64_t k, groups;
  bool mins;
  std::vector<float> sbuf;

  explicit Int8Panel(const Tiles& w) : k(w.k), groups(w.groups), mins(panel_mins<I>(w)), sbuf(2 * w.scale_count()) {}
  static int64_t group_size(bool has_mins) { return 4 * kPanel * (has_mins ? 2 : 1) + G / 4 * kQuadBytes; }
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
        uint8_t* ints = panel + g * gs + 4 * kPanel * (mins ? 2 : 1) + tt * kTileRows * 4;
        const uint8_t* q = real ? w.ints(tile) + g * kTileRows * I::kBytes : nullptr;
        if constexpr (G == 32)
          pack_group(q, ints);
        else
          for (int qd = 0; qd < G / 4; ++qd)
            for (int i = 0; i < kTileRows; ++i)
              for (int b = 0; b < 4; ++b)
                ints[qd * kQuadBytes + i * 4 + b] = real ? panel_byte(q[i * I::kBytes + 4 * qd + b]) : panel_byte(0);
      }
    }
    if constexpr (kSignTrick)
      for (int64_t g = 0; g < w.groups; ++g)
        for (int qd = 0; qd < G / 4; ++qd) {
          uint8_t* quad = panel + g * gs + 4 * kPanel * (mins ? 2 : 1) + qd * kQuadBytes;
          for (int v = 0; v < 2; ++v)
            istore(quad + 4 * kPanel + v * sizeof(IVec), iabs8(iload(quad + v * sizeof(IVec))));
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
      const uint8_t* ints = pg + 4 * kPanel * (mins ? 2 : 1);
      IVec dot0[MR], dot1[MR];
      UNROLL
      for (int r = 0; r < MR; ++r) dot0[r] = dot1[r] = IVec{};
      UNROLL
      for (int qd = 0; qd < G / 4; ++qd) {
        const uint8_t* quad = ints + qd * kQuadBytes;
        const IVec w0 = iload(quad), w1 = iload(quad + sizeof(IVec));
        const IVec a0 = kSignTrick ? iload(quad + 4 * kPanel) : w0;
        const IVec a1 = kSignTrick ? iload(quad + 4 * kPanel + sizeof(IVec)) : w1;
        UNROLL
        for (int r = 0; r < MR; ++r) {
          const IVec xb = bcast_quad(x + r * ld + g * G + 4 * qd);
          dot0[r] = quad_dot<I>(dot0[r], w0, a0, xb);
          dot1[r] = quad_dot<I>(dot1[r], w1, a1, xb);
          in_order(dot0[r]);
          in_order(dot1[r]);
        }
      }
      const Vec s0 = Vec::loadu(pg), s1 = Vec::loadu(pg + 4 * VL);
      UNROLL
      for (int r = 0; r < MR; ++r) {
        const float* d = reinterpret_cast<const float*>(x + r * ld + k);
        const Vec dx(d[g * G / 32]);
        Vec f0 = at::vec::fmadd(to_float(group_dot<I>(dot0[r])), s0 * dx, Vec(acc0[r]));
        Vec f1 = at::vec::fmadd(to_float(group_dot<I>(dot1[r])), s1 * dx, Vec(acc1[r]));
        if (mins) {
          const Vec sum(d[k / 32 + g]);
          f0 = at::vec::fmadd(Vec::loadu(pg + 4 * kPanel), sum, f0);
          f1 = at::vec::fmadd(Vec::loadu(pg + 4 * kPanel + 4 * VL), sum, f1);
        }
        acc0[r] = f0;
        acc1[r] = f1;
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

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Every tile 16 rows of 64 bytes, for this thread.
inline void configure_tiles() {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
  _tile_loadconfig(&cfg);
}

// bf16 x on AMX: Bf16Panel's panels, whose pairs of inputs by weight row are tdpbf16ps's B tiles
// as they lie (16 pairs x 16 weight rows: a half of the panel, rows of 128 bytes), met by x's rows
// as they lie (A tiles: 16 rows x 32 inputs), 32 rows of x a pass into 4 fp32 C tiles of 16 x 16
// summed over all of k, stored as bf16 rows. Tiles: C 0-3, A 4-5, B 6-7 (numbers must be literals).
struct AmxPanel : Bf16Panel {
  static constexpr int kRows = 32;
  alignas(64) float c_out[16 * 16];

  explicit AmxPanel(const Tiles& w) : Bf16Panel(w) { configure_tiles(); }
  ~AmxPanel() { _tile_release(); }
  AmxPanel(const AmxPanel&) = delete;
  AmxPanel& operator=(const AmxPanel&) = delete;

  template <int MR>
  void rows(const uint32_t* panel, const uint32_t* x, int64_t words, int64_t rows, at::BFloat16* out, int64_t n,
            int64_t n0) {
    const bool two = rows > 16;         // a second A tile: rows 16-31 of x (the tail copy has 32)
    const int64_t stride = words * 4;
    _tile_zero(0);
    _tile_zero(1);
    if (two) {
      _tile_zero(2);
      _tile_zero(3);
    }
    for (int64_t c = 0; c < words; c += 16) {
      _tile_loadd(6, panel + c * kPanel, kPanel * 4);
      _tile_loadd(7, panel + c * kPanel + 16, kPanel * 4);
      _tile_loadd(4, x + c, stride);
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 4, 7);
      if (two) {
        _tile_loadd(5, x + 16 * words + c, stride);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
      }
    }
    const int64_t cols = std::min<int64_t>(kPanel, n - n0), top = std::min<int64_t>(16, rows);
    _tile_stored(0, c_out, 64);
    store(top, out, n, n0, cols);
    _tile_stored(1, c_out, 64);
    store(top, out, n, n0 + 16, cols - 16);
    if (two) {
      _tile_stored(2, c_out, 64);
      store(rows - 16, out + 16 * n, n, n0, cols);
      _tile_stored(3, c_out, 64);
      store(rows - 16, out + 16 * n, n, n0 + 16, cols - 16);
    }
  }

  // c_out's first `count` rows, its first `cols` columns (of 16), rounded to bf16 into out[r][col0 ...].
  void store(int64_t count, at::BFloat16* out, int64_t n, int64_t col0, int64_t cols) const {
    if (cols <= 0) return;
    const __mmask16 mask = static_cast<__mmask16>((1u << std::min<int64_t>(16, cols)) - 1);
    for (int64_t r = 0; r < count; ++r)
      _mm256_mask_storeu_epi16(out + r * n + col0, mask, reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(_mm512_load_ps(c_out + r * 16))));
  }
};
#endif

// bf16 x without AVX512-BF16, and fp16 x: chunks of weight rows
// dequantized (in parallel) into scratch of about kChunkBytes in x's dtype T (each tile through an
// L1-sized fp32 buffer, so the weights are written once, at half the bytes), each chunk then
// multiplied by one at::mm (oneDNN), which spreads over the threads.
template <typename I, typename T>
at::Tensor dense_chunks(const Tiles& w, const at::Tensor& x) {
  static_assert(sizeof(T) == 2, "fp32 x takes the panel GEMM");
  const int64_t chunk = std::min(w.tiles, std::max<int64_t>(16, kChunkBytes / (w.k * sizeof(T) * kTileRows)));
  const bool one_chunk = chunk == w.tiles;          // at::mm's result is the output: no copy
  at::Tensor out = one_chunk ? at::Tensor() : at::empty({x.size(0), w.n}, x.options());
  at::Tensor scratch = at::empty({chunk * kTileRows, w.k}, x.options().dtype(c10::CppTypeToScalarType<T>::value));
  T* buf = scratch.data_ptr<T>();
  for (int64_t t0 = 0; t0 < w.tiles; t0 += chunk) {
    const int64_t tiles = std::min(chunk, w.tiles - t0), rows = std::min(tiles * kTileRows, w.n - t0 * kTileRows);
    at::parallel_for(0, tiles, 4, [&](int64_t i0, int64_t i1) {
      std::vector<float> sbuf(2 * w.scale_count());
      std::vector<float> tile_buf(kTileRows * w.k);
      for (int64_t t = i0; t < i1; ++t) {
        dequantize_tile<I>(w, w.tile(t0 + t), sbuf.data(), tile_buf.data());
        at::vec::convert(tile_buf.data(), buf + t * kTileRows * w.k, kTileRows * w.k);   // nearest even, as Tensor::to
      }
    });
    const at::Tensor y = at::mm(x, scratch.narrow(0, 0, rows).t());
    if (one_chunk) return y;
    out.narrow(1, t0 * kTileRows, rows).copy_(y);
  }
  return out;
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
// bf16 x on AMX, up to kAmxMaxRows rows: per block of 16 weight rows (4 tiles) and 32 inputs, the
// weights dequantized and rounded to bf16 into an A tile (a row each, as the dense bf16 GEMM rounds
// them), x in B tiles of 16 rows (laid out once per call in pairs, as vdpbf16ps wants them), and
// tdpbf16ps into up to 2 fp32 C tiles of 16 x 16: weight rows x rows of x, summed over all of k
// before they are stored. Each block is dequantized in L1 while the tiles multiply, with no
// transpose: with few rows, faster than AmxPanel's panels (2-core Xeon with AMX, Q4_1, the four
// projections summed: 0.80x its time at 16 rows, 0.94x at 32, 1.28x at 64).
constexpr int64_t kAmxMaxRows = 32;     // 2 C tiles of 16 rows of x

// Whether this process may use AMX tiles: the CPU has them (CPUID 7.0 EDX bits 22, 24) and Linux
// grants the tile data state (arch_prctl ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA). Asked once.
bool amx_ready() {
  static const bool ready = [] {
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(d & (1u << 22)) || !(d & (1u << 24))) return false;
    return syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) == 0;
  }();
  return ready;
}

// x [m][k] as B tiles: [m / 16 blocks][k / 32][16 pairs of inputs][16 rows of x], each element a
// pair of bf16 (one 32-bit word: inputs 2p, 2p + 1), rows past m zero.
std::vector<uint32_t> x_as_b_tiles(const at::BFloat16* x, int64_t m, int64_t k) {
  const int64_t blocks = (m + 15) / 16, words = k / 2;
  std::vector<uint32_t> xb(blocks * words * 16, 0);
  for (int64_t r = 0; r < m; ++r) {
    const uint32_t* row = reinterpret_cast<const uint32_t*>(x + r * k);
    uint32_t* dst = xb.data() + r / 16 * words * 16 + r % 16;
    for (int64_t i = 0; i < words; ++i) dst[i * 16] = row[i];     // word i: chunk i / 16, pair i % 16
  }
  return xb;
}

// The 16 weight rows of tiles [t0, t0 + 4) at inputs [c, c + 32) into a as bf16 [16][32] (rows past the last tile zero).
template <typename I>
inline void dequantize_a_tile(const Tiles& w, int64_t t0, const TileScales* s, int64_t c, at::BFloat16* a) {
  for (int tt = 0; tt < 4; ++tt) {
    const int64_t t = t0 + tt;
    if (t >= w.tiles) {
      std::fill_n(a + tt * kTileRows * 32, kTileRows * 32, at::BFloat16(0.f));
      continue;
    }
    const uint8_t* q = w.ints(w.tile(t));
    prefetch_32<I>(q, c);
    for (int i = 0; i < kTileRows; ++i)
      _mm512_storeu_si512(a + (tt * kTileRows + i) * 32, reinterpret_cast<__m512i>(dequantize_bf16<I>(q, s[tt], c, i)));
  }
}

// c_out [16 weight rows][16 rows of x] (a stored C tile) into out [rows of x][n].
inline void store_c(const float* c_out, const Tiles& w, int64_t t0, int64_t m, int64_t row0, float* out) {
  const __m512i column = _mm512_setr_epi32(0, 16, 32, 48, 64, 80, 96, 112, 128, 144, 160, 176, 192, 208, 224, 240);
  const int64_t n0 = t0 * kTileRows;
  const __mmask16 valid = static_cast<__mmask16>((1u << std::min<int64_t>(16, w.n - n0)) - 1);
  for (int r = 0; r < 16 && row0 + r < m; ++r)
    _mm512_mask_storeu_ps(out + (row0 + r) * w.n + n0, valid, _mm512_i32gather_ps(column, c_out + r, 4));
}

// One 32-input chunk: the weight block (A tile KA) against NB blocks of x, into C tiles 2-3. B
// tiles alternate between tmm1 and tmm7 (and A between tmm0 and tmm6, by chunk), so no load waits
// for a product still reading the tile it overwrites. (Tile numbers must be literals.)
#define KAITEN_AMX_CHUNK(KA)                                                             \
  do {                                                                                   \
    _tile_loadd(KA, a, 64);                                                              \
    _tile_loadd(1, b, 64);                                                               \
    _tile_dpbf16ps(2, KA, 1);                                                            \
    if constexpr (NB > 1) { _tile_loadd(7, b + stride, 64); _tile_dpbf16ps(3, KA, 7); }      \
  } while (0)

// NB blocks of 16 rows of x against the 16 weight rows of tiles [t0, t0 + 4), into out.
template <typename I, int NB>
void amx_block(const Tiles& w, int64_t t0, const TileScales* s, const uint32_t* xb, int64_t m,
               at::BFloat16 (*a2)[16 * 32], float* c_out, float* out) {
  const int64_t chunks = w.k / 32, stride = chunks * 256;
  _tile_zero(2);
  if constexpr (NB > 1) _tile_zero(3);
  for (int64_t c = 0; c < chunks; ++c) {
    const at::BFloat16* a = a2[c % 2];
    const uint32_t* b = xb + c * 256;
    dequantize_a_tile<I>(w, t0, s, c * 32, a2[c % 2]);
    if (c % 2 == 0)
      KAITEN_AMX_CHUNK(0);
    else
      KAITEN_AMX_CHUNK(6);
  }
  _tile_stored(2, c_out, 64);
  store_c(c_out, w, t0, m, 0, out);
  if constexpr (NB > 1) { _tile_stored(3, c_out, 64); store_c(c_out, w, t0, m, 16, out); }
}
#undef KAITEN_AMX_CHUNK

template <typename I>
at::Tensor amx_bf16(const Tiles& w, const at::Tensor& x) {
  const int64_t m = x.size(0), blocks = (m + 15) / 16;
  const at::Tensor xc = x.contiguous();
  const std::vector<uint32_t> xb = x_as_b_tiles(xc.data_ptr<at::BFloat16>(), m, w.k);
  at::Tensor out = at::empty({m, w.n}, x.options().dtype(at::kFloat));
  float* o = out.data_ptr<float>();
  at::parallel_for(0, (w.tiles + 3) / 4, 1, [&](int64_t b0, int64_t b1) {
    configure_tiles();
    alignas(64) at::BFloat16 a[2][16 * 32];
    alignas(64) float c_out[16 * 16];
    std::vector<float> sbuf(4 * 2 * w.scale_count());
    TileScales s[4];
    for (int64_t blk = b0; blk < b1; ++blk) {
      const int64_t t0 = blk * 4;
      for (int tt = 0; tt < 4 && t0 + tt < w.tiles; ++tt) s[tt] = TileScales(w, w.tile(t0 + tt), sbuf.data() + tt * 2 * w.scale_count());
      if (blocks == 2)
        amx_block<I, 2>(w, t0, s, xb.data(), m, a, c_out, o);
      else
        amx_block<I, 1>(w, t0, s, xb.data(), m, a, c_out, o);
    }
    _tile_release();
  });
  return out.to(x.scalar_type());
}
#endif

// f(out's data): float, at::BFloat16 or at::Half pointer by its dtype.
template <typename F>
void with_out(at::Tensor& out, const F& f) {
  if (out.scalar_type() == at::kFloat) f(out.data_ptr<float>());
  else if (out.scalar_type() == at::kBFloat16) f(out.data_ptr<at::BFloat16>());
  else f(out.data_ptr<at::Half>());
}

// x's values as contiguous fp32: its own data where it is that already, else widened into buf
// (a plain loop: a decode step's few rows are not worth a TensorIterator).
const float* as_float(const at::Tensor& x, std::vector<float>& buf) {
  if (x.scalar_type() == at::kFloat && x.is_contiguous()) return x.data_ptr<float>();
  const at::Tensor xc = x.contiguous();
  buf.resize(xc.numel());
  if (xc.scalar_type() == at::kBFloat16)
    at::vec::convert(xc.data_ptr<at::BFloat16>(), buf.data(), xc.numel());
  else if (xc.scalar_type() == at::kHalf)
    at::vec::convert(xc.data_ptr<at::Half>(), buf.data(), xc.numel());
  else
    TORCH_CHECK(false, "quant_linear: x must be float32, bfloat16 or float16, not ", xc.scalar_type());
  return buf.data();
}

#if defined(KAITEN_INT8_ACTIVATIONS)
// Rows of x up to which int8 activations take int8_block, from there the int8 panel GEMM. 2-core
// Zen 3 EPYC (AVX2), 2 threads, gate_up 3072x576 and down 576x1536, GMAC/s block / panel: Q4_1
// 4 rows 72 / 36 and 51 / 37, 8 rows 77 / 50 and 44 / 49, 16 rows 74 / 67 and 48 / 82; Q8_0 4 rows
// 44 / 39 and 30 / 29, 8 rows 39 / 52 and 36 / 44, 16 rows 43 / 63 and 37 / 66. AVX-512: 16, the
// rows int8_block served alone before it; on a 2-core Zen 4 (VNNI, bf16 x, 2 threads, the four
// projection shapes, noisy runs) the panel at 8-16 rows ran at 0.7-1.9x the block's rate by shape and
// format, not measured in an engine.
constexpr int64_t kInt8BlockRows = kIntLanes == 16 ? 16 : 8;

template <typename I>
at::Tensor int8_gemm(const Tiles& w, const at::Tensor& x) {
  const int64_t m = x.size(0);
  std::vector<float> buf;
  const std::vector<int8_t> rec = x_records<I>(w, as_float(x, buf), m);
  at::Tensor out = at::empty({m, w.n}, x.options());
  with_out(out, [&](auto* o) {
    panel_gemm<Int8Panel<I, std::remove_pointer_t<decltype(o)>>, I>(w, rec.data(), m, x_record_bytes(w), o);
  });
  return out;
}
#endif

template <typename I>
at::Tensor run(const Tiles& w, const at::Tensor& x, int64_t min_dense_rows, int64_t int8_rows) {
  const int64_t m = x.size(0);
#if defined(KAITEN_INT8_ACTIVATIONS)
  const bool int8 = m <= int8_rows && w.k % 32 == 0;
  if (int8 && m > kInt8BlockRows) return int8_gemm<I>(w, x);
#else
  constexpr bool int8 = false;
#endif
  if (m >= min_dense_rows) {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
    // with AMX, its tile kernel up to kAmxMaxRows, then the AMX panel GEMM
    const bool amx = x.scalar_type() == at::kBFloat16 && w.k % 32 == 0 && amx_ready();
    if (amx && m <= kAmxMaxRows) return amx_bf16<I>(w, x);
    if (amx) return bf16_gemm<AmxPanel, I>(w, x);
#else
    [[maybe_unused]] constexpr bool amx = false;
#endif
#if defined(__AVX512BF16__)
    if (x.scalar_type() == at::kBFloat16 && w.k % 32 == 0 && !amx) return bf16_gemm<Bf16Panel, I>(w, x);
#endif
    if (x.scalar_type() == at::kBFloat16) return dense_chunks<I, at::BFloat16>(w, x);
    if (x.scalar_type() == at::kHalf) return dense_chunks<I, at::Half>(w, x);
    return fp32_gemm<I>(w, x);
  }
  at::Tensor out = at::empty({m, w.n}, x.options());
#if defined(__AVX512BF16__)
  if (!int8 && x.scalar_type() == at::kBFloat16 && m > I::kVecs && w.k % 32 == 0) {
    const at::Tensor xb = x.contiguous();
    bf16_registers<I>(w, xb.data_ptr<at::BFloat16>(), m, out.data_ptr<at::BFloat16>());
    return out;
  }
#endif
  std::vector<float> buf;
  const float* xf = as_float(x, buf);
  with_out(out, [&](auto* o) {
#if defined(KAITEN_INT8_ACTIVATIONS)
    if (int8) return int8_activations<I>(w, xf, m, o);
#endif
    registers<I>(w, xf, m, o);
  });
  return out;
}

at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& tiles, int64_t n, int64_t k, int64_t bits,
                        int64_t group, bool has_mins, int64_t min_dense_rows, int64_t int8_rows) {
  TORCH_CHECK(tiles.dim() == 2 && tiles.is_contiguous() && tiles.scalar_type() == at::kByte,
              "quant_linear: tiles must be a contiguous uint8 matrix");
  TORCH_CHECK((bits == 4 && group == 32) || (bits == 8 && (group == 16 || group == 32)),
              "quant_linear: unsupported format: ", bits, "-bit groups of ", group);
  TORCH_CHECK(k > 0 && k % group == 0 && x.size(-1) == k, "quant_linear: x has ", x.size(-1), " features, the weight ", k);
  const int64_t groups = k / group, tile_count = (n + kTileRows - 1) / kTileRows;
  TORCH_CHECK(tiles.size(0) == tile_count, "quant_linear: ", tiles.size(0), " tiles for ", n, " rows");
  // tile bytes = groups * kTileRows * (integer bytes + scale bytes * (1 + has_mins))
  const int64_t per = tiles.size(1) / (groups * kTileRows) - group * bits / 8;
  const int64_t scale_bytes = per / (has_mins ? 2 : 1);
  TORCH_CHECK(tiles.size(1) % (groups * kTileRows) == 0 && (scale_bytes == 2 || scale_bytes == 4) &&
                  per == scale_bytes * (has_mins ? 2 : 1),
              "quant_linear: tiles of ", tiles.size(1), " bytes do not match the format");
  const Tiles w{tiles.data_ptr<uint8_t>(), n, k, groups, tile_count, tiles.size(1), static_cast<int>(scale_bytes), has_mins};
  const at::Tensor x2 = x.reshape({-1, k});
  at::Tensor out;
  if (bits == 4)
    out = run<Ints<true, 32>>(w, x2, min_dense_rows, int8_rows);
  else if (group == 32)
    out = run<Ints<false, 32>>(w, x2, min_dense_rows, int8_rows);
  else
    out = run<Ints<false, 16>>(w, x2, min_dense_rows, int8_rows);
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = n;
  return out.view(shape);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kaiten_cpu, m) {
  m.def("quant_linear(Tensor x, Tensor tiles, int n, int k, int bits, int group, bool has_mins, int min_dense_rows, int int8_rows=0) -> Tensor");
}

TORCH_LIBRARY_IMPL(kaiten_cpu, CPU, m) { m.impl("quant_linear", &quant_linear); }
