"""oneDNN's blocked weights for the CPU's dense projections (PackedLinear), and its op for
compiled graphs."""
from __future__ import annotations

import torch
from torch import nn

from kernels.cpu_ops_build import cpu_ops_loaded


class PackedLinear(nn.Module):
    """A linear layer whose weight oneDNN has reordered into its blocked layout once, at load.
    On the CPU, MKL's GEMM is slow for the few rows of a decode step (bench/kernels/cpu_linear.py: on a
    2-core AVX2 EPYC, SmolLM2's projections run about 2x faster at 8 rows and 1.1-1.3x faster at
    1, 64 and 512). fp32 anywhere; bf16 where the CPU has native bf16 (AVX512-BF16/AMX), since
    oneDNN emulates it elsewhere. Inference only (no autograd). Under torch.compile it runs as the
    opaque op kaiten_cpu::packed_linear from the C++ extension where it is loaded, else the Python
    op kaiten::packed_linear (Inductor lowers oneDNN linears only for frozen weights)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.out_features = weight.shape[0]
        self.register_buffer("packed", torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 64))
        self.register_buffer("bias", None if bias is None else bias.detach().clone())

    @staticmethod
    def supported(device: torch.device, dtype: torch.dtype) -> bool:
        if device.type != "cpu" or not torch.backends.mkldnn.is_available():
            return False
        return dtype == torch.float32 or (dtype == torch.bfloat16 and cpu_has_native_bf16())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            op = torch.ops.kaiten_cpu.packed_linear if cpu_ops_loaded() else torch.ops.kaiten.packed_linear
            return op(x, self.packed, self.bias, self.out_features)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


@torch.library.custom_op("kaiten::packed_linear", mutates_args=())
def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None,
                  out_features: int) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


@packed_linear.register_fake
def _packed_linear_fake(x, packed, bias, out_features):
    return x.new_empty((*x.shape[:-1], out_features))


def cpu_has_native_bf16() -> bool:
    """AVX512-BF16 or AMX: bf16 matmuls run natively (elsewhere torch and oneDNN emulate them)."""
    try:
        flags = open("/proc/cpuinfo").read()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags
