"""The attention backend by name: the factory that knows every backend (kernels/interface.py is
the contract they implement). Each backend is imported only when picked, so the CPU never imports
Triton or flash-attn."""
from __future__ import annotations

import torch

from kernels.cpu_ops_build import cpu_ops_available
from kernels.interface import AttentionBackend

__all__ = ["get_attention_backend"]


def get_attention_backend(name: str = "auto", device: str | torch.device = "cpu") -> AttentionBackend:
    """'auto' picks flash-attn, then Triton, on CUDA; on the CPU the fused C++ kernel ('cpu') when
    it builds here, else torch (the reference, always selectable by name)."""
    device = torch.device(device)
    if name == "auto":
        if device.type == "cuda":
            try:
                import flash_attn  # noqa: F401
                name = "flash_attn"
            except ImportError:
                name = "triton"
        else:
            name = "cpu" if cpu_ops_available() else "torch"
    if name == "cpu":
        from kernels.cpu_attention import CppAttention
        return CppAttention()
    if name == "torch":
        from kernels.torch_attention import TorchAttention
        return TorchAttention()
    if name == "triton":
        from kernels.triton_attention import TritonAttention
        return TritonAttention()
    if name == "flash_attn":
        from kernels.flash_attention import FlashAttention
        return FlashAttention()
    raise ValueError(f"unknown attention backend {name!r} (cpu, torch, triton, flash_attn, auto)")
