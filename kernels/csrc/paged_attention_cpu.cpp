// Fused paged attention for the CPU (the contract is kernels/interface.py's).
//
// One kernel serves decodes and (chunked) prefills alike. The packed varlen batch is cut into
// work items (sequence, kv head, tile of up to kMaxTileRows / G query tokens); a step of many
// decodes has one item per sequence over all kv heads instead (see plan_items). An item holds the
// G query heads of its kv head for each of its tokens as R = tokens * G fp32 query rows (scaled),
// and walks the context in tiles of KT = 16 keys read in place from the paged cache (no gather
// copy), so each K and V row is read once per item for all R rows. Per key tile:
//   S = Q K^T   many rows (prefill): the K tile is converted to fp32 and transposed to [D][KT],
//               and the dot products are vector FMAs over keys; few rows (decode, R <= 4): dot
//               products straight from the cache rows, 4 keys at a time against all rows
//               (each key widened once), one reduction per row and 4 keys;
//   softmax     online: running max and sum per row in fp32, causal mask per row (query j of a
//               sequence sits at position ctx - q_len + j and sees keys 0..that position);
//   O += P V    vector FMAs over head_dim, O in fp32.
// With AVX512-BF16 and a bf16 cache (head_dim a multiple of 32), both products multiply bf16
// pairs instead (vdpbf16ps, fp32 sums): S from the bf16 query and K as they are, O from P rounded
// to bf16 and the V rows as they are. No conversion to fp32: 16% less time per decode step and
// 15% per prefill chunk than the fp32 products (one thread, 1 GiB cache, 30 layers).
// While a tile is computed, the next tile's K/V rows are prefetched (they are strided and
// scattered over blocks; waiting for them otherwise dominates a decode).
//
// Parallelism: items are sorted by estimated cost (rows x keys), longest first, and the threads of
// at::parallel_for pull them from a shared atomic counter, so a step of many short decodes and a
// step with one long prefill chunk both keep every thread busy. Each thread has its own scratch.
// A step of too few decode items for the threads (one sequence: as many items as kv heads) splits
// each over its context; the parts' unnormalised rows, maxima and sums are merged after
// (split_decodes, combine_parts), so one stream's attention uses every core.
//
// A sliding window of W keys (the `window` argument, 0: none) gives each query row its own first
// key, pos - W + 1: an item's key loop starts at its first row's (at the tile, or the block, holding
// it), the rows mask the keys before theirs as they mask those after their position, and a split
// decode splits the window's keys. Blocks wholly before the first query's window are never read:
// the engine may have released them.
//
// A bf16 chunk of at least kFlashMinTokens query tokens, on a CPU with AMX, goes instead to ATen's
// flash attention (at::scaled_dot_product_attention), whose bf16 GEMMs run on AMX tiles: 2-core
// Xeon with AMX, 30 layers of SmolLM2's heads (9 query, 3 kv, head_dim 64), a 256-token prompt
// 18.0 ms against 27.6 here (SDPA itself 14.6, the rest the gather and copies); SDPA at 64 tokens
// 2.6 against 3.6 (fp32: 38.3 against 28.2 at 256, so fp32 stays).
//
// Written against ATen's at::vec::Vectorized<float>; the build picks AVX-512 or AVX2 through the
// CPU_CAPABILITY_* macro and the matching -m flags, and needs -fopenmp (kernels/cpu_attention.py).
#include "aten_ops.h"

#include <ATen/Parallel.h>
#include <ATen/cpu/Utils.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <optional>
#include <type_traits>
#include <vector>

#include "with_rows.h"

namespace {

using kaiten::with_rows_upto;

using Vec = at::vec::Vectorized<float>;
constexpr int VL = Vec::size();            // floats per vector: 16 (AVX-512), 8 (AVX2, portable)
constexpr int KT = 16;                     // keys per tile
constexpr int KV = KT / VL;                // vectors per row of scores
constexpr int RB = 4;                      // rows per P V register block; most rows of a direct item
constexpr int kMaxTileRows = 64;           // target rows (tokens x G) per work item
constexpr float kNegInf = -std::numeric_limits<float>::infinity();
static_assert(KT % VL == 0, "a key tile must be whole vectors");
// Fully unrolled fixed-size loops let the compiler keep the accumulator arrays in registers.
#define UNROLL _Pragma("GCC unroll 16")

struct Geometry {
  int64_t hq, hkv, group, d, dp, block_size, num_blocks, max_blocks;
  int64_t q_tok_stride, q_head_stride;     // q strides (elements)
  int64_t kv_row_stride;                   // cache stride between consecutive token slots
};

struct WorkItem {
  int32_t seq, kv_head, num_kv, q_begin, q_end;   // kv heads [kv_head, kv_head + num_kv), query
  int64_t cost;                                   // tokens [q_begin, q_end) of the sequence
  int32_t key_begin = 0, key_end = -1;            // key positions [key_begin, key_end) (-1: to the last);
                                                  // key_begin: from the first row's window on
  int32_t part = -1;                              // >= 0: a split decode's part (Inputs::part_o/m/l)
};

// A decode split over its context (few sequences, so too few items for the threads): each part
// leaves its rows unnormalised, with their running max and sum, and combine_parts merges them.
struct SplitGroup {
  int32_t seq, kv_head, first_part, num_parts;
};

// Per-thread fp32 scratch. Padding columns [d, dp) stay zero for the lifetime of the buffers.
struct Scratch {
  std::vector<float> q, o, kf, kt, vf, s, p, lsum, m, corr;
  std::vector<c10::BFloat16> qb;           // unscaled bf16 query rows (bf16 dot products)
  std::vector<uint32_t> kt2;               // K tile as bf16 pairs [dp / 2][KT] (bf16 dot products)
  std::vector<uint32_t> pp;                // P as bf16 pairs [rows][KT / 2] (bf16 dot products)
  std::vector<int64_t> pos;                // context position of each row's token
  std::vector<int64_t> lo;                 // the first key position each row sees (its window's)
  std::vector<int> first, valid;           // per tile: each row sees its keys [first, valid)
  int64_t rows, d, dp;
  Scratch(int64_t rows, int64_t d, int64_t dp)
      : q(rows * dp, 0.f), o(rows * dp, 0.f), kf(KT * dp, 0.f), kt(dp * KT, 0.f),
        vf(KT * dp, 0.f), s(rows * KT, 0.f), p(rows * KT, 0.f), lsum(rows * KT, 0.f),
        m(rows, kNegInf), corr(rows, 1.f), qb(rows * dp), kt2(dp / 2 * KT, 0), pp(rows * KT / 2, 0), pos(rows, 0),
        lo(rows, 0), first(rows, 0), valid(rows, 0), rows(rows), d(d), dp(dp) {}
};

// The calling thread's Scratch, kept between calls (OpenMP's threads persist): a decode step's 30
// calls otherwise allocate and zero its 15 buffers on every thread each time. Made anew when the
// shape differs, so the padding columns of one head size are never another's.
Scratch& thread_scratch(int64_t rows, const Geometry& g) {
  thread_local std::unique_ptr<Scratch> scratch_cache;
  if (!scratch_cache || scratch_cache->rows != rows || scratch_cache->d != g.d || scratch_cache->dp != g.dp)
    scratch_cache = std::make_unique<Scratch>(rows, g.d, g.dp);
  return *scratch_cache;
}

// ------------------------------------------------------------------------------ loads / stores
// VL elements at p as fp32.
template <typename T>
inline Vec load_f32(const T* p) {
  if constexpr (std::is_same_v<T, float>) {
    return Vec::loadu(p);
  } else {
    Vec v;
    at::vec::load_to_float<T>(p, v);
    return v;
  }
}

// Horizontal sum / max. Vectorized::reduce_* does not compile in at::vec's portable build.
inline float hsum(const Vec& v) {
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
  return v.reduce_add();
#else
  return at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, v);
#endif
}
inline float hmax(const Vec& v) {
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
  return v.reduce_max();
#else
  return at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return at::vec::maximum(a, b); }, v);
#endif
}

