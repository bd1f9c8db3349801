"""Linear and embedding layers on GGUF-quantized weights kept as stored (shared/gguf_quant.py).

QuantLinear multiplies with kaiten_cpu::quant_linear from the C++ extension (kernels/csrc/
quant_linear_cpu.cpp), which, by the number of rows, rounds the activations to int8 for integer
dot products, dequantizes in fp32 registers, or dequantizes chunks for a dense GEMM;
QuantEmbedding dequantizes only the rows it looks up. A tied output layer is a QuantLinear on the
embedding's own buffers, so the largest matrix stays quantized and stored once.
"""
from __future__ import annotations

import numpy as np
import torch
from torch import nn

from shared.gguf_quant import PackedWeight

# Rows of x up to which quant_linear rounds x to int8 (llama.cpp's q8 dot products), by weight
# kind. Min of 11 rounds, 1 thread (load 7-13 on 2 cores), AVX2 EPYC, bench/quant_linear.py's
# shapes and methods, int8 time / fp32-registers time: int4 0.75-0.86 at 1 row, 0.97-1.04 at 2-3, 1.2-1.3 from 4 (the fp32 FMAs reuse a
# dequantized group over 4 rows more cheaply than 5 integer ops a pair); int8 weights 0.56-0.91
# at 1-2 rows and 0.87-1.07 up to 64, so int8 for every row the dense GEMM does not take.
# int4 weights keep the exact fp32-register method (0: never int8): at 1 row the int8 method saves
# at most a quarter of the kernel, about 41% of a step, and its rounding (logprobs 0.13 off on a
# tiny model) flipped the default model's fp32 chat answer to "What is the capital of France?",
# a 0.1-nat tie, into "L'Etoile, la Marseillaise, ..." (tests/test_engine_smollm2.py).
MAX_INT8_ROWS = {"int4": 0, "int8": 1 << 30}
# Rows of x from which quant_linear dequantizes chunks for at::mm, by x's dtype (the dense GEMM's
# speed is the dtype's). bf16: bench/quant_linear.py on a 2-core EPYC with AVX512-BF16,
# SmolLM2-135M's shapes: in registers ahead at 16 rows, the dense GEMM at 32
# (bench/results/quant_linear_bfloat16.md). fp32: min of 5-11 rounds, 1 thread (the machine had a
# load of 7-13 on 2 cores), AVX2 EPYC, bench/quant_linear.py's shapes and methods, dense
# time / this time: int4 registers 1.4-3.6x at 24 rows, 0.9-1.1x at 48-64, dense ahead from 96
# (0.6-0.9x); int8 weights, int8 method 1.2-1.6x at 24, 1.0-1.35x at 48-64, dense ahead from 96-128.
MIN_DENSE_ROWS = {torch.bfloat16: 24, torch.float32: 64}


class QuantLinear(nn.Module):
    """y = x W^T, W packed (int4 or int8 with group scales and mins). No bias: GGUF Llama
    projections have none. CPU only; needs the C++ extension."""

    def __init__(self, packed: PackedWeight):
        super().__init__()
        self.register_buffer("qweight", torch.from_numpy(np.ascontiguousarray(packed.qweight)))
        self.register_buffer("scales", torch.from_numpy(np.ascontiguousarray(packed.scales)))
        self.register_buffer("mins", None if packed.mins is None else torch.from_numpy(np.ascontiguousarray(packed.mins)))
        self.kind = packed.kind
        self.max_int8_rows = MAX_INT8_ROWS[packed.kind]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.kaiten_cpu.quant_linear(x, self.qweight, self.scales, self.mins, self.max_int8_rows,
                                                 MIN_DENSE_ROWS.get(x.dtype, 24))

    def dequantize(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """The weight (or its `rows`) in fp32, computed as gguf's dequantizer does."""
        q = self.qweight if rows is None else self.qweight[rows]
        scales = self.scales if rows is None else self.scales[rows]
        if q.dtype == torch.uint8:                       # per group: 16 bytes, low nibbles first
            g = q.view(*q.shape[:-1], scales.shape[-1], 16)
            q = torch.cat([g & 0x0F, g >> 4], dim=-1)
        else:
            q = q.view(*q.shape[:-1], scales.shape[-1], -1)
        w = q.float() * scales[..., None]
        if self.mins is not None:
            w = w + (self.mins if rows is None else self.mins[rows])[..., None]
        return w.flatten(-2)


class QuantEmbedding(nn.Module):
    """An embedding table kept packed: a lookup dequantizes the rows it returns, in `dtype`."""

    def __init__(self, table: QuantLinear, dtype: torch.dtype):
        super().__init__()
        self.table = table
        self.dtype = dtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.table.dequantize(ids).to(self.dtype)
