"""Linear and embedding layers on GGUF-quantized weights kept as stored (shared/gguf_quant.py).

QuantLinear multiplies with kaiten_cpu::quant_linear from the C++ extension (kernels/csrc/
quant_linear_cpu.cpp), which multiplies int8-rounded activations by the stored integers,
dequantizes in registers, or runs a panel GEMM: one of them for every call where the layer is
deterministic (the default), else by the number of rows and x's dtype. QuantEmbedding dequantizes
only the rows it looks up (kaiten_cpu::dequantize_rows, kernels/csrc/dequantize_rows_cpu.cpp). A
tied output layer is a QuantLinear on the embedding's own buffers, so the largest matrix stays
quantized and stored once.
"""
from __future__ import annotations

import torch
from torch import nn

from engine_worker.model.quant_tiles import dequantize, to_tiles
from shared.gguf_quant import PackedWeight

# The fast mode's thresholds (deterministic=False), by x's dtype: rows of x from which
# quant_linear dequantizes for a dense GEMM (the dense GEMM's speed is the dtype's), and rows up to
# which it multiplies int8-rounded activations by the stored integers (llama.cpp's way, AVX-512 and
# AVX2 builds; the op takes int8 first where both hold). Measured per CPU in
# bench/results/quant_linear/README.md#thresholds.
MIN_DENSE_ROWS = {torch.bfloat16: 12 if torch.cpu._is_amx_tile_supported() else 24, torch.float32: 64,
                  torch.float16: 96}
INT8_ROWS = {torch.float32: 1 << 30,
             torch.bfloat16: MIN_DENSE_ROWS[torch.bfloat16] - 1 if torch.cpu._is_amx_tile_supported() else 4,
             torch.float16: 16}
NEVER = 1 << 30     # more rows than any call has


class QuantLinear(nn.Module):
    """y = x W^T (+ b), W packed (int4, 5-bit or int8 with group scales and mins) in quant_linear's tiles
    (quant_tiles.py). CPU only; needs the C++ extension. deterministic (the default): each row's
    output the same whatever else is in the call, every call by one method; else the fastest
    method for the call's rows (MIN_DENSE_ROWS, INT8_ROWS). five_bit=False: int8 tiles where
    the values fit the 5-bit ones (the layout before them, for A/B benchmarks and tests)."""

    def __init__(self, packed: PackedWeight, bias_dtype: torch.dtype | None = None, deterministic: bool = True,
                 five_bit: bool = True):
        super().__init__()
        # As at construction: a compiled graph's constants. Deterministic: one method for every row
        # count, so a row's output does not depend on the other rows of the call (issue #66): int8
        # activations for every dtype that takes them at all (none where INT8_ROWS is empty: then
        # the exact fp32 registers), never the dense GEMMs, whose sums are ordered otherwise.
        self.int8_rows = {dt: NEVER for dt in INT8_ROWS} if deterministic else dict(INT8_ROWS)
        self.min_dense_rows = {} if deterministic else dict(MIN_DENSE_ROWS)
        tiles, self.fmt = to_tiles(packed, five_bit)
        self.register_buffer("tiles", torch.from_numpy(tiles))
        f = self.fmt
        self.op_args = (f.n, f.k, f.bits, f.group, f.has_mins)     # plain ints for the compiled graph
        # a bias (Qwen2's q/k/v) stays dense; load_weights fills it
        self.bias = None if bias_dtype is None else nn.Parameter(torch.zeros(f.n, dtype=bias_dtype),
                                                                 requires_grad=False)

    @property
    def kind(self) -> str:
        return f"int{self.fmt.bits}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.ops.kaiten_cpu.quant_linear(x, self.tiles, *self.op_args, self.min_dense_rows.get(x.dtype, NEVER),
                                              self.int8_rows.get(x.dtype, 0))
        return y if self.bias is None else y + self.bias

    def dequantize(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """The weight (or its `rows`) in fp32, computed as gguf's dequantizer does."""
        return dequantize(self.tiles, self.fmt, rows)


class QuantEmbedding(nn.Module):
    """An embedding table kept packed: a lookup dequantizes the rows it returns, in `dtype`, in
    one call of kaiten_cpu::dequantize_rows (quant_tiles.dequantize's numbers). CPU only; needs
    the C++ extension, as its table (a QuantLinear) does."""

    def __init__(self, table: QuantLinear, dtype: torch.dtype):
        super().__init__()
        self.table = table
        self.dtype = dtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = torch.ops.kaiten_cpu.dequantize_rows(self.table.tiles, ids, *self.table.op_args)
        return rows if self.dtype == torch.float32 else rows.to(self.dtype)
