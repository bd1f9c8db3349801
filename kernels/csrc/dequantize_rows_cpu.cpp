// kaiten_cpu::dequantize_rows: rows of a packed weight (engine_worker/model/quant_tiles.py's
// layout, read as quant_linear reads it: quant/tiles.h) in fp32, as quant_tiles.dequantize computes
// them (an exact product of the integer and its scale, rounded once, then the min added): the
// quantized embedding's lookup. Eager, once a step, before the compiled layers;
// quant_tiles.dequantize took about 15 ATen calls for one token's row, this one call
// (bench/results/eager_parts/README.md).
#include "quant/tiles.h"

#include <ATen/Parallel.h>

namespace {

using namespace kaiten::quant;

// Kept apart from the add: no fused multiply-add, the product is rounded once as in ATen's mul.
inline float rounded(float x) {
  asm volatile("" : "+x"(x));
  return x;
}

// Row `lane` of tile t into out [k]; sbuf: scratch for the tile's widened scales (TileScales).
template <typename I>
void dequantize_row(const Tiles& w, int64_t t, int lane, float* sbuf, float* out) {
  const uint8_t* tile = w.tile(t);
  const TileScales s(w, tile, sbuf);
  const uint8_t* q = w.ints(tile);
  for (int64_t g = 0; g < w.groups; ++g) {
    Vec v[I::kVecs];
    I::load_row(q + g * kTileRows * I::kBytes, lane, v);
    float* o = out + g * I::kGroup;
    for (int j = 0; j < I::kVecs; ++j) v[j].store(o + j * VL);
    const int64_t at = g * kTileRows + lane;
    const float scale = s.scales[at];
    if (s.mins) {
      for (int e = 0; e < I::kGroup; ++e) o[e] = rounded(o[e] * scale) + s.mins[at];
    } else {
      for (int e = 0; e < I::kGroup; ++e) o[e] *= scale;
    }
  }
}

at::Tensor dequantize_rows(const at::Tensor& tiles, const at::Tensor& rows, int64_t n, int64_t k, int64_t bits,
                           int64_t group, bool has_mins) {
  TORCH_CHECK(tiles.is_cpu(), "dequantize_rows: tiles must be on the CPU");
  const Tiles w = tiles_of("dequantize_rows", tiles, n, k, bits, group, has_mins);
  TORCH_CHECK(rows.dim() == 1, "dequantize_rows: rows must be 1-D");
  const at::Tensor idx = rows.to(at::kLong).contiguous();
  const int64_t count = idx.numel();
  const int64_t* ids = idx.data_ptr<int64_t>();
  for (int64_t i = 0; i < count; ++i)
    TORCH_CHECK(ids[i] >= 0 && ids[i] < n, "dequantize_rows: row ", ids[i], " is out of range for ", n, " rows");
  at::Tensor out = at::empty({count, k}, tiles.options().dtype(at::kFloat));
  float* o = out.data_ptr<float>();
  with_ints(bits, group, has_mins, [&](auto tag) {
    using I = typename decltype(tag)::type;
    at::parallel_for(0, count, 64, [&](int64_t begin, int64_t end) {
      std::vector<float> sbuf(2 * w.scale_count());
      for (int64_t i = begin; i < end; ++i)
        dequantize_row<I>(w, ids[i] / kTileRows, static_cast<int>(ids[i] % kTileRows), sbuf.data(), o + i * k);
    });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kaiten_cpu, m) {
  m.def("dequantize_rows(Tensor tiles, Tensor rows, int n, int k, int bits, int group, bool has_mins) -> Tensor");
}

TORCH_LIBRARY_IMPL(kaiten_cpu, CPU, m) { m.impl("dequantize_rows", &dequantize_rows); }
