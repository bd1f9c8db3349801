"""The pre-norm decoder layer of Llama, Mistral, Qwen, Phi-3 and SmolLM3:
x + attn(norm(x)), then x + mlp(norm(x))."""
from __future__ import annotations

import torch
from torch import nn

from engine_worker.model.layers.norm import RMSNorm
from engine_worker.model.lora_layers import LoraBatch


class DecoderLayer(nn.Module):
    """`rope_index`: which of the model's rotary tables the layer's attention takes (-1: none,
    a NoPE layer)."""

    def __init__(self, attn: nn.Module, mlp: nn.Module, hidden_size: int, eps: float, rope_index: int):
        super().__init__()
        self.input_layernorm = RMSNorm(hidden_size, eps)
        self.self_attn = attn
        self.post_attention_layernorm = RMSNorm(hidden_size, eps)
        self.mlp = mlp
        self.rope_index = rope_index

    def forward(self, x: torch.Tensor, ropes: list, kv_cache, meta, backend, lora: LoraBatch | None = None):
        rope = ropes[self.rope_index] if self.rope_index >= 0 else None
        x = x + self.self_attn(self.input_layernorm(x), rope, kv_cache, meta, backend, lora)
        return x + self.mlp(self.post_attention_layernorm(x), lora)
