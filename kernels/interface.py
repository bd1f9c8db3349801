"""The paged-attention interface every backend implements (C++ or torch on CPU, Triton, flash-attn).

A step's batch is packed varlen: the query tokens of all sequences are concatenated, prefill
chunks and decodes alike, with no padding. Sequence i contributes q_len_i = cu_seqlens_q[i+1] -
cu_seqlens_q[i] query tokens, which are the LAST q_len_i tokens of its context of seqlens_k[i]
tokens. Query j of sequence i sits at position seqlens_k[i] - q_len_i + j and attends causally to
context positions 0..that position. The model writes the step's new K/V into the cache through
``slot_mapping`` *before* attention, so attention reads all keys, the new ones included, from the
paged cache.

Cache layout, per layer: k_cache and v_cache are [num_blocks, block_size, num_kv_heads, head_dim].
Token t of a sequence lives in block block_tables[i, t // block_size], offset t % block_size;
its slot is block * block_size + offset. A slot of -1 means "skip" (padding rows).

Sliding window: ``attention`` and ``write_kv_and_attention`` take ``window``, an int per call (per
layer; Mistral's every layer, 5 of 6 of Gemma 3's). 0 means no window (plain causal). With W > 0
the query at position p attends exactly the keys at positions k with p - W < k <= p: W keys
including its own, as transformers' ``sliding_window_overlay`` (``kv_idx > q_idx -
sliding_window``) and flash-attn's ``window_size=(W - 1, 0)``; a window at least as long as the
context changes nothing. This holds for decodes, prefill chunks over a cached prefix and the
multi-token queries of speculative verification alike, each query row with its own window.
Block-table entries of blocks wholly before max(0, first query position - W + 1) are never read
(the first query position is seqlens_k[i] - q_len_i): the engine may release the blocks that fell
out of the window of every sliding layer, and their entries may then name blocks reused by other
sequences, or be -1.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass(slots=True)
class AttentionMetadata:
    cu_seqlens_q: torch.Tensor   # int32 [B+1], cumulative query lengths
    seqlens_k: torch.Tensor      # int32 [B], context length of each sequence including this step
    block_tables: torch.Tensor   # int32 [B, max_blocks], padded with -1
    slot_mapping: torch.Tensor   # int64 [num_tokens], cache slot per new token, -1 to skip
    max_seqlen_q: int
    max_seqlen_k: int
    # Host-side copies, so a CPU backend can plan without device syncs.
    seqlens_q_list: list[int] | None = None
    seqlens_k_list: list[int] | None = None

    @property
    def num_seqs(self) -> int:
        return self.seqlens_k.shape[0]

    @property
    def is_decode_only(self) -> bool:
        return self.max_seqlen_q == 1


class AttentionBackend(Protocol):
    name: str
    cuda_graph_safe: bool       # launches capturable in a CUDA graph (no host syncs or host values)
    compile_safe: bool          # traceable by torch.compile as it is (dispatcher ops with fake kernels,
                                # no host values); else the compiled model reaches it through custom ops
    any_kv_dtype: bool          # reads a KV cache of another dtype than the queries' (widening it as read)

    def write_kv(self, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """key/value: [num_tokens, num_kv_heads, head_dim] -> cache slots; slot -1 skipped."""

    def attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  meta: AttentionMetadata, scale: float, window: int = 0) -> torch.Tensor:
        """q: [num_tokens, num_heads, head_dim] -> [num_tokens, num_heads, head_dim].
        GQA: query head h reads kv head h // (num_heads // num_kv_heads). window: the sliding
        window in keys (see the module docstring), 0 for none."""

    def write_kv_and_attention(self, q: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                               k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                               scale: float, window: int = 0) -> torch.Tensor:
        """write_kv(key, value, ..., meta.slot_mapping), then attention(q, ..., window): a layer's step."""


class TwoCalls:
    """write_kv_and_attention as the two calls, for backends that do not fuse them."""

    def write_kv_and_attention(self, q, key, value, k_cache, v_cache, meta: AttentionMetadata, scale: float,
                               window: int = 0):
        self.write_kv(key, value, k_cache, v_cache, meta.slot_mapping)
        return self.attention(q, k_cache, v_cache, meta, scale, window)
