// kaiten_cpu::dequantize_rows: rows of a packed weight (engine_worker/model/quant_tiles.py's
// layout) in fp32, as quant_tiles.dequantize computes them (an exact product of the integer and
// its scale, rounded once, then the min added): the quantized embedding's lookup. Eager, once a
// step, before the compiled layers; quant_tiles.dequantize took about 15 ATen calls (88 us) for one
// token's row, this one call (bench/results/eager_parts/README.md).
#include "aten_ops.h"

#include <ATen/Parallel.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>

namespace {

constexpr int64_t kTileRows = 4;

struct Layout {
  int64_t groups, group, bits, int_bytes, scale_bytes, mins_at, ints_at;
  bool has_mins;
};

float scale_at(const uint8_t* p, int64_t scale_bytes) {
  if (scale_bytes == 2) {
    uint16_t h;
    std::memcpy(&h, p, 2);
    return static_cast<float>(c10::Half(h, c10::Half::from_bits()));
  }
  float f;
  std::memcpy(&f, p, 4);
  return f;
}

// The integer of element e of group g at lane l of a tile, as quant_tiles reads it.
int32_t value_at(const uint8_t* ints, const Layout& L, int64_t g, int64_t l, int64_t e) {
  if (L.bits == 8) return static_cast<int8_t>(ints[(g * kTileRows + l) * L.int_bytes + e]);
  if (L.bits == 4) {
    const uint8_t b = ints[(g * kTileRows + l) * L.int_bytes + (e & 15)];
    return e < 16 ? (b & 0x0F) : (b >> 4);
  }
  // 5 bits: the 4 lanes' nibbles (16 bytes each), then each pair of lanes' fifth bits (8 bytes)
  const uint8_t* grp = ints + g * kTileRows * L.int_bytes;
  const int64_t i = e & 15;
  const uint8_t nib = grp[16 * l + i];
  const uint8_t fifth = grp[64 + 8 * (l / 2) + (i % 8)];
  const int shift = static_cast<int>(2 * (l % 2) + i / 8);
  const int32_t v = e < 16 ? ((nib & 0x0F) | (((fifth >> (4 + shift)) & 1) << 4))
                           : ((nib >> 4) | (((fifth >> shift) & 1) << 4));
  return v - (L.has_mins ? 0 : 16);
}

// Kept apart from the add: no fused multiply-add, the product is rounded once as in ATen's mul.
inline float rounded(float x) {
  asm volatile("" : "+x"(x));
  return x;
}

void row(const uint8_t* tile, const Layout& L, int64_t lane, float* out) {
  const uint8_t* ints = tile + L.ints_at;
  for (int64_t g = 0; g < L.groups; ++g) {
    const float s = scale_at(tile + (g * kTileRows + lane) * L.scale_bytes, L.scale_bytes);
    const float m = L.has_mins ? scale_at(tile + L.mins_at + (g * kTileRows + lane) * L.scale_bytes, L.scale_bytes) : 0.f;
    float* o = out + g * L.group;
    for (int64_t e = 0; e < L.group; ++e) {
      const float w = rounded(static_cast<float>(value_at(ints, L, g, lane, e)) * s);
      o[e] = L.has_mins ? w + m : w;
    }
  }
}

at::Tensor dequantize_rows(const at::Tensor& tiles, const at::Tensor& rows, int64_t n, int64_t k, int64_t bits,
                           int64_t group, bool has_mins) {
  TORCH_CHECK(tiles.is_cpu() && tiles.scalar_type() == at::kByte && tiles.dim() == 2 && tiles.is_contiguous(),
              "dequantize_rows: tiles must be contiguous uint8 [tiles, bytes] on the CPU");
  TORCH_CHECK(bits == 4 || bits == 5 || bits == 8, "dequantize_rows: bits must be 4, 5 or 8, not ", bits);
  TORCH_CHECK(group > 0 && k % group == 0 && (group * bits) % 8 == 0 && (bits != 5 || group == 32),
              "dequantize_rows: bad group ", group, " for k ", k, " and ", bits, " bits");
  Layout L{k / group, group, bits, group * bits / 8, 0, 0, 0, has_mins};
  const int64_t int_part = L.groups * kTileRows * L.int_bytes;
  const int64_t scale_part = (tiles.size(1) - int_part) / (has_mins ? 2 : 1);
  L.scale_bytes = scale_part / (L.groups * kTileRows);
  TORCH_CHECK(L.scale_bytes == 2 || L.scale_bytes == 4, "dequantize_rows: tiles of ", tiles.size(1),
              " bytes do not hold ", L.groups, " groups of ", bits, "-bit values");
  L.mins_at = scale_part;
  L.ints_at = scale_part * (has_mins ? 2 : 1);
  TORCH_CHECK(rows.dim() == 1, "dequantize_rows: rows must be 1-D");
  const at::Tensor idx = rows.to(at::kLong).contiguous();
  const int64_t count = idx.numel();
  const int64_t* ids = idx.data_ptr<int64_t>();
  for (int64_t i = 0; i < count; ++i)
    TORCH_CHECK(ids[i] >= 0 && ids[i] < n && ids[i] / kTileRows < tiles.size(0),
                "dequantize_rows: row ", ids[i], " is out of range for ", n, " rows");
  at::Tensor out = at::empty({count, k}, tiles.options().dtype(at::kFloat));
  const uint8_t* base = tiles.data_ptr<uint8_t>();
  const int64_t stride = tiles.size(1);
  float* o = out.data_ptr<float>();
  at::parallel_for(0, count, 64, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i)
      row(base + (ids[i] / kTileRows) * stride, L, ids[i] % kTileRows, o + i * k);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kaiten_cpu, m) {
  m.def("dequantize_rows(Tensor tiles, Tensor rows, int n, int k, int bits, int group, bool has_mins) -> Tensor");
}

TORCH_LIBRARY_IMPL(kaiten_cpu, CPU, m) { m.impl("dequantize_rows", &dequantize_rows); }