template <typename T>
inline void row_to_f32(const T* src, float* dst, int64_t d) {
  int64_t i = 0;
  for (; i + VL <= d; i += VL) load_f32(src + i).store(dst + i);
  for (; i < d; ++i) dst[i] = static_cast<float>(src[i]);
}

// Element offsets of the tile's key positions [kt0, kt0 + nk) in the cache, for one kv head (the
// same for k_cache and v_cache).
inline void tile_offsets(const int32_t* table, int64_t kt0, int nk, int64_t kv_head,
                         const Geometry& g, int64_t* offs) {
  int64_t b = kt0 / g.block_size, off = kt0 % g.block_size;
  int64_t base = (table[b] * g.block_size) * g.kv_row_stride + kv_head * g.d;
  for (int j = 0; j < nk; ++j) {
    offs[j] = base + off * g.kv_row_stride;
    if (++off == g.block_size && j + 1 < nk) {
      off = 0;
      base = (table[++b] * g.block_size) * g.kv_row_stride + kv_head * g.d;
    }
  }
}

// Asks for d elements at each of the next tile's rows while this one is computed: the rows are
// scattered over blocks, and waiting on them otherwise dominates a decode. Into L2 (locality 2):
// measured twice as fast as into L1, which has few slots for misses in flight.
template <typename T>
inline void prefetch_rows(const T* cache, const int64_t* offs, int nk, int64_t d) {
  constexpr int64_t kLine = 64 / sizeof(T);
  for (int j = 0; j < nk; ++j)
    for (int64_t i = 0; i < d; i += kLine) __builtin_prefetch(cache + offs[j] + i, 0, 2);
}

// ------------------------------------------------------------------------------ S = Q K^T
// NR query rows against one key tile: s[r][0:KT] = sum_d q[r][d] * kt[d][0:KT]. NR x KV
// independent FMA chains; the q[r][d] broadcasts fold into the FMAs.
template <int NR>
inline void qk_block(const float* q, int64_t dp, const float* kt, float* s) {
  Vec acc[NR * KV];
  UNROLL for (int i = 0; i < NR * KV; ++i) acc[i] = Vec(0.f);
  for (int64_t d = 0; d < dp; ++d) {
    Vec k[KV];
    UNROLL for (int v = 0; v < KV; ++v) k[v] = Vec::loadu(kt + d * KT + v * VL);
    UNROLL for (int r = 0; r < NR; ++r) {
      const Vec a(q[r * dp + d]);
      UNROLL for (int v = 0; v < KV; ++v) acc[r * KV + v] = at::vec::fmadd(a, k[v], acc[r * KV + v]);
    }
  }
  UNROLL for (int r = 0; r < NR; ++r)
    UNROLL for (int v = 0; v < KV; ++v) acc[r * KV + v].store(s + r * KT + v * VL);
}

// Rows a block: their NR x KV accumulators, KV key vectors and a broadcast in the registers.
// AVX2's 16 hold 6 rows; with 8, GCC kept 3 accumulators on the stack, and 6 rows here and in
// P V (kPvRows) took a prefill 0.76-0.86x the time (Zen 4, AVX2 build, 30 layers of SmolLM2's
// heads, 1 and 2 threads, bench/results/attention_ab/attention_ab_zen4_avx2.md). On AVX-512, 16 rows here and
// 8 in P V took 1.03-1.10x the time of 8 and 4 (attention_ab_zen4_avx512.md).
constexpr int kQkRows = VL == 16 ? 8 : 6;

inline void qk_rows(const float* q, int64_t rows, int64_t dp, const float* kt, float* s) {
  int64_t r = 0;
  for (; r + kQkRows <= rows; r += kQkRows) qk_block<kQkRows>(q + r * dp, dp, kt, s + r * KT);
  with_rows_upto<kQkRows - 1>(rows - r, [&](auto nr) { qk_block<decltype(nr)::value>(q + r * dp, dp, kt, s + r * KT); });
}

// Few rows (a decode: the G heads of one token): dot products straight from the cache rows,
// cheaper than converting and transposing the tile for so few rows. Needs d == dp. With AVX-512
// or AVX2, 4 keys at a time against all rows: a 32 x 384 decode step's 30 layers with an fp16
// cache took 1.23-1.33x the time with the 16-bit rows widened into scratch first and then, per
// row, a horizontal sum per key (AVX2) or 16 keys summed by one hsum16 (AVX-512), on a Zen 4
// (bench/results/attention_one_stream/attention_one_stream_zen4_*.md). Elsewhere one horizontal sum per key.
#if defined(CPU_CAPABILITY_AVX512)
// out[j] = the sum of a[j]'s 16 lanes, for 16 vectors: a tree of lane shuffles and adds (45
// instructions where 16 horizontal sums take about 130). For the bf16 dot products.
__attribute__((always_inline)) inline __m512 hsum16(const __m512* a) {
  __m512 c[8], e[4], f[2];
  for (int i = 0; i < 8; ++i)   // 256-bit halves: key 2i | key 2i+1, 8 partial sums each
    c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x44),
                         _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xEE));
  for (int i = 0; i < 4; ++i)   // 128-bit lanes: keys 4i .. 4i+3, 4 partial sums each
    e[i] = _mm512_add_ps(_mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], 0xDD));
  for (int i = 0; i < 2; ++i)   // lane k: 2 partial sums of keys 8i+k, 8i+4+k
    f[i] = _mm512_add_ps(_mm512_shuffle_ps(e[2 * i], e[2 * i + 1], 0x44),
                         _mm512_shuffle_ps(e[2 * i], e[2 * i + 1], 0xEE));
  const __m512 t = _mm512_add_ps(_mm512_shuffle_ps(f[0], f[1], 0x88), _mm512_shuffle_ps(f[0], f[1], 0xDD));
  // element m of 128-bit lane k holds key 4m + k
  return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), t);
}
#endif

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
// v's lanes summed pairwise into 8 (AVX-512: its two halves added).
__attribute__((always_inline)) inline __m256 to_m256(const Vec& v) {
#if defined(CPU_CAPABILITY_AVX512)
  return _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
#else
  return v;
#endif
}

// The sums of KB (4 or 2) vectors' 8 lanes each into out[0 .. KB).
template <int KB>
__attribute__((always_inline)) inline void hsum_keys(const __m256* a, float* out) {
  if constexpr (KB == 4) {
    const __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1)));
  } else {
    const __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t = _mm256_hadd_ps(t0, t0);
    _mm_storel_pi(reinterpret_cast<__m64*>(out), _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1)));
  }
}

// KB keys at a time against all NR rows: each key's VL elements widened once (16-bit caches) for
// every row, NR x KB accumulators, then one horizontal sum per row and KB keys. Keys past nk
// repeat the last one (masked later).
template <int NR, typename T>
inline void qk_direct_block(const float* q, int64_t dp, const T* const* krows, int nk, float* s) {
  constexpr int KB = NR == 4 && VL == 8 ? 2 : 4;   // NR x KB accumulators in AVX2's 16 registers
  const T* k[KT];
  for (int j = 0; j < KT; ++j) k[j] = krows[std::min(j, nk - 1)];
  for (int j0 = 0; j0 < nk; j0 += KB) {
    Vec acc[NR][KB];
    UNROLL for (int r = 0; r < NR; ++r)
      UNROLL for (int b = 0; b < KB; ++b) acc[r][b] = Vec(0.f);
    for (int64_t c = 0; c < dp; c += VL) {
      UNROLL for (int b = 0; b < KB; ++b) {
        const Vec kv = load_f32(k[j0 + b] + c);
        UNROLL for (int r = 0; r < NR; ++r) acc[r][b] = at::vec::fmadd(Vec::loadu(q + r * dp + c), kv, acc[r][b]);
      }
    }
    UNROLL for (int r = 0; r < NR; ++r) {
      __m256 h[KB];
      UNROLL for (int b = 0; b < KB; ++b) h[b] = to_m256(acc[r][b]);
      hsum_keys<KB>(h, s + r * KT + j0);
    }
  }
}
#else
template <int NR, typename T>
inline void qk_direct_block(const float* q, int64_t dp, const T* const* krows, int nk, float* s) {
  for (int j = 0; j < nk; ++j) {
    Vec acc[NR];
    UNROLL for (int r = 0; r < NR; ++r) acc[r] = Vec(0.f);
    for (int64_t c = 0; c < dp; c += VL) {
      const Vec k = load_f32(krows[j] + c);
      UNROLL for (int r = 0; r < NR; ++r) acc[r] = at::vec::fmadd(Vec::loadu(q + r * dp + c), k, acc[r]);
    }
    UNROLL for (int r = 0; r < NR; ++r) s[r * KT + j] = hsum(acc[r]);
  }
}
#endif

