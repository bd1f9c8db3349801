"""Linear and embedding layers on GGUF-quantized weights kept as stored (shared/gguf_quant.py).

QuantLinear multiplies with kaiten_cpu::quant_linear from the C++ extension (kernels/csrc/
quant_linear_cpu.cpp), which, by the number of rows and x's dtype, multiplies int8-rounded
activations by the stored integers, dequantizes in registers, or runs a panel GEMM;
QuantEmbedding dequantizes only the rows it looks up. A tied output layer is a QuantLinear on the
embedding's own buffers, so the largest matrix stays quantized and stored once.
"""
from __future__ import annotations

import torch
from torch import nn

from engine_worker.model.quant_tiles import dequantize, to_tiles
from shared.gguf_quant import PackedWeight

# Rows of x from which quant_linear dequantizes for a dense GEMM, by x's dtype (the dense GEMM's
# speed is the dtype's). bf16 with AMX (from there to 32 rows its own AMX tile kernel, then the
# AMX panel GEMM): 2-core Xeon, 2 threads, 30 layers' projections, Q4_1 / Q8_0, ms: 8 rows AMX
# 14.9 / 17.2, int8 activations 12.3 / 13.6; 16 rows AMX 18.2 / 21.2, int8 19.1 / 32.0, oneDNN
# chunks 30.5 / 35.0; 32 rows AMX 24.7 / 29.2, oneDNN 34.1 / 42.4 (the chunks were the method past
# 64 rows until the panel GEMM).
# bf16 without AMX (the kernel's own bf16 GEMM from there): 2-core Zen 4 EPYC with AVX512-BF16,
# 2 threads, bench/kernels/quant_linear.py's four projection shapes, Q4_1 / Q8_0, the GEMM's time against
# the bf16 dot products in registers: 16 rows 1.04x / 1.06x, 24 0.94x / 0.95x, 48 0.86x / 0.92x,
# 256 0.75x / 0.72x; against oneDNN on the dense weight prepacked (what --quantization none runs)
# 0.85-1.06x by shape at 256 rows. fp32 (the dense method is the panel GEMM): the same Zen 4, Q4_1,
# the four shapes summed, its time against the fp32 registers 1.08x at 32 rows, 0.86x at 64.
# Before it (dequantized chunks into MKL): min of 5-11 rounds, 1 thread (the machine had a load of
# 7-13 on 2 cores), AVX2 EPYC, bench/kernels/quant_linear.py's shapes and methods, dense time / this time:
# int4 registers 1.4-3.6x at 24 rows, 0.9-1.1x at 48-64, dense ahead from 96 (0.6-0.9x); int8
# weights 1.2-1.6x at 24, 1.0-1.35x at 48-64, dense ahead from 96-128 (measured before the tiled
# layout, with the int8-activation method it replaced; on the Zen 4 the tiled fp32 registers were
# still ahead at 64-128 rows: 1.25-1.9x, and on the Zen 5 at up to 512 rows, 1.5-2.5x: MKL's fp32
# GEMM on AMD).
MIN_DENSE_ROWS = {torch.bfloat16: 12 if torch.cpu._is_amx_tile_supported() else 24, torch.float32: 64}
# Rows of x up to which quant_linear multiplies int8-rounded activations by the stored integers
# (llama.cpp's way; AVX-512 and AVX2 builds, vpdpbusd where the CPU has AVX512-VNNI, else
# vpmaddubsw and vpmaddwd), by x's dtype: up to 8 rows (16 on AVX-512) a row at a time against
# each tile, from there the int8 panel GEMM. fp32 x: every row. 2-core Zen 3 EPYC (AVX2), 2
# threads, the default model (Q4_1 projections), one process, int8 in every row against up to 16
# (the exact fp32 registers and panel GEMM past that): a prompt token 0.81x the time (1.355 against
# 1.675 ms, 16 prompts of 256), a 32-row decode step 0.71x (97.5 against 136.6 ms), perplexity on
# quant_decode's text 40.69 against 41.47. bf16 x (the bf16 dot products and panels past 16 rows
# on AVX512-BF16, AMX's tiles): 2-core Xeon with AMX, int8 / exact time, Q4_1 and Q8_0
# projections: VNNI, fp32 x 0.62x and 0.84x at one row; bf16 x (the bf16 dot products from 3 rows)
# 0.87x and 0.94x at 1 row, 0.55x and 0.63x at 4, 0.78x and 0.75x at 16. The same Xeon, fp32 x
# against the fp32 registers, gate_up and down (bench/kernels/quant_linear.py --rows 1,4,16): the AVX2
# build Q4_1 0.63-0.78x at 1 to 16 rows, Q8_0 0.88x at one row, 0.95-1.09x at 4 and 16; the
# AVX-512 build without VNNI Q4_1 0.69-0.84x, Q8_0 0.92-1.0x. 2-core Zen 4 (AVX512-VNNI, BF16),
# bench/weights/int8_rows.py, against exact activations (none): fp32 x, every row, Q4_1 and Q8_0 files:
# a 32-row step 0.62x and 0.63x, a prompt token 0.51x and 0.46x, 8 and 16 rows 0.73-0.88x; bf16 x,
# up to 16 rows, Q4_1 and Q8_0: 1 row 0.87x and 1.05x, 4 rows 0.94x and 0.99x, 8 rows 0.93-1.05x
# and 1.10-1.11x, 16 rows 1.00-1.10x and 1.21x; up to 4 rows 0.90x and 1.02x at one row; every row
# (the int8 panel past 16) no faster: a 32-row step 1.04x, a prompt token 1.10x. So bf16 x takes
# them up to 4 rows without AMX (the Zen 4's bf16 dot products win past that), and with AMX up to
# the rows where its tile kernel starts (MIN_DENSE_ROWS: at 16 rows the tiles took 18.2 / 21.2 ms
# above, int8 19.1 / 32.0). The op takes int8 first where both thresholds hold, so INT8_ROWS is
# the rows that take it.
INT8_ROWS = {torch.float32: 1 << 30,
             torch.bfloat16: MIN_DENSE_ROWS[torch.bfloat16] - 1 if torch.cpu._is_amx_tile_supported() else 4,
             torch.float16: 16}


