"""CppAttention: the fused C++ paged-attention kernel for the CPU (kernels/csrc/paged_attention_cpu.cpp).

One kernel call per layer covers the whole step, decodes and prefill chunks alike: it reads K/V
in place from the paged cache (no gather copy), processes the G query heads of a kv head together
with an online softmax in fp32, and spreads (sequence, kv head, query tile) work items over the
torch threads. float32 and bfloat16.

The kernel is one of the C++ CPU ops that kernels/cpu_ops_build.py builds and loads (its
dispatcher ops kaiten_cpu::paged_attention, ::write_kv and ::write_kv_attention have fake
kernels there, so a compiled model calls them directly). cpp_attention_available() says whether
they are there; kernels/registry.py's "auto" falls back to the torch backend when they are not.
"""
from __future__ import annotations

import torch

from kernels.cpu_ops_build import cpu_ops_available, load_cpu_ops
from kernels.interface import AttentionMetadata

__all__ = ["CppAttention", "cpp_attention_available"]


def cpp_attention_available() -> bool:
    """Whether the C++ kernel builds and loads here (the first call may build the C++ CPU ops)."""
    return cpu_ops_available()


class CppAttention:
    """CPU paged attention through the fused C++ kernel's dispatcher ops (kaiten_cpu::...).
    Stateless, so one instance may serve several threads; the ops have fake kernels, so a compiled
    model calls them directly (compile_safe), without a Python-defined op in between."""

    name = "cpu"
    cuda_graph_safe = False
    compile_safe = True
    any_kv_dtype = True         # fp32 or bf16 queries; an fp32, bf16 or fp16 cache

    def __init__(self) -> None:
        load_cpu_ops()

    def write_kv(self, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        torch.ops.kaiten_cpu.write_kv(*_kv_args(key, value, k_cache, v_cache, slot_mapping))

    def attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  meta: AttentionMetadata, scale: float, window: int = 0) -> torch.Tensor:
        out = torch.ops.kaiten_cpu.paged_attention(_kernel_q(q), k_cache, v_cache, *_metadata(meta), float(scale),
                                                   int(window))
        return out.to(q.dtype)

    def write_kv_and_attention(self, q, key, value, k_cache, v_cache, meta: AttentionMetadata, scale: float,
                               window: int = 0):
        """One op, kaiten_cpu::write_kv_attention."""
        kv = _kv_args(key, value, k_cache, v_cache, meta.slot_mapping)
        out = torch.ops.kaiten_cpu.write_kv_attention(_kernel_q(q), *kv, *_metadata(meta), float(scale), int(window))
        return out.to(q.dtype)


def _kernel_q(q: torch.Tensor) -> torch.Tensor:
    """q in a dtype the kernel takes (fp32 or bf16; anything else widened to fp32)."""
    return q if q.dtype in (torch.float32, torch.bfloat16) else q.to(torch.float32)


def _kv_args(key, value, k_cache, v_cache, slot_mapping) -> tuple:
    """write_kv's arguments: the rows in the cache's dtype, the slots as int64."""
    return key.to(k_cache.dtype), value.to(v_cache.dtype), k_cache, v_cache, slot_mapping.to(torch.int64)


def _metadata(meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _int32(meta.cu_seqlens_q), _int32(meta.seqlens_k), _int32(meta.block_tables)


def _int32(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.int32 else t.to(torch.int32)