template <typename T>
inline void qk_direct(const float* q, int64_t rows, int64_t dp, const T* const* krows, int nk, float* s) {
  with_rows_upto<RB>(rows, [&](auto nr) { qk_direct_block<decltype(nr)::value>(q, dp, krows, nk, s); });
}

// ------------------------------------------------------------------------------ online softmax
// Row r sees keys [first[r], valid[r]) of the tile (none when empty). Rescales the running sum,
// writes p = exp(s - new max) (0 for masked keys) and the factor corr[r] that rescales the output row.
inline void softmax_update(Scratch& w, int64_t rows) {
  for (int64_t r = 0; r < rows; ++r) {
    float* s = w.s.data() + r * KT;
    float* p = w.p.data() + r * KT;
    const int f = w.first[r], n = w.valid[r];
    if (n <= f) {
      std::fill(p, p + KT, 0.f);
      w.corr[r] = 1.f;
      continue;
    }
    std::fill(s, s + f, kNegInf);
    std::fill(s + n, s + KT, kNegInf);
    Vec sv[KV];
    Vec mx(kNegInf);
    UNROLL for (int v = 0; v < KV; ++v) {
      sv[v] = Vec::loadu(s + v * VL);
      mx = at::vec::maximum(mx, sv[v]);
    }
    const float m_new = std::max(w.m[r], hmax(mx));
    // exp(-inf) = 0 on the first tile; no libm call where the max stands (most tiles of a decode)
    const float corr = m_new == w.m[r] ? 1.f : std::exp(w.m[r] - m_new);
    const Vec mv(m_new), cv(corr);
    float* l = w.lsum.data() + r * KT;
    UNROLL for (int v = 0; v < KV; ++v) {
      const Vec pv = (sv[v] - mv).exp_u20();
      pv.store(p + v * VL);
      at::vec::fmadd(Vec::loadu(l + v * VL), cv, pv).store(l + v * VL);
    }
    w.m[r] = m_new;
    w.corr[r] = corr;
  }
}

// ------------------------------------------------------------------------------ O += P V
// NR rows, NC vectors of head_dim starting at d0: o = o * corr + sum_j p[j] * v_j. The V rows are
// fp32 (converted, or an fp32 cache) or the cache's rows (converted here: few rows, a decode).
template <int NR, int NC, typename TV>
inline void pv_block(float* o, int64_t dp, const float* p, const float* corr,
                     const TV* const* vrows, int nkeys, int64_t d0) {
  Vec acc[NR][NC];
  UNROLL for (int r = 0; r < NR; ++r)
    UNROLL for (int c = 0; c < NC; ++c)
      acc[r][c] = Vec::loadu(o + r * dp + d0 + c * VL) * Vec(corr[r]);
  for (int j = 0; j < nkeys; ++j) {
    Vec vv[NC];
    UNROLL for (int c = 0; c < NC; ++c) vv[c] = load_f32(vrows[j] + d0 + c * VL);
    UNROLL for (int r = 0; r < NR; ++r) {
      const Vec pj(p[r * KT + j]);
      UNROLL for (int c = 0; c < NC; ++c) acc[r][c] = at::vec::fmadd(pj, vv[c], acc[r][c]);
    }
  }
  UNROLL for (int r = 0; r < NR; ++r)
    UNROLL for (int c = 0; c < NC; ++c) acc[r][c].store(o + r * dp + d0 + c * VL);
}

template <int NR, typename TV>
inline void pv_cols(float* o, int64_t dp, const float* p, const float* corr,
                    const TV* const* vrows, int nkeys) {
  int64_t d0 = 0;
  for (; d0 + 2 * VL <= dp; d0 += 2 * VL) pv_block<NR, 2>(o, dp, p, corr, vrows, nkeys, d0);
  for (; d0 < dp; d0 += VL) pv_block<NR, 1>(o, dp, p, corr, vrows, nkeys, d0);
}

// Rows a block: NR x 2 accumulators, 2 V vectors and a broadcast in the registers (kQkRows says why 6).
constexpr int kPvRows = VL == 16 ? RB : 6;

// Rows [r0, r1) of the item.
template <typename TV>
inline void pv_rows(Scratch& w, int64_t r0, int64_t r1, int64_t dp, const TV* const* vrows) {
  for (int64_t r = r0; r < r1; r += kPvRows) {
    const int64_t nr = std::min<int64_t>(kPvRows, r1 - r);
    const int nkeys = *std::max_element(w.valid.begin() + r, w.valid.begin() + r + nr);
    with_rows_upto<kPvRows>(nr, [&](auto n) {
      pv_cols<decltype(n)::value>(w.o.data() + r * dp, dp, w.p.data() + r * KT, w.corr.data() + r, vrows, nkeys);
    });
  }
}

// ------------------------------------------------------------------------------ S = Q K^T in bf16
// With AVX512-BF16 a bf16 cache is multiplied as it is: vdpbf16ps takes 32 bf16 of each operand
// and adds the two exact products of each pair to an fp32 lane. No conversion of K to fp32 and
// half the multiply instructions. The query rows are then the bf16 input, unscaled, and the
// scores are scaled after. Needs head_dim % 32 == 0.
#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512BF16__)
constexpr bool kBf16Dot = true;

inline __m512bh as_bh(__m512i v) { return (__m512bh)v; }

// Few rows (a decode), straight from the cache rows: per row, 16 key accumulators of NC
// vdpbf16ps each (head_dim = 32 NC), then one hsum16. Keys past nk repeat the last one (masked).
template <int NC>
inline void qk_direct_bf16(const c10::BFloat16* q, int64_t rows, int64_t dp,
                           const c10::BFloat16* const* krows, int nk, float scale, float* s) {
  const c10::BFloat16* k[KT];
  for (int j = 0; j < KT; ++j) k[j] = krows[std::min(j, nk - 1)];
  for (int64_t r = 0; r < rows; ++r) {
    __m512i qv[NC];
    UNROLL for (int c = 0; c < NC; ++c) qv[c] = _mm512_loadu_si512(q + r * dp + 32 * c);
    __m512 acc[KT];
    UNROLL for (int j = 0; j < KT; ++j) {
      acc[j] = _mm512_setzero_ps();
      UNROLL for (int c = 0; c < NC; ++c)
        acc[j] = _mm512_dpbf16_ps(acc[j], as_bh(qv[c]), as_bh(_mm512_loadu_si512(k[j] + 32 * c)));
    }
    _mm512_storeu_ps(s + r * KT, _mm512_mul_ps(hsum16(acc), _mm512_set1_ps(scale)));
  }
}

inline bool qk_direct_bf16(const c10::BFloat16* q, int64_t rows, int64_t dp,
                           const c10::BFloat16* const* krows, int nk, float scale, float* s) {
  switch (dp) {
    case 32: qk_direct_bf16<1>(q, rows, dp, krows, nk, scale, s); return true;
    case 64: qk_direct_bf16<2>(q, rows, dp, krows, nk, scale, s); return true;
    case 96: qk_direct_bf16<3>(q, rows, dp, krows, nk, scale, s); return true;
    case 128: qk_direct_bf16<4>(q, rows, dp, krows, nk, scale, s); return true;
    default: return false;
  }
}

