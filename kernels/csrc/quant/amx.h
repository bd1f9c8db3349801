// kaiten_cpu::quant_linear (../quant_linear_cpu.cpp): bf16 x on AMX tiles: up to kAmxMaxRows rows by dequantizing into
// A tiles, more on Bf16Panel's panels.
#pragma once

#if defined(__AMX_TILE__)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include "../chunk_queue.h"
#include "bf16_panel.h"

namespace kaiten::quant {

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
inline bool amx_ready() {
  static const bool ready = [] {
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(d & (1u << 22)) || !(d & (1u << 24))) return false;
    return syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) == 0;
  }();
  return ready;
}

// x [m][k] as B tiles: [m / 16 blocks][k / 32][16 pairs of inputs][16 rows of x], each element a
// pair of bf16 (one 32-bit word: inputs 2p, 2p + 1), rows past m zero.
inline std::vector<uint32_t> x_as_b_tiles(const at::BFloat16* x, int64_t m, int64_t k) {
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
  parallel_chunks((w.tiles + 3) / 4, 1, [&](ChunkQueue& queue) {
    configure_tiles();
    alignas(64) at::BFloat16 a[2][16 * 32];
    alignas(64) float c_out[16 * 16];
    std::vector<float> sbuf(4 * 2 * w.scale_count());
    TileScales s[4];
    int64_t b0, b1;
    while (queue.next(b0, b1))
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

}  // namespace kaiten::quant
