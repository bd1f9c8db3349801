"""Qwen3: Llama's layers with each head's q and k RMS-normalised before the rotation, and a
head_dim of its own (not hidden_size / heads)."""
from __future__ import annotations

from engine_worker.model.layers.attention import Attention
from engine_worker.model.models.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    def attention(self, window: int) -> Attention:
        cfg = self.cfg
        bias = bool(getattr(cfg.hf, "attention_bias", False))
        return Attention(cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, scale=cfg.head_dim ** -0.5,
                         window=window, qkv_bias=bias, o_bias=bias, qk_norm_eps=cfg.rms_norm_eps)
