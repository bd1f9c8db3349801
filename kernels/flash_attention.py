"""Paged attention on flash-attn 2 (optional extra ``kaiten[gpu]``; CUDA, fp16/bf16).

Decode-only batches go to ``flash_attn_with_kvcache`` (one query token per sequence, paged cache
through ``block_table``); anything else to ``flash_attn_varlen_func`` with ``block_table``, whose
causal mask is aligned bottom-right, i.e. query j of a chunk of q_len tokens sits at position
seqlen_k - q_len + j, exactly the interface's convention. The cache layout
``[num_blocks, block_size, num_kv_heads, head_dim]`` is flash-attn's paged layout; FA2 needs
block_size % 256 == 0, hence ``REQUIRED_BLOCK_SIZE`` (the engine reads it and logs the change).

A sliding window of W keys is flash-attn's ``window_size=(W - 1, 0)`` (the W - 1 keys before each
query and none after; (-1, -1) for none), the interface's convention; flash-attn starts each
query block's key loop at its first query's window (n_block_min), so blocks before it are not read.

flash-attn has no fp32 kernels: fp32 models fall back to the Triton kernels (logged once).
write_kv uses the Triton write kernel (it skips slot -1 without a host sync).
"""
from __future__ import annotations

import logging

import torch

from kernels.interface import AttentionMetadata, TwoCalls

log = logging.getLogger(__name__)

_FA_DTYPES = (torch.float16, torch.bfloat16)


class FlashAttention(TwoCalls):
    name = "flash_attn"
    cuda_graph_safe = True
    compile_safe = False
    any_kv_dtype = False
    REQUIRED_BLOCK_SIZE = 256

    def __init__(self):
        try:
            from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache
        except ImportError as e:
            raise ImportError(
                "attention backend 'flash_attn' needs flash-attn 2, which is not installed "
                "(pip install 'kaiten[gpu]', CUDA only); use attention_backend='triton' "
                f"or 'auto' instead ({e})") from e
        self._varlen = flash_attn_varlen_func
        self._with_kvcache = flash_attn_with_kvcache
        self._triton = None

    def _triton_backend(self):
        if self._triton is None:
            from kernels.triton_attention import TritonAttention
            self._triton = TritonAttention()
        return self._triton

    def write_kv(self, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        if key.is_cuda:
            from kernels.triton_attention import write_kv
            write_kv(key, value, k_cache, v_cache, slot_mapping)
            return
        # (not reached on a real deployment: flash-attn is CUDA only)
        keep = slot_mapping[: key.shape[0]] >= 0
        slots = slot_mapping[: key.shape[0]][keep]
        k_cache.view(-1, *k_cache.shape[2:])[slots] = key[keep].to(k_cache.dtype)
        v_cache.view(-1, *v_cache.shape[2:])[slots] = value[keep].to(v_cache.dtype)

    def attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  meta: AttentionMetadata, scale: float, window: int = 0,
                  out: torch.Tensor | None = None) -> torch.Tensor:
        if window < 0:
            raise ValueError(f"window {window} < 0 (0: no window)")
        if q.dtype not in _FA_DTYPES or k_cache.dtype != q.dtype:
            if self._triton is None:
                log.warning("flash-attn supports fp16/bf16 only; using the Triton kernels for %s",
                            q.dtype)
            return self._triton_backend().attention(q, k_cache, v_cache, meta, scale, window, out=out)
        window_size = (window - 1, 0) if window > 0 else (-1, -1)
        if k_cache.shape[1] % self.REQUIRED_BLOCK_SIZE:
            raise ValueError(f"flash-attn paged KV needs block_size % {self.REQUIRED_BLOCK_SIZE} "
                             f"== 0, got {k_cache.shape[1]}")
        if q.shape[0] == 0:
            res = torch.empty_like(q)
        elif meta.is_decode_only and q.shape[0] == meta.num_seqs:
            res = self._with_kvcache(
                q.unsqueeze(1), k_cache, v_cache,
                cache_seqlens=meta.seqlens_k, block_table=meta.block_tables,
                softmax_scale=scale, causal=True, window_size=window_size,
            ).squeeze(1)
        else:
            cu_seqlens_k = torch.nn.functional.pad(
                torch.cumsum(meta.seqlens_k, 0, dtype=torch.int32), (1, 0))
            res = self._varlen(
                q, k_cache, v_cache, meta.cu_seqlens_q, cu_seqlens_k,
                meta.max_seqlen_q, meta.max_seqlen_k,
                softmax_scale=scale, causal=True, window_size=window_size, block_table=meta.block_tables,
            )
        if out is None:
            return res
        out.copy_(res)
        return out