// The K tile as pairs: kt2[p][j] = dims 2p, 2p+1 of key j (a 32-bit transpose of the rows).
inline void load_k_pairs(const c10::BFloat16* k_cache, const int64_t* offs, int nk, const Geometry& g,
                         Scratch& w) {
  const int64_t np = g.d / 2;                   // pairs per row
  const float* rows = nullptr;                  // 32-bit words, bit patterns moved as floats
  int64_t ld = 0;
  bool strided = nk == KT;
  for (int j = 1; strided && j < KT; ++j) strided = offs[j] - offs[j - 1] == g.kv_row_stride;
  if (strided) {
    rows = reinterpret_cast<const float*>(k_cache + offs[0]);
    ld = g.kv_row_stride / 2;
  } else {
    uint32_t* kf = reinterpret_cast<uint32_t*>(w.kf.data());
    for (int j = 0; j < nk; ++j) std::memcpy(kf + j * np, k_cache + offs[j], g.d * sizeof(c10::BFloat16));
    rows = w.kf.data();
    ld = np;
  }
  for (int64_t p0 = 0; p0 < np; p0 += 16)
    at::vec::transpose_mxn<float, KT, 16>(rows + p0, ld, reinterpret_cast<float*>(w.kt2.data()) + p0 * KT, KT);
}

// NR query rows against the pair tile: NR accumulators, one vdpbf16ps per row and pair.
template <int NR>
inline void qk_block_bf16(const c10::BFloat16* q, int64_t dp, const uint32_t* kt2, int64_t np, float scale,
                          float* s) {
  __m512 acc[NR];
  UNROLL for (int r = 0; r < NR; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t p = 0; p < np; ++p) {
    const __m512bh k = as_bh(_mm512_loadu_si512(kt2 + p * KT));
    UNROLL for (int r = 0; r < NR; ++r) {
      uint32_t pair;
      std::memcpy(&pair, q + r * dp + 2 * p, sizeof(pair));
      acc[r] = _mm512_dpbf16_ps(acc[r], as_bh(_mm512_set1_epi32(static_cast<int>(pair))), k);
    }
  }
  UNROLL for (int r = 0; r < NR; ++r) _mm512_storeu_ps(s + r * KT, _mm512_mul_ps(acc[r], _mm512_set1_ps(scale)));
}

inline void qk_rows_bf16(const c10::BFloat16* q, int64_t rows, int64_t dp, const uint32_t* kt2, int64_t np,
                         float scale, float* s) {
  constexpr int kRows = 16;
  int64_t r = 0;
  for (; r + kRows <= rows; r += kRows) qk_block_bf16<kRows>(q + r * dp, dp, kt2, np, scale, s + r * KT);
  for (; r + 4 <= rows; r += 4) qk_block_bf16<4>(q + r * dp, dp, kt2, np, scale, s + r * KT);
  for (; r < rows; ++r) qk_block_bf16<1>(q + r * dp, dp, kt2, np, scale, s + r * KT);
}
// ------------------------------------------------------------------------------ O += P V in bf16
// P is rounded to bf16 and multiplied in pairs of keys: vdpbf16ps adds p[j] v[j][d] + p[j+1]
// v[j+1][d] to the fp32 output lane of dim d. The pairs of two V rows come from 16-bit unpacks,
// which interleave within 128-bit lanes, so the output rows are kept in that order ("pair
// order"): in each 32-dim chunk, lane l of the first 16 floats holds dim 8 (l / 4) + l % 4 and
// lane l of the next 16 holds dim 8 (l / 4) + 4 + l % 4. store_pair_row puts them back.

// An output row in pair order, times inv, into dst in dim order as bf16 (RNE, as a cast).
inline void store_pair_row(const float* o, int64_t d, float inv, c10::BFloat16* dst) {
  const __m512i first_idx = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i second_idx = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  const __m512 s = _mm512_set1_ps(inv);
  for (int64_t c = 0; c < d; c += 32) {
    const __m512 a = _mm512_mul_ps(_mm512_loadu_ps(o + c), s), b = _mm512_mul_ps(_mm512_loadu_ps(o + c + 16), s);
    const __m512 first = _mm512_permutex2var_ps(a, first_idx, b), second = _mm512_permutex2var_ps(a, second_idx, b);
    _mm512_storeu_si512(dst + c, (__m512i)_mm512_cvtne2ps_pbh(second, first));
  }
}

// NR rows, NC 32-dim chunks starting at dim d0, over npairs key pairs.
template <int NR, int NC>
inline void pv_block_bf16(float* o, int64_t dp, const uint32_t* pp, const float* corr,
                          const c10::BFloat16* const* vrows, int npairs, int64_t d0) {
  __m512 acc[NR][2 * NC];
  UNROLL for (int r = 0; r < NR; ++r)
    UNROLL for (int c = 0; c < 2 * NC; ++c)
      acc[r][c] = _mm512_mul_ps(_mm512_loadu_ps(o + r * dp + d0 + 16 * c), _mm512_set1_ps(corr[r]));
  for (int jp = 0; jp < npairs; ++jp) {
    __m512i v[2 * NC];
    UNROLL for (int c = 0; c < NC; ++c) {
      const __m512i a = _mm512_loadu_si512(vrows[2 * jp] + d0 + 32 * c);
      const __m512i b = _mm512_loadu_si512(vrows[2 * jp + 1] + d0 + 32 * c);
      v[2 * c] = _mm512_unpacklo_epi16(a, b);
      v[2 * c + 1] = _mm512_unpackhi_epi16(a, b);
    }
    UNROLL for (int r = 0; r < NR; ++r) {
      const __m512bh p = as_bh(_mm512_set1_epi32(static_cast<int>(pp[r * (KT / 2) + jp])));
      UNROLL for (int c = 0; c < 2 * NC; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], p, as_bh(v[c]));
    }
  }
  UNROLL for (int r = 0; r < NR; ++r)
    UNROLL for (int c = 0; c < 2 * NC; ++c) _mm512_storeu_ps(o + r * dp + d0 + 16 * c, acc[r][c]);
}

template <int NR>
inline void pv_cols_bf16(float* o, int64_t dp, const uint32_t* pp, const float* corr,
                         const c10::BFloat16* const* vrows, int npairs) {
  int64_t d0 = 0;
  for (; d0 + 64 <= dp; d0 += 64) pv_block_bf16<NR, 2>(o, dp, pp, corr, vrows, npairs, d0);
  if (d0 < dp) pv_block_bf16<NR, 1>(o, dp, pp, corr, vrows, npairs, d0);
}

// Rows [r0, r1) of the item against the tile's nk V rows in the cache.
inline void pv_rows_bf16(Scratch& w, int64_t r0, int64_t r1, int64_t dp, const c10::BFloat16* const* vrows_in,
                         int nk) {
  const c10::BFloat16* vrows[KT];        // an odd last key pairs with a repeat (its p is 0)
  for (int j = 0; j < KT; ++j) vrows[j] = vrows_in[std::min(j, nk - 1)];
  for (int64_t r = r0; r < r1; ++r)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(w.pp.data() + r * (KT / 2)),
                        (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(w.p.data() + r * KT)));
  for (int64_t r = r0; r < r1; r += RB) {
    const int64_t nr = std::min<int64_t>(RB, r1 - r);
    const int npairs = (*std::max_element(w.valid.begin() + r, w.valid.begin() + r + nr) + 1) / 2;
    with_rows_upto<RB>(nr, [&](auto n) {
      pv_cols_bf16<decltype(n)::value>(w.o.data() + r * dp, dp, w.pp.data() + r * (KT / 2), w.corr.data() + r, vrows, npairs);
    });
  }
}
#else
constexpr bool kBf16Dot = false;
#endif

// ------------------------------------------------------------------------------ sliding window
// The first key position the query at position pos sees: with a window of W keys, W - 1 before
// its own; without one (0), the context's first.
inline int64_t window_start(int64_t pos, int64_t window) {
  return window > 0 ? std::max<int64_t>(0, pos - window + 1) : 0;
}

// Where a key loop that must reach key `first` starts: at the start of its tile of KT, so that
// with a block_size a multiple of KT each tile sits in one block (a strided K tile, one block's
// rows), but not before the start of first's block: the blocks before it may be released.
inline int64_t loop_start(int64_t first, int64_t block_size) {
  return std::max(first / KT * KT, first / block_size * block_size);
}

