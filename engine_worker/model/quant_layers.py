"""Linear and embedding layers on GGUF-quantized weights kept as stored (shared/gguf_quant.py).

QuantLinear multiplies with kaiten_cpu::quant_linear from the C++ extension (kernels/csrc/
quant_linear_cpu.cpp), which dequantizes in registers for few rows and into chunks for a dense
GEMM for many; QuantEmbedding dequantizes only the rows it looks up. A tied output layer is a
QuantLinear on the embedding's own buffers, so the largest matrix stays quantized and stored once.
"""
from __future__ import annotations

import numpy as np
import torch
from torch import nn

from shared.gguf_quant import PackedWeight

# Rows of x from which quant_linear dequantizes chunks for at::mm instead of multiplying in
# registers: bench/quant_linear.py on a 2-core EPYC with AVX512-BF16, SmolLM2-135M's shapes: in
# registers is ahead at 16 rows, the dense GEMM at 32 (bench/results/quant_linear_*.md).
MIN_DENSE_ROWS = 24


class QuantLinear(nn.Module):
    """y = x W^T, W packed (int4 or int8 with group scales and mins). No bias: GGUF Llama
    projections have none. CPU only; needs the C++ extension."""

    def __init__(self, packed: PackedWeight):
        super().__init__()
        self.register_buffer("qweight", torch.from_numpy(np.ascontiguousarray(packed.qweight)))
        self.register_buffer("scales", torch.from_numpy(np.ascontiguousarray(packed.scales)))
        self.register_buffer("mins", None if packed.mins is None else torch.from_numpy(np.ascontiguousarray(packed.mins)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.kaiten_cpu.quant_linear(x, self.qweight, self.scales, self.mins, MIN_DENSE_ROWS)

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