class QuantLinear(nn.Module):
    """y = x W^T (+ b), W packed (int4 or int8 with group scales and mins) in quant_linear's tiles
    (quant_tiles.py). CPU only; needs the C++ extension."""

    def __init__(self, packed: PackedWeight, bias_dtype: torch.dtype | None = None):
        super().__init__()
        self.int8_rows = dict(INT8_ROWS)    # as at construction: a compiled graph's constants
        tiles, self.fmt = to_tiles(packed)
        self.register_buffer("tiles", torch.from_numpy(tiles))
        f = self.fmt
        self.op_args = (f.n, f.k, f.bits, f.group, f.has_mins)     # plain ints for the compiled graph
        # a bias (Qwen2's q/k/v) stays dense; load_weights fills it
        self.bias = None if bias_dtype is None else nn.Parameter(torch.zeros(f.n, dtype=bias_dtype),
                                                                 requires_grad=False)

    @property
    def kind(self) -> str:
        return "int4" if self.fmt.bits == 4 else "int8"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.ops.kaiten_cpu.quant_linear(x, self.tiles, *self.op_args, MIN_DENSE_ROWS.get(x.dtype, 96),
                                              self.int8_rows.get(x.dtype, 0))
        return y if self.bias is None else y + self.bias

    def dequantize(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """The weight (or its `rows`) in fp32, computed as gguf's dequantizer does."""
        return dequantize(self.tiles, self.fmt, rows)


class QuantEmbedding(nn.Module):
    """An embedding table kept packed: a lookup dequantizes the rows it returns, in `dtype`."""

    def __init__(self, table: QuantLinear, dtype: torch.dtype):
        super().__init__()
        self.table = table
        self.dtype = dtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.table.dequantize(ids).to(self.dtype)
