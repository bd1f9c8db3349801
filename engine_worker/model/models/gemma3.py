"""Gemma 3 (text): (1 + w) RMSNorms in fp32, four of them a layer (before and after attention and
the MLP), GeGLU with tanh GELU, embeddings scaled by sqrt(hidden_size), per-head q/k norms, the
attention scale from query_pre_attn_scalar, sliding and full layers with rotary tables of their
own, and the final logits soft-capped where the config says (CausalLM.compute_logits)."""
from __future__ import annotations

import torch
from torch import nn

from engine_worker.model.causal_lm import CausalLM
from engine_worker.model.layers.attention import Attention
from engine_worker.model.layers.mlp import GatedMLP
from engine_worker.model.layers.norm import RMSNorm
from engine_worker.model.lora_layers import LoraBatch
from shared.model_families import UnsupportedModelError


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, attn: Attention, mlp: GatedMLP, hidden_size: int, eps: float, rope_index: int):
        super().__init__()
        self.input_layernorm = RMSNorm(hidden_size, eps, offset=True)
        self.self_attn = attn
        self.post_attention_layernorm = RMSNorm(hidden_size, eps, offset=True)
        self.pre_feedforward_layernorm = RMSNorm(hidden_size, eps, offset=True)
        self.mlp = mlp
        self.post_feedforward_layernorm = RMSNorm(hidden_size, eps, offset=True)
        self.rope_index = rope_index

    def forward(self, x: torch.Tensor, ropes: list, kv_cache, meta, backend, lora: LoraBatch | None = None):
        rope = ropes[self.rope_index] if self.rope_index >= 0 else None
        x = x + self.post_attention_layernorm(
            self.self_attn(self.input_layernorm(x), rope, kv_cache, meta, backend, lora))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x), lora))


class Gemma3ForCausalLM(CausalLM):
    norm_offset = True

    def __init__(self, cfg, max_model_len: int):
        if getattr(cfg.hf, "attn_logit_softcapping", None):
            raise UnsupportedModelError("Gemma 3 with attention logit soft-capping is not supported")
        super().__init__(cfg, max_model_len)
        # Hugging Face multiplies by the scale cast to the weights' dtype (a buffer cast with them)
        self.register_buffer("embed_scale", torch.tensor(cfg.hidden_size ** 0.5), persistent=False)

    def build_layer(self, index: int, window: int, rope_index: int) -> nn.Module:
        cfg, hf = self.cfg, self.cfg.hf
        bias = bool(getattr(hf, "attention_bias", False))
        attn = Attention(cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                         scale=hf.query_pre_attn_scalar ** -0.5, window=window, qkv_bias=bias, o_bias=bias,
                         qk_norm_eps=cfg.rms_norm_eps, norm_offset=True)
        mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, hf.hidden_activation)
        return Gemma3DecoderLayer(attn, mlp, cfg.hidden_size, cfg.rms_norm_eps, rope_index)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        return x * self.embed_scale.to(x.dtype)
