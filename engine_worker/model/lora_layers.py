"""Batched LoRA: each fused projection adds x A_s B_s for the tokens of the adapter in slot s.

Every projection has a stack of max_loras slots, A [S, in, parts * R] and B [S, parts * R, out]
(engine_worker/model/lora_weights.py lays an adapter out). A step lays its adapter tokens out by
slot once (LoraBatch), as punica's SGMV does; each projection then runs one op, kaiten::lora_add:
where the slots' runs are even (decode steps), the runs padded to one length through two bmm
calls; else (prefill chunks) a pair of matmuls per slot over its contiguous run. Base-model tokens
are not touched, and the work grows with the tokens that use an adapter, not with the number of
adapters loaded. The op is opaque to torch.compile, so the compiled forward keeps one graph for
every step.
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


# Pad the slots' runs to one length for two bmm calls while that at most doubles the rows (decode
# batches); else one pair of matmuls per slot (prefill chunks). bench/lora.py times both.
MAX_PADDING = 2.0


@dataclass(slots=True)
class LoraBatch:
    """The step's adapter tokens, in one of two layouts (the other's tensors are empty).
    Segmented: token_index, the batch rows of adapter tokens sorted by slot, and bounds
    (bounds[s]:bounds[s + 1] in token_index are slot s's rows). Padded, where the runs are even
    enough: slots first..first+K-1 as K runs of L, pad_index[k * L + l] the batch row at (slot
    first + k, position l) or T (a zero row), scatter_index the batch row each padded position
    adds to (a pad: row 0, to which it adds zeros), and runs = [first, K]. (Flat, so that every
    index tensor has stride 1 and the compiled graph never recompiles for a layout.)"""
    token_index: torch.Tensor     # [N] int64
    bounds: torch.Tensor          # [max_loras + 1] int64
    pad_index: torch.Tensor       # [K * L] int64
    scatter_index: torch.Tensor   # [K * L] int64
    runs: torch.Tensor            # [2] int64: first, K

    @classmethod
    def build(cls, slot_of_token: np.ndarray, num_slots: int, device: torch.device) -> "LoraBatch":
        """From each token's slot (-1: the base model)."""
        used = np.flatnonzero(slot_of_token >= 0)
        order = used[np.argsort(slot_of_token[used], kind="stable")]
        counts = np.bincount(slot_of_token[used], minlength=num_slots)
        bounds = np.zeros(num_slots + 1, dtype=np.int64)
        np.cumsum(counts, out=bounds[1:])
        active = np.flatnonzero(counts)
        empty = np.zeros(0, dtype=np.int64)
        pad, scatter, runs = empty, empty, (0, 0)
        if len(active) and (active[-1] - active[0] + 1) * counts.max() <= MAX_PADDING * len(used):
            first, width = active[0], counts.max()
            runs = (first, active[-1] - first + 1)
            at = (np.repeat(np.arange(num_slots), counts) - first) * width \
                + np.arange(len(used)) - np.repeat(bounds[:-1], counts)   # each sorted row's padded position
            pad = np.full(runs[1] * width, len(slot_of_token), dtype=np.int64)
            pad[at] = order
            scatter = np.where(pad == len(slot_of_token), 0, pad)
            order, bounds = empty, np.zeros(num_slots + 1, dtype=np.int64)
        return cls(_flat(order, device), _flat(bounds, device), _flat(pad, device), _flat(scatter, device),
                   _flat(runs, device))

    def args(self) -> tuple[torch.Tensor, ...]:
        return self.token_index, self.bounds, self.pad_index, self.scatter_index, self.runs


def _flat(values, device: torch.device) -> torch.Tensor:
    """A 1-D int64 tensor of stride 1, even when empty (torch gives an empty one stride 0, which
    would fail the compiled graph's stride guard)."""
    t = torch.tensor(values, dtype=torch.int64, device=device)
    return t.as_strided((len(t),), (1,))


@torch.library.custom_op("kaiten::lora_add", mutates_args=())
def lora_add(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, token_index: torch.Tensor,
             bounds: torch.Tensor, pad_index: torch.Tensor, scatter_index: torch.Tensor,
             runs: torch.Tensor) -> torch.Tensor:
    """y + x a_s b_s for each adapter token's slot s (LoraBatch says which, in either layout)."""
    if pad_index.numel():
        first, k = runs.tolist()
        rows = torch.cat([x, x.new_zeros(1, x.shape[1])])[pad_index].view(k, -1, x.shape[1])   # [K, L, in]
        out = torch.bmm(torch.bmm(rows, a[first:first + k]), b[first:first + k])
        return y.index_add(0, scatter_index, out.view(-1, out.shape[-1]))
    if not token_index.numel():
        return y.clone()
    rows = x.index_select(0, token_index)
    out = rows.new_empty((rows.shape[0], b.shape[-1]))
    edges = bounds.tolist()
    for s in range(len(edges) - 1):
        lo, hi = edges[s], edges[s + 1]
        if hi > lo:
            torch.mm(torch.mm(rows[lo:hi], a[s]), b[s], out=out[lo:hi])
    return y.index_add(0, token_index, out)


@lora_add.register_fake
def _lora_add_fake(y, x, a, b, token_index, bounds, pad_index, scatter_index, runs):
    return torch.empty_like(y)


class LoraStack(nn.Module):
    """The slots of one fused projection."""

    def __init__(self, num_slots: int, fan_in: int, width: int, fan_out: int, dtype: torch.dtype,
                 device: torch.device):
        super().__init__()
        self.register_buffer("a", torch.zeros(num_slots, fan_in, width, dtype=dtype, device=device))
        self.register_buffer("b", torch.zeros(num_slots, width, fan_out, dtype=dtype, device=device))

    def forward(self, x: torch.Tensor, y: torch.Tensor, lora: LoraBatch) -> torch.Tensor:
        """y (the base projection of x) plus each adapter token's LoRA term."""
        return lora_add(y, x, self.a, self.b, *lora.args())

    @torch.no_grad()
    def write(self, slot: int, a: torch.Tensor | None, b: torch.Tensor | None) -> None:
        """Put an adapter's pair in `slot`, or zeros (None)."""
        if a is None:
            self.a[slot].zero_()
            self.b[slot].zero_()
        else:
            self.a[slot].copy_(a)
            self.b[slot].copy_(b)