// ------------------------------------------------------------------------------ one work item
// q and out in T (float or bf16), the caches in C (float, bf16 or fp16).
template <typename T, typename C>
struct Inputs {
  const T* q;
  const C* k_cache;
  const C* v_cache;
  T* out;
  const int32_t* cu_seqlens_q;
  const int32_t* seqlens_k;
  const int32_t* block_tables;
  float scale;
  int64_t window;                          // sliding window in keys, 0: none
  float* part_o;                           // [part][RB][dp] unnormalised output rows
  float* part_m;                           // [part][RB] running max
  float* part_l;                           // [part][RB] sum of exp(s - max)
};

// Loads the K tile transposed into w.kt [dp][KT] (keys past nk: stale, masked later).
template <typename T>
inline void load_k_tile(const T* k_cache, const int64_t* offs, int nk, const Geometry& g, Scratch& w) {
  if constexpr (std::is_same_v<T, float>) {
    // rows at a fixed stride (a full tile inside one block): transpose straight from the cache
    bool strided = nk == KT && g.d == g.dp;
    for (int j = 1; strided && j < KT; ++j) strided = offs[j] - offs[j - 1] == g.kv_row_stride;
    if (strided) {
      for (int64_t d0 = 0; d0 < g.dp; d0 += 16)
        at::vec::transpose_mxn<float, KT, 16>(k_cache + offs[0] + d0, g.kv_row_stride,
                                               w.kt.data() + d0 * KT, KT);
      return;
    }
  }
  for (int j = 0; j < nk; ++j) row_to_f32(k_cache + offs[j], w.kf.data() + j * g.dp, g.d);
  for (int64_t d0 = 0; d0 < g.dp; d0 += 16)
    at::vec::transpose_mxn<float, KT, 16>(w.kf.data() + d0, g.dp, w.kt.data() + d0 * KT, KT);
}

// Pointers to the tile's V rows as fp32: the cache itself for fp32 with an unpadded head_dim,
// else rows converted into w.vf.
template <typename T>
inline void load_v_tile(const T* v_cache, const int64_t* offs, int nk, const Geometry& g, Scratch& w,
                        const float** vrows) {
  for (int j = 0; j < nk; ++j) {
    if constexpr (std::is_same_v<T, float>) {
      if (g.d == g.dp) {
        vrows[j] = v_cache + offs[j];
        continue;
      }
    }
    row_to_f32(v_cache + offs[j], w.vf.data() + j * g.dp, g.d);
    vrows[j] = w.vf.data() + j * g.dp;
  }
}

// The item's rows: kv head-major, then token, then the G query heads of the kv head.
inline int64_t item_rows(const WorkItem& it, const Geometry& g) {
  return it.num_kv * (it.q_end - it.q_begin) * g.group;
}

// Row r's query token (relative to the item's first) and query head.
inline void row_of(const WorkItem& it, const Geometry& g, int64_t r, int64_t* tok, int64_t* head) {
  const int64_t per_kv = (it.q_end - it.q_begin) * g.group, rem = r % per_kv;
  *tok = rem / g.group;
  *head = (it.kv_head + r / per_kv) * g.group + rem % g.group;
}

// Query rows, pre-scaled, into w.q; resets state.
template <typename T, typename C>
inline void init_rows(const Inputs<T, C>& in, const WorkItem& it, const Geometry& g, Scratch& w) {
  const int64_t q0 = in.cu_seqlens_q[it.seq] + it.q_begin;
  const int64_t rows = item_rows(it, g);
  for (int64_t r = 0; r < rows; ++r) {
    int64_t tok, head;
    row_of(it, g, r, &tok, &head);
    tok += q0;
    const T* src = in.q + tok * g.q_tok_stride + head * g.q_head_stride;
    float* dst = w.q.data() + r * g.dp;
    for (int64_t i = 0; i < g.d; ++i) dst[i] = static_cast<float>(src[i]) * in.scale;
    if constexpr (std::is_same_v<T, c10::BFloat16>) std::copy(src, src + g.d, w.qb.data() + r * g.dp);
  }
  std::fill(w.o.begin(), w.o.begin() + rows * g.dp, 0.f);
  std::fill(w.lsum.begin(), w.lsum.begin() + rows * KT, 0.f);
  std::fill(w.m.begin(), w.m.begin() + rows, kNegInf);
}

// Whether the item's products are bf16 dot products (AVX512-BF16, bf16 queries and cache, head_dim % 32).
template <typename T, typename C>
constexpr bool bf16_dot(const Geometry& g) {
  return kBf16Dot && std::is_same_v<T, c10::BFloat16> && std::is_same_v<C, c10::BFloat16> && g.d % 32 == 0;
}

// Output row o times inv into dst. Rows of the bf16 dot products hold their dims in pair order.
template <typename T>
inline void store_row(const float* o, float inv, T* dst, const Geometry& g, bool dot) {
  if (!dot) {
    for (int64_t i = 0; i < g.d; ++i) dst[i] = static_cast<T>(o[i] * inv);
    return;
  }
#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, c10::BFloat16>) store_pair_row(o, g.d, inv, dst);
#endif
}

inline float row_sum(const float* l) {
  float sum = 0.f;
  for (int j = 0; j < KT; ++j) sum += l[j];
  return sum;
}

// The item's rows into the output, or, for a part of a split decode, unnormalised into in.part_o/m/l.
template <typename T, typename C>
inline void store_rows(const Inputs<T, C>& in, const WorkItem& it, const Geometry& g, Scratch& w, bool dot) {
  const int64_t q0 = in.cu_seqlens_q[it.seq] + it.q_begin;
  const int64_t rows = item_rows(it, g);
  for (int64_t r = 0; r < rows; ++r) {
    const float* o = w.o.data() + r * g.dp;
    const float sum = row_sum(w.lsum.data() + r * KT);
    if (it.part >= 0) {
      std::copy(o, o + g.dp, in.part_o + (it.part * RB + r) * g.dp);
      in.part_m[it.part * RB + r] = w.m[r];
      in.part_l[it.part * RB + r] = sum;
      continue;
    }
    int64_t tok, head;
    row_of(it, g, r, &tok, &head);
    store_row(o, 1.f / sum, in.out + ((tok + q0) * g.hq + head) * g.d, g, dot);
  }
}

// Each split decode's rows: the parts' outputs rescaled to their common max, summed, normalised.
template <typename T, typename C>
void combine_parts(const Inputs<T, C>& in, const std::vector<SplitGroup>& groups, const Geometry& g) {
  std::vector<float> o(g.dp);
  for (const auto& grp : groups) {
    const int32_t q_len = in.cu_seqlens_q[grp.seq + 1] - in.cu_seqlens_q[grp.seq];
    const WorkItem it{grp.seq, grp.kv_head, 1, 0, q_len, 0};
    const int64_t q0 = in.cu_seqlens_q[grp.seq];
    for (int64_t r = 0; r < item_rows(it, g); ++r) {
      float mx = kNegInf;
      for (int32_t p = grp.first_part; p < grp.first_part + grp.num_parts; ++p) mx = std::max(mx, in.part_m[p * RB + r]);
      std::fill(o.begin(), o.end(), 0.f);
      float sum = 0.f;
      for (int32_t p = grp.first_part; p < grp.first_part + grp.num_parts; ++p) {
        const float f = std::exp(in.part_m[p * RB + r] - mx);
        sum += f * in.part_l[p * RB + r];
        const float* po = in.part_o + (p * RB + r) * g.dp;
        for (int64_t i = 0; i < g.dp; ++i) o[i] += f * po[i];
      }
      int64_t tok, head;
      row_of(it, g, r, &tok, &head);
      store_row(o.data(), 1.f / sum, in.out + ((tok + q0) * g.hq + head) * g.d, g, bf16_dot<T, C>(g));
    }
  }
}

