// kaiten_cpu::quant_linear: y = x W^T with W's GGUF blocks in tiles of kTileRows weight rows
// (engine_worker/model/quant_tiles.py), the tiles one after another, each
//   scales [G][kTileRows], then mins [G][kTileRows] where the format has them, both fp16 (where
//   that is exact: Q4_0, Q4_1, Q8_0) or fp32; then the stored integers [G][kTileRows][bytes],
// for the G groups of a row: int4 groups of 32 in 16 bytes (byte i: element i in the low nibble,
// i + 16 in the high), int8 groups of 16 or 32 bytes, 5-bit groups of 32 (Q5_0, Q5_1, Q5_K) in 20
// bytes a row: a tile's 4 rows of nibbles, then their fifth bits (tiles.h, Ints5; values less 16
// without mins). An element is q * scale + min.
// A tile is one stream of bytes, read front to back, so a thread's share of W streams from memory
// as one run, and fp16 scales keep the tensor at the GGUF file's size (20 bytes per 32 int4
// weights, 22 per 32 5-bit, 34 per 32 int8). The kernels read 5-bit weights as the int8 ones they
// were (the same integers, so the same outputs), but for int8_block, which meets them as int4's.
//
// Six methods, chosen by the number of rows m of x and x's dtype (min_dense_rows and int8_rows
// from the caller, measured by bench/kernels/quant_linear.py; int8_rows first where both hold):
// * m <= int8_rows, in an AVX-512 or AVX2 build: *int8 activations*, as llama.cpp computes: x
//   rounded to int8 per block of 32 (7 bits against int8 weights without VNNI, int8_x.h), integer
//   dot products with the stored integers (vpdpbusd with AVX512-VNNI, 64 byte products an
//   instruction; else vpmaddubsw and vpmaddwd), scaled per group in fp32. x is inexact (about 1%
//   of the output's norm), the fewest instructions per weight. Up
//   to kInt8BlockRows rows a row at a time against each tile (int8_block); more by the *int8 panel
//   GEMM* (Int8Panel): panel_gemm's panels hold the stored integers reordered by quads of inputs,
//   each quad of a row of x broadcast against them; on a CPU with AMX-INT8 the same panels are
//   the tiles' weights, each group's integer dots made by tdpbsud (AmxInt8Panel, the same bits).
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
// Threads take the panels (and AMX tile blocks) in shrinking chunks from one queue (chunk_queue.h);
// fewer rows, bound by memory, split the tiles in equal shares. Either way a thread computes whole
// outputs, so threads never change a row's result.
//
// Batch invariance (issue #66): with int8_rows and min_dense_rows above any m (QuantLinear's
// deterministic mode, the default) a call's method does not depend on m, so neither does a row's
// output: int8 activations where the build has them and k % 32 == 0 (int8_block and the int8 panel
// GEMM sum a row in the same order, bit for bit), else the fp32 registers (their per-block method
// fixed by the format, kDequantFirst). Not with exact bf16 x on AVX512-BF16 (the bf16 dot products
// from 3 rows).
//
// Each method in its own header under quant/: tiles.h (the layout, dequantizing, what all share),
// registers.h (fp32 and bf16 x in registers), int8_x.h (x rounded to int8) with int8_block.h and
// int8_panel.h and amx_int8.h, panel_gemm.h (the panel GEMMs' driver) with fp32_panel.h and bf16_panel.h, amx.h,
// dense_chunks.h; this file picks the method (run) and registers the op.
//
// One source for AVX-512 and AVX2 (at::vec::Vectorized<float>, with the byte unpacking in the
// matching intrinsics) and a portable fallback; the ISA comes from CPU_CAPABILITY_* as in
// paged_attention_cpu.cpp.
#include "aten_ops.h"

#include <vector>

#include "quant/amx.h"
#include "quant/amx_int8.h"
#include "quant/bf16_panel.h"
#include "quant/dense_chunks.h"
#include "quant/fp32_panel.h"
#include "quant/int8_block.h"
#include "quant/int8_panel.h"
#include "quant/registers.h"

namespace {

using namespace kaiten::quant;

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
// Rows from which the int8 panel runs on AMX tiles where the CPU has them. 2-core Xeon with AMX, bf16
// x, 2 threads, Q4_1 and Q8_0, SmolLM2's projections, GMAC/s tiles / vectors: 0.81-0.95x at 17 rows
// (a 16-row tile pass for one row), 0.95-1.09x at 32, 0.96-1.12x at 48, 0.99-1.10x at 64, 1.03-1.15x at
// 128, 1.08-1.19x at 256 (bench/results/kernel_ab/kernel_ab_amx_int8_spr.md, _mid.md).
constexpr int64_t kAmxInt8Rows = 64;

template <typename I>
at::Tensor int8_gemm(const Tiles& w, const at::Tensor& x) {
  const int64_t m = x.size(0);
  std::vector<float> buf;
  const std::vector<int8_t> rec = x_records<I>(w, as_float(x, buf), m);
  at::Tensor out = at::empty({m, w.n}, x.options());
  with_out(out, [&](auto* o) {
    using O = std::remove_pointer_t<decltype(o)>;
#if defined(KAITEN_AMX_INT8)
    if (m >= kAmxInt8Rows && amx_int8_ready()) return panel_gemm<AmxInt8Panel<I, O>, I>(w, rec.data(), m, x_record_bytes(w), o);
#endif
    panel_gemm<Int8Panel<I, O>, I>(w, rec.data(), m, x_record_bytes(w), o);
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
  if (!int8 && m >= min_dense_rows) {
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
  TORCH_CHECK(x.size(-1) == k, "quant_linear: x has ", x.size(-1), " features, the weight ", k);
  const Tiles w = tiles_of("quant_linear", tiles, n, k, bits, group, has_mins);
  const at::Tensor x2 = x.reshape({-1, k});
  const at::Tensor out = with_ints(bits, group, has_mins, [&](auto tag) {
    return run<typename decltype(tag)::type>(w, x2, min_dense_rows, int8_rows);
  });
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = n;
  return out.view(shape);
}

// The integer levels to which the int8 method rounds x against `bits`-bit weights in this build
// (x_levels: 63 or 127), 0 where the build has no int8 method: what the tests' references and the
// benchmarks read, so that no second copy of the condition exists.
int64_t int8_x_levels(int64_t bits) {
  TORCH_CHECK(bits == 4 || bits == 5 || bits == 8, "int8_x_levels: bits must be 4, 5 or 8, not ", bits);
#if defined(KAITEN_INT8_ACTIVATIONS)
  return bits == 4 ? x_levels<Ints<true, 32>>() : bits == 5 ? x_levels<Ints5<true>>() : x_levels<Ints<false, 32>>();
#else
  return 0;
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kaiten_cpu, m) {
  m.def("quant_linear(Tensor x, Tensor tiles, int n, int k, int bits, int group, bool has_mins, int min_dense_rows, int int8_rows=0) -> Tensor");
  m.def("int8_x_levels(int bits) -> int", &int8_x_levels);
}

TORCH_LIBRARY_IMPL(kaiten_cpu, CPU, m) { m.impl("quant_linear", &quant_linear); }
