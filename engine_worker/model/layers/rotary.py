"""Rotary position embeddings: every rope type the supported families' configs use, partial rotary
included, computed as Hugging Face computes them.

The inverse frequencies and the attention factor come from transformers' own rope functions
(``ROPE_INIT_FUNCTIONS``: linear, llama3, yarn, longrope), so a scaled rope is Hugging Face's by
construction. LongRoPE picks its long or short factors once, by the engine's context length, as
vLLM applies it: long factors wherever that length exceeds the original context, so a sequence's
keys never change rotation as it grows (Hugging Face switches factors by the current length).
"""
from __future__ import annotations

import torch
from torch import nn
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from shared.model_families import UnsupportedModelError

STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")


def rope_parameters(hf_config, layer_type: str | None) -> tuple[dict, str | None]:
    """The rope parameters of `layer_type`'s layers, and the layer type to name to transformers'
    rope functions: configs that give each layer type its own parameters (Gemma 3's) key them
    by type; others hold one set for every layer (the type named: None)."""
    params = hf_config.rope_parameters or {}
    if layer_type is not None and isinstance(params.get(layer_type), dict):
        return params[layer_type], layer_type
    return params, None


def inverse_frequencies(hf_config, layer_type: str | None, head_dim: int, max_model_len: int
                        ) -> tuple[torch.Tensor, float]:
    """(inv_freq [rotary_dim / 2] fp32, the cos/sin scaling) of a layer type's rope."""
    params, keyed = rope_parameters(hf_config, layer_type)
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in STATIC_ROPE_TYPES:
        raise UnsupportedModelError(f"rope type {rope_type!r} is not supported; supported: {', '.join(STATIC_ROPE_TYPES)}")
    if rope_type == "default":
        partial = params.get("partial_rotary_factor", getattr(hf_config, "partial_rotary_factor", None) or 1.0)
        dim = int(head_dim * partial)
        return 1.0 / (params["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)), 1.0
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, "cpu", seq_len=max_model_len, layer_type=keyed)
    return inv_freq.float(), float(scaling)


class RotaryEmbedding(nn.Module):
    """cos and sin of a step's positions, half a rotary width each (the halves repeat), computed
    per step from the fp32 inverse frequencies and cast to the hidden states' dtype, as Hugging
    Face computes them. No table by position: one would hold max_model_len x rotary_dim floats
    per rope type (33.5 MB of Gemma 3 270M's 32k context, 13% of its weights), for a product
    and a cos/sin of a few thousand numbers a step."""

    def __init__(self, inv_freq: torch.Tensor, scaling: float):
        super().__init__()
        self.scaling = scaling
        self._inv_freq_fp32 = inv_freq.float()     # the master copy: a cast of the model leaves it fp32
        self.register_buffer("inv_freq", self._inv_freq_fp32.clone(), persistent=False)

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        self.inv_freq = self._inv_freq_fp32.to(self.inv_freq.device)   # moved, never cast
        return self

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, 1, rotary_dim] of the step's positions in `dtype`, shared by its layers."""
        freqs = torch.outer(positions.float(), self.inv_freq)
        freqs = torch.cat((freqs, freqs), dim=-1).unsqueeze(1)
        cos, sin = freqs.cos(), freqs.sin()
        if self.scaling != 1.0:        # a product by 1 changes nothing: two eager calls a step fewer
            cos, sin = cos * self.scaling, sin * self.scaling
        return cos.to(dtype), sin.to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, head_dim] rotated in its first rotary_dim features (all of them but for
    partial rotary), neox style: the two halves of those features pair up."""
    rotary_dim = cos.shape[-1]
    if rotary_dim == x.shape[-1]:
        return x * cos + _rotate_half(x) * sin
    rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
    return torch.cat((rot * cos + _rotate_half(rot) * sin, rest), dim=-1)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)