template <typename T, typename C>
void run_item(const Inputs<T, C>& in, const WorkItem& it, const Geometry& g, Scratch& w) {
  const int64_t ctx = in.seqlens_k[it.seq];
  const int64_t q_len = in.cu_seqlens_q[it.seq + 1] - in.cu_seqlens_q[it.seq];
  const int64_t first_pos = ctx - q_len + it.q_begin;   // position of the item's first token
  const int64_t last_pos = ctx - q_len + it.q_end - 1;
  const int64_t rows = item_rows(it, g);
  const int64_t head_rows = rows / it.num_kv;   // rows per kv head
  const int32_t* table = in.block_tables + it.seq * g.max_blocks;
  const bool direct = head_rows <= RB && g.d == g.dp;
  const bool dot = bf16_dot<T, C>(g);               // bf16 S = Q K^T
  constexpr bool bf16_pair = std::is_same_v<T, c10::BFloat16> && std::is_same_v<C, c10::BFloat16>;
  const int64_t key_begin = it.key_begin, key_end = it.key_end < 0 ? last_pos + 1 : it.key_end;
  const int64_t span = it.num_kv * g.d;         // elements of a key row the item reads
  const float* vrows[KT];
  const C* krows_c[KT];                        // the tile's rows in the cache (direct path)
  const C* vrows_c[KT];

  int64_t offs[KT], next_offs[KT];
  const int first_nk = static_cast<int>(std::min<int64_t>(KT, key_end - key_begin));
  tile_offsets(table, key_begin, first_nk, it.kv_head, g, offs);
  prefetch_rows(in.k_cache, offs, first_nk, span);
  prefetch_rows(in.v_cache, offs, first_nk, span);
  init_rows(in, it, g, w);
  for (int64_t r = 0; r < rows; ++r) {
    w.pos[r] = first_pos + (r % head_rows) / g.group;
    w.lo[r] = window_start(w.pos[r], in.window);
  }
  for (int64_t kt0 = key_begin; kt0 < key_end; kt0 += KT) {
    const int nk = static_cast<int>(std::min<int64_t>(KT, key_end - kt0));
    const int next_nk = static_cast<int>(std::clamp<int64_t>(key_end - kt0 - KT, 0, KT));
    // The next tile's rows are asked for in pieces of one kv head's K or V, each just before the
    // same piece of this tile is used: asked for at once, a whole-row item's 6 prefetches per key
    // overrun the misses the core keeps in flight (measured 84 ms against 49 ms per 64 decodes).
    if (next_nk > 0) tile_offsets(table, kt0 + KT, next_nk, it.kv_head, g, next_offs);
    if (!direct && next_nk > 0) {
      prefetch_rows(in.k_cache, next_offs, next_nk, span);
      prefetch_rows(in.v_cache, next_offs, next_nk, span);
    }
    if (direct) {
      for (int64_t h = 0; h < it.num_kv; ++h) {
        prefetch_rows(in.k_cache + h * g.d, next_offs, next_nk, g.d);
        for (int j = 0; j < nk; ++j) krows_c[j] = in.k_cache + offs[j] + h * g.d;
        float* s = w.s.data() + h * head_rows * KT;
#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512BF16__)
        if constexpr (bf16_pair)
          if (dot && qk_direct_bf16(w.qb.data() + h * head_rows * g.dp, head_rows, g.dp, krows_c, nk, in.scale, s))
            continue;
#endif
        const float* qh = w.q.data() + h * head_rows * g.dp;
        qk_direct(qh, head_rows, g.dp, krows_c, nk, s);   // 16-bit rows widened once, for all rows
      }
    } else {
      if (!dot) load_v_tile(in.v_cache, offs, nk, g, w, vrows);
#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512BF16__)
      if constexpr (bf16_pair) {
        if (dot) {
          load_k_pairs(in.k_cache, offs, nk, g, w);
          qk_rows_bf16(w.qb.data(), rows, g.dp, w.kt2.data(), g.d / 2, in.scale, w.s.data());
        }
      }
#endif
      if (!dot) {
        load_k_tile(in.k_cache, offs, nk, g, w);
        qk_rows(w.q.data(), rows, g.dp, w.kt.data(), w.s.data());
      }
    }
    for (int64_t r = 0; r < rows; ++r) {      // row r sees positions [its window's first, its own]
      w.first[r] = static_cast<int>(std::clamp<int64_t>(w.lo[r] - kt0, 0, nk));
      w.valid[r] = static_cast<int>(std::clamp<int64_t>(w.pos[r] + 1 - kt0, 0, nk));
    }
    softmax_update(w, rows);
    for (int64_t h = 0; h < (direct ? it.num_kv : 1); ++h) {
      const int64_t r0 = direct ? h * head_rows : 0, r1 = direct ? r0 + head_rows : rows;
      if (direct) prefetch_rows(in.v_cache + h * g.d, next_offs, next_nk, g.d);
      for (int j = 0; j < nk; ++j) vrows_c[j] = in.v_cache + offs[j] + h * g.d;
#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512BF16__)
      if constexpr (bf16_pair)
        if (dot) {
          pv_rows_bf16(w, r0, r1, g.dp, vrows_c, nk);
          continue;
        }
#endif
      if (direct) pv_rows(w, r0, r1, g.dp, vrows_c);
      else pv_rows(w, r0, r1, g.dp, vrows);
    }
    std::copy(next_offs, next_offs + next_nk, offs);
  }
  store_rows(in, it, g, w, dot);
}

// ------------------------------------------------------------------------------ planning
// A sequence whose query rows per kv head are few (a decode) takes the direct path. When a step
// has enough of them to keep every thread busy, each is one work item over all its kv heads: the
// item then reads whole cache rows (all kv heads of a token, a block's K or V contiguous), where
// one item per kv head reads every row in strided pieces.
inline bool is_direct(int64_t q_len, const Geometry& g) { return q_len * g.group <= RB && g.d == g.dp; }

// Whether flash_attention takes a sequence's chunk of q_len tokens: one long enough, and no key of
// its context hidden by the window (the last query's window starts at ctx - window). A chunk the
// window cuts stays with the items: SDPA under an explicit mask computes every query against every
// key from the first query's window start, q_len x (q_len + W - 1) products where the items compute
// about W + one tile of keys per query, and for a prompt longer than its window (where a window
// matters) that is more extra work than AMX's 1.5x (the header's numbers) wins back.
inline bool to_flash(int64_t q_len, int64_t ctx, int64_t window, int64_t flash_min_tokens) {
  return q_len >= flash_min_tokens && (window == 0 || ctx <= window);
}

struct Plan {
  std::vector<WorkItem> items;             // most expensive first
  std::vector<SplitGroup> groups;          // the split decodes
  int32_t num_parts = 0;
};

// A step of fewer decode items than 2 per thread (one sequence: its kv heads) leaves threads idle
// while one reads the whole context: each such item is cut into parts of at least kMinSplitKeys
// keys, whole tiles each, so that every thread has about two. The keys split are the item's, from
// its key_begin (with a window: the window's).
constexpr int64_t kMinSplitKeys = 64;

void split_decodes(Plan& plan, const int32_t* cu, const int32_t* seqlens_k, const Geometry& g, int64_t threads) {
  const int64_t n = static_cast<int64_t>(plan.items.size());
  if (threads <= 1 || n == 0 || n >= 2 * threads) return;
  std::vector<WorkItem> items;
  for (const WorkItem& it : plan.items) {
    const int64_t q_len = cu[it.seq + 1] - cu[it.seq], ctx = seqlens_k[it.seq], keys = ctx - it.key_begin;
    const int64_t parts = std::min((2 * threads + n - 1) / n, keys / kMinSplitKeys);
    if (!is_direct(q_len, g) || it.num_kv != 1 || parts < 2) {
      items.push_back(it);
      continue;
    }
    const int64_t chunk = ((keys + parts - 1) / parts + KT - 1) / KT * KT;
    SplitGroup grp{it.seq, it.kv_head, plan.num_parts, 0};
    for (int64_t k0 = it.key_begin; k0 < ctx; k0 += chunk) {
      const int64_t k1 = std::min(ctx, k0 + chunk);
      WorkItem part = it;
      part.key_begin = static_cast<int32_t>(k0);
      part.key_end = static_cast<int32_t>(k1);
      part.part = plan.num_parts++;
      part.cost = q_len * g.group * (k1 - k0) + 64 * g.group;
      items.push_back(part);
      ++grp.num_parts;
    }
    plan.groups.push_back(grp);
  }
  plan.items = std::move(items);
}

