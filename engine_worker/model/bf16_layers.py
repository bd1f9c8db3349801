"""Linear and embedding layers on bf16-stored weights for a model computing in fp32 on a CPU.

Where bf16 is not native (no AVX512-BF16/AMX) the engine computes in fp32; widening a bf16 model
to fp32 at load doubles its memory and the bytes every decode step streams. These layers keep the
stored bf16 and widen on the way in: Bf16Linear through kaiten_cpu::bf16_linear (kernels/csrc/
bf16_linear_cpu.cpp: in registers for few rows, widened chunks into an fp32 GEMM for many), and
Bf16Embedding widens only the rows it looks up. Widening is exact, so the model computes what its
fp32-widened copy would, up to summation order. The parameters keep nn.Linear's and nn.Embedding's
names, so load_weights fills them unchanged.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# Rows of x from which bf16_linear widens chunks for at::mm instead of multiplying in registers:
# bench/kernels/bf16_linear.py on a 2-core AVX2 EPYC (1 thread), SmolLM2-135M's shapes: summed over a
# step's projections, in registers is ahead through 96 rows (per shape: ahead on 2 of 5 at 64, on
# 3 of 5 at 96), behind on every shape at 128 (bench/results/bf16_linear/bf16_linear.md).
MIN_DENSE_ROWS = 96
ALWAYS_IN_REGISTERS = 2**62      # min_dense_rows that no call reaches


class Bf16Linear(nn.Module):
    """y = x W^T + b with W kept in bf16 and x, y, b in fp32. CPU only; needs the C++ extension.
    `weight` may be shared with a Bf16Embedding (a tied output layer). deterministic: every row in
    registers, computed the same whatever the number of rows (at::mm's blocking depends on it)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, weight: nn.Parameter | None = None,
                 deterministic: bool = True):
        super().__init__()
        self.min_dense_rows = ALWAYS_IN_REGISTERS if deterministic else MIN_DENSE_ROWS
        self.weight = weight if weight is not None else nn.Parameter(
            torch.empty(out_features, in_features, dtype=torch.bfloat16), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None

    @classmethod
    def like(cls, linear: nn.Linear, deterministic: bool = True) -> "Bf16Linear":
        return cls(linear.in_features, linear.out_features, linear.bias is not None, deterministic=deterministic)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.kaiten_cpu.bf16_linear(x, self.weight, self.bias, self.min_dense_rows)


class Bf16Embedding(nn.Module):
    """An embedding table kept in bf16: a lookup widens the rows it returns to fp32."""

    def __init__(self, num_embeddings: int, embedding_dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim, dtype=torch.bfloat16),
                                   requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight).float()
