// kaiten_cpu::quant_linear (../quant_linear_cpu.cpp): bf16 x without AVX512-BF16, and fp16 x, with many rows: chunks
// of weight rows dequantized into scratch in x's dtype, each multiplied by at::mm.
#pragma once

#include <ATen/Parallel.h>
#include <vector>

#include "tiles.h"

namespace kaiten::quant {

constexpr int64_t kChunkBytes = 4 << 20;   // scratch per dequantized chunk of weight rows

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

}  // namespace kaiten::quant