// Checks the metadata against the cache (a bad block id would read out of bounds; the blocks
// before the window, never read, may be anything) and cuts the batch into work items, most
// expensive first.
Plan plan_items(const int32_t* cu, const int32_t* seqlens_k, const int32_t* bt,
                                 int64_t num_seqs, int64_t num_tokens, const Geometry& g, int64_t threads,
                                 int64_t window, int64_t flash_min_tokens) {
  TORCH_CHECK(cu[0] == 0 && cu[num_seqs] == num_tokens,
              "cu_seqlens_q must run from 0 to the number of query tokens");
  const int64_t tile_tokens = std::max<int64_t>(1, kMaxTileRows / g.group);
  int64_t num_direct = 0;
  for (int64_t i = 0; i < num_seqs; ++i) num_direct += is_direct(cu[i + 1] - cu[i], g);
  const bool whole_rows = num_direct >= 2 * threads;
  std::vector<WorkItem> items;
  for (int64_t i = 0; i < num_seqs; ++i) {
    const int64_t q_len = cu[i + 1] - cu[i], ctx = seqlens_k[i];
    TORCH_CHECK(q_len >= 0, "cu_seqlens_q must be non-decreasing");
    if (q_len == 0 || ctx == 0) continue;    // an empty context (a pad row): zeros, see below
    TORCH_CHECK(q_len <= ctx, "sequence ", i, ": ", q_len, " query tokens but a context of ", ctx);
    const int64_t nblk = (ctx + g.block_size - 1) / g.block_size;
    TORCH_CHECK(nblk <= g.max_blocks, "block_tables has fewer columns than sequence ", i, " needs");
    const int64_t first_key = window_start(ctx - q_len, window);
    for (int64_t b = first_key / g.block_size; b < nblk; ++b) {
      const int32_t blk = bt[i * g.max_blocks + b];
      TORCH_CHECK(blk >= 0 && blk < g.num_blocks, "sequence ", i, ": block id ", blk, " out of range");
    }
    if (to_flash(q_len, ctx, window, flash_min_tokens)) continue;     // flash_attention's
    if (whole_rows && is_direct(q_len, g)) {
      const int64_t kb = loop_start(first_key, g.block_size);
      const int64_t cost = g.hkv * (q_len * g.group * (ctx - kb) + 64 * g.group);
      items.push_back({static_cast<int32_t>(i), 0, static_cast<int32_t>(g.hkv), 0,
                       static_cast<int32_t>(q_len), cost, static_cast<int32_t>(kb)});
      continue;
    }
    for (int64_t t0 = 0; t0 < q_len; t0 += tile_tokens) {
      const int64_t t1 = std::min(q_len, t0 + tile_tokens);
      const int64_t kb = loop_start(window_start(ctx - q_len + t0, window), g.block_size);
      const int64_t keys = ctx - q_len + t1 - kb;
      const int64_t cost = (t1 - t0) * g.group * keys + 64 * g.group;
      for (int64_t h = 0; h < g.hkv; ++h)
        items.push_back({static_cast<int32_t>(i), static_cast<int32_t>(h), 1, static_cast<int32_t>(t0),
                         static_cast<int32_t>(t1), cost, static_cast<int32_t>(kb)});
    }
  }
  Plan plan{std::move(items)};
  if (!whole_rows) split_decodes(plan, cu, seqlens_k, g, threads);
  std::stable_sort(plan.items.begin(), plan.items.end(),
                   [](const WorkItem& a, const WorkItem& b) { return a.cost > b.cost; });
  return plan;
}

// Items of less estimated cost (rows x keys) in all run on the calling thread: waking the others
// costs more (measured the same from 64 keys of one decode up).
constexpr int64_t kMinParallelCost = 1024;

template <typename T, typename C>
void run_items(const Inputs<T, C>& in, const std::vector<WorkItem>& items, const Geometry& g) {
  const int64_t rows = std::max(std::max<int64_t>(1, kMaxTileRows / g.group) * g.group, g.hkv * RB);
  int64_t total = 0;
  for (const auto& it : items) total += it.cost;
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), (int64_t)items.size());
  if (threads <= 1 || total < kMinParallelCost) {
    Scratch& w = thread_scratch(rows, g);
    for (const auto& it : items) run_item(in, it, g, w);
    return;
  }
  std::atomic<size_t> next{0};
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    Scratch& w = thread_scratch(rows, g);
    for (size_t i = next.fetch_add(1); i < items.size(); i = next.fetch_add(1))
      run_item(in, items[i], g, w);
  });
}

// Query tokens of a bf16 chunk from which flash_attention takes it, where the CPU has AMX; else none.
constexpr int64_t kFlashMinTokens = 64;

int64_t flash_min_tokens(const torch::Tensor& q, const torch::Tensor& k_cache) {
  static const bool amx = at::cpu::init_amx();
  const bool bf16 = q.scalar_type() == torch::kBFloat16 && k_cache.scalar_type() == torch::kBFloat16;
  return bf16 && amx ? kFlashMinTokens : std::numeric_limits<int64_t>::max();
}

// A sequence's q_len query tokens (from q_begin) against its ctx keys, gathered from the cache
// through its block_row, by at::scaled_dot_product_attention into out; the last q_len keys are
// causal to the queries.
void flash_attention(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                     const torch::Tensor& block_row, int64_t q_begin, int64_t q_len, int64_t ctx, double scale,
                     torch::Tensor& out) {
  const int64_t bs = k_cache.size(1), nblk = (ctx + bs - 1) / bs;
  const torch::Tensor blocks = block_row.narrow(0, 0, nblk).to(torch::kLong);
  auto gather = [&](const torch::Tensor& cache) {          // [1, Hkv, ctx, D]
    return cache.index_select(0, blocks).flatten(0, 1).narrow(0, 0, ctx).transpose(0, 1).unsqueeze(0);
  };
  const torch::Tensor qs = q.narrow(0, q_begin, q_len).transpose(0, 1).unsqueeze(0);
  std::optional<torch::Tensor> mask;
  if (q_len < ctx) mask = torch::ones({q_len, ctx}, q.options().dtype(torch::kBool)).tril(ctx - q_len);
  const torch::Tensor o = at::scaled_dot_product_attention(qs, gather(k_cache), gather(v_cache), mask, 0.0,
                                                           q_len == ctx, scale, /*enable_gqa=*/true);
  out.narrow(0, q_begin, q_len).copy_(o[0].transpose(0, 1));
}

}  // namespace

