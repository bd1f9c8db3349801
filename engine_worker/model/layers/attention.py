"""Self-attention over the paged KV cache: one fused qkv projection, optional per-head q/k norms,
rotary embeddings (or none: NoPE layers), and the layer's own scale and sliding window."""
from __future__ import annotations

import torch
from torch import nn

from engine_worker.model.layers.norm import RMSNorm
from engine_worker.model.layers.rotary import apply_rotary
from engine_worker.model.lora_layers import LoraBatch, project
from kernels.interface import AttentionBackend, AttentionMetadata


class Attention(nn.Module):
    """`window`: the keys a query sees, itself included (0: every earlier key). `qk_norm_eps`:
    RMSNorm each head's q and k before the rotation (Qwen3, Gemma 3), in `norm_offset`'s
    convention."""

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int, *, scale: float,
                 window: int = 0, qkv_bias: bool = False, o_bias: bool = False, qk_norm_eps: float | None = None,
                 norm_offset: bool = False):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.q_size, self.kv_size = num_heads * head_dim, num_kv_heads * head_dim
        self.qkv_proj = nn.Linear(hidden_size, self.q_size + 2 * self.kv_size, bias=qkv_bias)
        self.o_proj = nn.Linear(self.q_size, hidden_size, bias=o_bias)
        self.q_norm = self.k_norm = None
        if qk_norm_eps is not None:
            self.q_norm = RMSNorm(head_dim, qk_norm_eps, norm_offset)
            self.k_norm = RMSNorm(head_dim, qk_norm_eps, norm_offset)
        self.scale = scale
        self.window = window
        self.lora: nn.ModuleDict | None = None       # "qkv", "o": LoraStacks (enable_lora)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None, kv_cache,
                meta: AttentionMetadata, backend: AttentionBackend, lora: LoraBatch | None = None) -> torch.Tensor:
        qkv = project(self.qkv_proj, x, self, "qkv", lora)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if rope is not None:
            q, k = apply_rotary(q, *rope), apply_rotary(k, *rope)
        k_cache, v_cache = kv_cache
        out = backend.write_kv_and_attention(q, k, v, k_cache, v_cache, meta, self.scale, self.window)
        return project(self.o_proj, out.reshape(-1, self.q_size), self, "o", lora)
