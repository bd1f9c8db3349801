// kaiten_cpu::quant_linear (../quant_linear_cpu.cpp): the panel GEMM's driver, for many rows of x: panels of weight
// rows laid out in L2 scratch, each met by all of x.
#pragma once

#include <ATen/Parallel.h>
#include <unistd.h>
#include <algorithm>
#include <vector>

#include "../chunk_queue.h"
#include "tiles.h"

namespace kaiten::quant {

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
// GEMM: no dequantized weight leaves L2 and nothing is reordered. Threads take the weight's panels
// of K::kPanel rows in chunks from one queue (parallel_chunks); each thread dequantizes a group of
// panels (about group_bytes()) into its scratch, laid out for the vector instructions (K::pack:
// kPanel / 2 weight rows a vector, by input), and meets them with all of x, K::kRows rows at a
// time (K::rows): each input of a row of x broadcast against a panel's two vectors, kRows x 2
// accumulators summed over all of k, then stored as rows of the output. Those rows of x meet every panel of the group while they are in
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
  parallel_chunks((w.tiles + kTiles - 1) / kTiles, 1, [&](ChunkQueue& queue) {
    K kernel(w);
    Aligned<typename K::P> panels(group * size);
    typename K::Out* last = out + full * w.n;
    int64_t c0, c1;
    while (queue.next(c0, c1))
      for (int64_t g0 = c0; g0 < c1; g0 += group) {
        const int64_t g1 = std::min(c1, g0 + group);
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

}  // namespace kaiten::quant