// q [T, Hq, D] (float32 or bfloat16), k_cache/v_cache [num_blocks, block_size, Hkv, D] (one dtype:
// float32, bfloat16 or float16, widened to fp32 as read), cu_seqlens_q int32 [B+1], seqlens_k int32
// [B], block_tables int32 [B, max_blocks], window (keys, 0: none) -> out [T, Hq, D] in q's dtype.
torch::Tensor paged_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                              torch::Tensor cu_seqlens_q, torch::Tensor seqlens_k,
                              torch::Tensor block_tables, double scale, int64_t window) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4, "q must be [T, Hq, D] and the cache [N, bs, Hkv, D]");
  TORCH_CHECK(k_cache.sizes() == v_cache.sizes(), "k_cache and v_cache shapes differ");
  TORCH_CHECK(q.device().is_cpu() && k_cache.device().is_cpu() && v_cache.device().is_cpu(),
              "CPU tensors expected");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type(), "k_cache and v_cache dtypes differ");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "the caches must be contiguous");
  for (const auto* t : {&cu_seqlens_q, &seqlens_k, &block_tables})
    TORCH_CHECK(t->scalar_type() == torch::kInt32 && t->device().is_cpu(), "metadata must be int32 CPU tensors");
  TORCH_CHECK(block_tables.dim() == 2 && seqlens_k.dim() == 1 && cu_seqlens_q.dim() == 1 &&
              cu_seqlens_q.size(0) == seqlens_k.size(0) + 1 && block_tables.size(0) == seqlens_k.size(0),
              "metadata shapes: cu_seqlens_q [B+1], seqlens_k [B], block_tables [B, max_blocks]");
  const int64_t hq = q.size(1), d = q.size(2), hkv = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == d, "query head_dim ", d, " != cache head_dim ", k_cache.size(3));
  TORCH_CHECK(hkv > 0 && hq % hkv == 0, "num_heads ", hq, " is not a multiple of num_kv_heads ", hkv);
  TORCH_CHECK(window >= 0, "window ", window, " < 0 (0: no window)");

  q = q.stride(2) == 1 ? q : q.contiguous();
  auto cu = cu_seqlens_q.contiguous();
  auto lens = seqlens_k.contiguous();
  auto bt = block_tables.contiguous();
  auto out = torch::empty({q.size(0), hq, d}, q.options());

  Geometry g{hq, hkv, hq / hkv, d, (d + 15) / 16 * 16, k_cache.size(1), k_cache.size(0), bt.size(1),
             q.stride(0), q.stride(1), hkv * d};
  const int64_t flash_from = flash_min_tokens(q, k_cache);
  const Plan plan = plan_items(cu.data_ptr<int32_t>(), lens.data_ptr<int32_t>(), bt.data_ptr<int32_t>(),
                               lens.size(0), q.size(0), g, at::get_num_threads(), window, flash_from);
  std::vector<float> part_o(plan.num_parts * RB * g.dp), part_m(plan.num_parts * RB), part_l(plan.num_parts * RB);
  const int32_t* c = cu.data_ptr<int32_t>();
  const int32_t* ctx = lens.data_ptr<int32_t>();
  for (int64_t i = 0; i < lens.size(0); ++i) {      // what plan_items leaves out: rows with no keys, flash chunks
    if (ctx[i] == 0 && c[i + 1] > c[i]) out.narrow(0, c[i], c[i + 1] - c[i]).zero_();
    else if (to_flash(c[i + 1] - c[i], ctx[i], window, flash_from))
      flash_attention(q, k_cache, v_cache, bt[i], c[i], c[i + 1] - c[i], ctx[i], scale, out);
  }
  auto run = [&](auto q_tag, auto cache_tag) {
    using T = decltype(q_tag);
    using C = decltype(cache_tag);
    Inputs<T, C> in{q.data_ptr<T>(), k_cache.data_ptr<C>(), v_cache.data_ptr<C>(), out.data_ptr<T>(),
                    cu.data_ptr<int32_t>(), lens.data_ptr<int32_t>(), bt.data_ptr<int32_t>(),
                    static_cast<float>(scale), window, part_o.data(), part_m.data(), part_l.data()};
    run_items(in, plan.items, g);
    combine_parts(in, plan.groups, g);
  };
  auto with_cache = [&](auto q_tag) {
    switch (k_cache.scalar_type()) {
      case torch::kFloat: return run(q_tag, float{});
      case torch::kBFloat16: return run(q_tag, c10::BFloat16{});
      case torch::kHalf: return run(q_tag, c10::Half{});
      default: TORCH_CHECK(false, "paged_attention: the cache must be float32, bfloat16 or float16, not ",
                           k_cache.scalar_type());
    }
  };
  if (q.scalar_type() == torch::kFloat) {
    with_cache(float{});
  } else if (q.scalar_type() == torch::kBFloat16) {
    with_cache(c10::BFloat16{});
  } else {
    TORCH_CHECK(false, "paged_attention: q must be float32 or bfloat16, not ", q.scalar_type());
  }
  return out;
}

// key/value [T, Hkv, D] (any token stride, rows contiguous) into k_cache/v_cache [num_blocks,
// block_size, Hkv, D] at slot_mapping int64 [T]; a slot of -1 (a padding token) is skipped. Plain
// row copies on the calling thread: a step writes a few hundred rows of a few hundred bytes, and
// the torch path (a mask, a host sync on it, two index_copy_) costs more than the copies.
void write_kv(torch::Tensor key, torch::Tensor value, torch::Tensor k_cache, torch::Tensor v_cache,
              torch::Tensor slot_mapping) {
  TORCH_CHECK(key.dim() == 3 && value.sizes() == key.sizes(), "key and value must be [T, Hkv, D]");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes() && k_cache.is_contiguous() &&
              v_cache.is_contiguous(), "the caches must be contiguous [N, bs, Hkv, D] of one shape");
  TORCH_CHECK(key.size(1) == k_cache.size(2) && key.size(2) == k_cache.size(3),
              "key heads/head_dim do not match the cache");
  TORCH_CHECK(key.scalar_type() == k_cache.scalar_type() && value.scalar_type() == k_cache.scalar_type() &&
              v_cache.scalar_type() == k_cache.scalar_type(), "key, value and the caches must share a dtype");
  TORCH_CHECK(slot_mapping.scalar_type() == torch::kInt64 && slot_mapping.dim() == 1 &&
              slot_mapping.size(0) == key.size(0), "slot_mapping must be int64 [T]");
  for (auto* t : {&key, &value})
    if (t->stride(2) != 1 || t->stride(1) != t->size(2)) *t = t->contiguous();
  const auto slots = slot_mapping.contiguous();
  const int64_t num_slots = k_cache.size(0) * k_cache.size(1);
  const int64_t row_bytes = key.size(1) * key.size(2) * key.element_size();
  const int64_t* s = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < key.size(0); ++t)
    TORCH_CHECK(s[t] < num_slots, "slot ", s[t], " is past the cache's ", num_slots, " slots");
  auto copy = [&](const torch::Tensor& src, torch::Tensor& dst) {
    const char* from = static_cast<const char*>(src.data_ptr());
    char* to = static_cast<char*>(dst.data_ptr());
    const int64_t stride = src.stride(0) * src.element_size();
    for (int64_t t = 0; t < src.size(0); ++t)
      if (s[t] >= 0) std::memcpy(to + s[t] * row_bytes, from + t * stride, row_bytes);
  };
  copy(key, k_cache);
  copy(value, v_cache);
}

// write_kv, then paged_attention: a layer's attention in one call (a compiled step calls an op per
// layer instead of two, and Inductor can fuse the RoPE of q and k into one kernel before it).
torch::Tensor write_kv_attention(torch::Tensor q, torch::Tensor key, torch::Tensor value, torch::Tensor k_cache,
                                 torch::Tensor v_cache, torch::Tensor slot_mapping, torch::Tensor cu_seqlens_q,
                                 torch::Tensor seqlens_k, torch::Tensor block_tables, double scale,
                                 int64_t window) {
  write_kv(key, value, k_cache, v_cache, slot_mapping);
  return paged_attention(q, k_cache, v_cache, cu_seqlens_q, seqlens_k, block_tables, scale, window);
}

// The functions as dispatcher ops (kaiten_cpu::...), which a compiled graph calls without the
// layers of a Python-defined op (about 15 us a call).
TORCH_LIBRARY_FRAGMENT(kaiten_cpu, m) {
  m.def("paged_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor cu_seqlens_q, Tensor seqlens_k, "
        "Tensor block_tables, float scale, int window=0) -> Tensor");
  m.def("write_kv(Tensor key, Tensor value, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot_mapping) -> ()");
  m.def("write_kv_attention(Tensor q, Tensor key, Tensor value, Tensor(a!) k_cache, Tensor(b!) v_cache, "
        "Tensor slot_mapping, Tensor cu_seqlens_q, Tensor seqlens_k, Tensor block_tables, float scale, "
        "int window=0) -> Tensor");
}

TORCH_LIBRARY_IMPL(kaiten_cpu, CPU, m) {
  m.impl("paged_attention", &paged_attention);
  m.impl("write_kv", &write_kv);
  m.impl("write_kv_attention", &write_kv_attention);
}
