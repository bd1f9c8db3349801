"""Llama (2, 3, 3.1, 3.2) and Mistral: pre-norm layers, GQA, SwiGLU, rotary embeddings with any
static scaling (Llama 3's included), and Mistral's sliding window on every layer."""
from __future__ import annotations

from torch import nn

from engine_worker.model.causal_lm import CausalLM
from engine_worker.model.layers.attention import Attention
from engine_worker.model.layers.decoder import DecoderLayer
from engine_worker.model.layers.mlp import GatedMLP


class LlamaForCausalLM(CausalLM):
    def attention(self, window: int) -> Attention:
        cfg, hf = self.cfg, self.cfg.hf
        bias = bool(getattr(hf, "attention_bias", False))
        return Attention(cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, scale=cfg.head_dim ** -0.5,
                         window=window, qkv_bias=bias, o_bias=bias)

    def mlp(self) -> GatedMLP:
        cfg, hf = self.cfg, self.cfg.hf
        return GatedMLP(cfg.hidden_size, cfg.intermediate_size, hf.hidden_act, bool(getattr(hf, "mlp_bias", False)))

    def build_layer(self, index: int, window: int, rope_index: int) -> nn.Module:
        return DecoderLayer(self.attention(window), self.mlp(), self.cfg.hidden_size, self.cfg.rms_norm_eps,
                            rope_index)


class MistralForCausalLM(LlamaForCausalLM):
    """Llama's layers; the config's sliding window applies to every layer (config.py)."""
