"""Batched LoRA: each fused projection adds x A_s B_s for the tokens of the adapter in slot s.

Every projection has a stack of max_loras slots, A [S, in, parts * R] and B [S, parts * R, out]
(engine_worker/model/lora_weights.py lays an adapter out). A step sorts its adapter tokens by slot
once (LoraBatch); each projection then gathers those rows, multiplies each slot's contiguous run
by its own A and B (a segmented matmul, as punica's SGMV does), and adds the result back to those
rows. Base-model tokens are not touched, and the work grows with the tokens that use an adapter,
not with the number of adapters loaded. The segment loop is the custom op kaiten::lora_sgmv, so
the compiled forward keeps one graph for every step.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn


def projection_shapes(cfg) -> dict[str, tuple[int, list[int]]]:
    """A ModelConfig's fused projections -> (input features, output features of each part)."""
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    h, i = cfg.hidden_size, cfg.intermediate_size
    return {"qkv": (h, [q, kv, kv]), "o": (q, [h]), "gate_up": (h, [i, i]), "down": (i, [h])}


@dataclass(slots=True)
class LoraBatch:
    """The step's adapter tokens: rows of the batch sorted by slot, and where each slot's run
    starts (bounds[s]:bounds[s + 1] in token_index are slot s's rows)."""
    token_index: torch.Tensor     # [N] int64
    bounds: torch.Tensor          # [max_loras + 1] int64

    @classmethod
    def build(cls, slot_of_token: np.ndarray, num_slots: int, device: torch.device) -> "LoraBatch":
        """From each token's slot (-1: the base model)."""
        used = np.flatnonzero(slot_of_token >= 0)
        order = used[np.argsort(slot_of_token[used], kind="stable")]
        bounds = np.zeros(num_slots + 1, dtype=np.int64)
        np.cumsum(np.bincount(slot_of_token[used], minlength=num_slots), out=bounds[1:])
        return cls(torch.from_numpy(order.astype(np.int64)).to(device), torch.from_numpy(bounds).to(device))


@torch.library.custom_op("kaiten::lora_sgmv", mutates_args=())
def lora_sgmv(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, bounds: torch.Tensor) -> torch.Tensor:
    """x [N, in] sorted by slot -> [N, out]: rows bounds[s]:bounds[s+1] times a[s] then b[s]."""
    out = x.new_empty((x.shape[0], b.shape[-1]))
    edges = bounds.tolist()
    for s in range(len(edges) - 1):
        lo, hi = edges[s], edges[s + 1]
        if hi > lo:
            torch.mm(torch.mm(x[lo:hi], a[s]), b[s], out=out[lo:hi])
    return out


@lora_sgmv.register_fake
def _lora_sgmv_fake(x, a, b, bounds):
    return x.new_empty((x.shape[0], b.shape[-1]))


class LoraStack(nn.Module):
    """The slots of one fused projection."""

    def __init__(self, num_slots: int, fan_in: int, width: int, fan_out: int, dtype: torch.dtype,
                 device: torch.device):
        super().__init__()
        self.register_buffer("a", torch.zeros(num_slots, fan_in, width, dtype=dtype, device=device))
        self.register_buffer("b", torch.zeros(num_slots, width, fan_out, dtype=dtype, device=device))

    def forward(self, x: torch.Tensor, y: torch.Tensor, lora: LoraBatch) -> torch.Tensor:
        """y (the base projection of x) plus each adapter token's LoRA term."""
        idx = lora.token_index
        return y.index_add(0, idx, lora_sgmv(x.index_select(0, idx), self.a, self.b, lora.bounds))

    @torch.no_grad()
    def write(self, slot: int, a: torch.Tensor | None, b: torch.Tensor | None) -> None:
        """Put an adapter's pair in `slot`, or zeros (None)."""
        if a is None:
            self.a[slot].zero_()
            self.b[slot].zero_()
        else:
            self.a[slot].copy_(a)
            self.b[slot].copy_(b)
