"""Qwen2 and Qwen2.5: Llama's layers with biases on q, k and v (not o), and sliding windows on the
layers the config's layer_types name."""
from __future__ import annotations

from engine_worker.model.layers.attention import Attention
from engine_worker.model.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    def attention(self, window: int) -> Attention:
        cfg = self.cfg
        return Attention(cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, scale=cfg.head_dim ** -0.5,
                         window=window, qkv_bias=True, o_bias=False)
