"""Batched LoRA: each fused projection adds x A_s B_s for the tokens of the adapter in slot s.

Every projection has a stack of max_loras slots, A [S, in, parts * R] and B [S, R, out]: part i
(q, k, v or gate, up) takes rank columns i*R..(i+1)*R of x A and its own columns of B and of the
output, so B holds no zeros (engine_worker/model/lora_weights.py lays an adapter out). A step
lays its adapter tokens out by slot once (LoraBatch), as punica's SGMV does; each projection then
adds its terms into the base projection's output in place with one op: in fp32 on the CPU the C++
kernel kaiten_cpu::lora_add_ (kernels/csrc/lora_cpu.cpp), else kaiten::lora_add_ in torch ops,
which pads the slots' runs to one length for batched matmuls where they are even (decode steps)
and runs matmuls per slot elsewhere. Base-model tokens are not touched, and the work grows with
the tokens that use an adapter, not with the number of adapters loaded. The ops are opaque to
torch.compile, so the compiled forward keeps one graph for every step with adapter tokens.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from kernels.cpu_ops_build import cpu_ops_loaded


def projection_shapes(cfg) -> dict[str, tuple[int, list[int]]]:
    """A ModelConfig's fused projections -> (input features, output features of each part)."""
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    h, i = cfg.hidden_size, cfg.intermediate_size
    return {"qkv": (h, [q, kv, kv]), "o": (q, [h]), "gate_up": (h, [i, i]), "down": (i, [h])}


def project(linear: nn.Module, x: torch.Tensor, owner: nn.Module, key: str, lora: "LoraBatch | None") -> torch.Tensor:
    """linear(x), plus the LoRA term of `owner`'s stack `key` for a step with adapter tokens. A
    base-model step never reads `owner.lora`: the compiled base graph keeps no guard on it, so
    enabling LoRA later (the first adapter) does not recompile it."""
    y = linear(x)
    return y if lora is None else owner.lora[key](x, y, lora)


# The torch ops pad the slots' runs to one length for batched matmuls while that at most doubles
# the rows (decode batches); else matmuls per slot (prefill chunks). bench/engine/lora.py times both.
MAX_PADDING = 2.0


@dataclass(slots=True)
class LoraBatch:
    """The step's adapter tokens, in one of two layouts (the other's tensors are empty).
    Segmented: token_index, the batch rows of adapter tokens sorted by slot, and bounds
    (bounds[s]:bounds[s + 1] in token_index are slot s's rows). Padded, where the runs are even
    enough: slots first..first+K-1 as K runs of L, pad_index[k * L + l] the batch row at (slot
    first + k, position l), or row 0 for a pad, pad_rows the padded positions that are pads (their
    terms are zeroed before they are added), and runs = [first, K]. (Flat, so that every index
    tensor has stride 1 and the compiled graph never recompiles for a layout.)"""
    token_index: torch.Tensor     # [N] int64
    bounds: torch.Tensor          # [max_loras + 1] int64
    pad_index: torch.Tensor       # [K * L] int64
    pad_rows: torch.Tensor        # [K * L - N] int64
    runs: torch.Tensor            # [2] int64: first, K

    @classmethod
    def build(cls, slot_of_token: np.ndarray, num_slots: int, device: torch.device,
              padded: bool = True) -> "LoraBatch":
        """From each token's slot (-1: the base model); `padded`: may take the padded layout."""
        used = np.flatnonzero(slot_of_token >= 0)
        order = used[np.argsort(slot_of_token[used], kind="stable")]
        counts = np.bincount(slot_of_token[used], minlength=num_slots)
        bounds = np.zeros(num_slots + 1, dtype=np.int64)
        np.cumsum(counts, out=bounds[1:])
        active = np.flatnonzero(counts)
        empty = np.zeros(0, dtype=np.int64)
        pad, pad_rows, runs = empty, empty, (0, 0)
        if padded and len(active) and (active[-1] - active[0] + 1) * counts.max() <= MAX_PADDING * len(used):
            first, width = active[0], counts.max()
            runs = (first, active[-1] - first + 1)
            at = (np.repeat(np.arange(num_slots), counts) - first) * width \
                + np.arange(len(used)) - np.repeat(bounds[:-1], counts)   # each sorted row's padded position
            is_pad = np.ones(runs[1] * width, dtype=bool)
            is_pad[at] = False
            pad = np.zeros(runs[1] * width, dtype=np.int64)
            pad[at] = order
            pad_rows = np.flatnonzero(is_pad)
            order, bounds = empty, np.zeros(num_slots + 1, dtype=np.int64)
        return cls(_flat(order, device), _flat(bounds, device), _flat(pad, device), _flat(pad_rows, device),
                   _flat(runs, device))

    @classmethod
    def for_step(cls, slot_of_token: np.ndarray, num_slots: int, dtype: torch.dtype,
                 device: torch.device, at: torch.device | None = None) -> "LoraBatch":
        """The layout a step of a model in `dtype` on `device` runs: segmented where the C++ kernel
        applies the adapters (it takes no other), else padded where the runs are even enough. `at`:
        where its tensors are made (default `device`)."""
        return cls.build(slot_of_token, num_slots, at or device, padded=not native_lora(dtype, device))

    def args(self) -> tuple[torch.Tensor, ...]:
        return self.token_index, self.bounds, self.pad_index, self.pad_rows, self.runs


def _flat(values, device: torch.device) -> torch.Tensor:
    """A 1-D int64 tensor of stride 1, even when empty (torch gives an empty one stride 0, which
    would fail the compiled graph's stride guard)."""
    t = torch.tensor(values, dtype=torch.int64, device=device)
    return t.as_strided((len(t),), (1,))


@torch.library.custom_op("kaiten::lora_add_", mutates_args=("y",))
def lora_add_(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, splits: list[int],
              token_index: torch.Tensor, bounds: torch.Tensor, pad_index: torch.Tensor, pad_rows: torch.Tensor,
              runs: torch.Tensor) -> None:
    """y += x a_s b_s for each adapter token's slot s (LoraBatch says which, in either layout).
    a [S, in, parts * R], b [S, R, out]: part i of the fused output (its `splits[i]` columns of y
    and b) takes rank columns i*R..(i+1)*R of x a_s."""
    rank = a.shape[-1] // len(splits)
    if pad_index.numel():
        first, k = runs.tolist()
        h = torch.bmm(x.index_select(0, pad_index).view(k, -1, x.shape[1]), a[first:first + k])  # [K, L, parts*R]
        h.view(-1, h.shape[-1]).index_fill_(0, pad_rows, 0)
        out = torch.cat([torch.bmm(h[..., i * rank:(i + 1) * rank], b[first:first + k, :, start:start + width])
                         for i, start, width in _parts(splits)], dim=-1)
        y.index_add_(0, pad_index, out.view(-1, out.shape[-1]))
        return
    if not token_index.numel():
        return
    edges = bounds.tolist()
    rows = x.index_select(0, token_index)
    out = y.new_empty((rows.shape[0], y.shape[1]))
    for s in range(len(edges) - 1):
        lo, hi = edges[s], edges[s + 1]
        if hi > lo:
            h = rows[lo:hi] @ a[s]
            for i, start, width in _parts(splits):
                torch.mm(h[:, i * rank:(i + 1) * rank], b[s, :, start:start + width], out=out[lo:hi, start:start + width])
    y.index_add_(0, token_index, out)


@lora_add_.register_fake
def _lora_add_fake(y, x, a, b, splits, token_index, bounds, pad_index, pad_rows, runs):
    return None


def _parts(splits: list[int]):
    """(part, first output column, width) of each part of a fused projection."""
    start = 0
    for i, width in enumerate(splits):
        yield i, start, width
        start += width


def native_lora(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether the C++ kernel kaiten_cpu::lora_add_ (kernels/csrc/lora_cpu.cpp) applies the
    adapters: fp32 on the CPU, with the extension loaded. It takes the segmented layout only."""
    return device.type == "cpu" and dtype == torch.float32 and cpu_ops_loaded()


class LoraStack(nn.Module):
    """The slots of one fused projection."""

    def __init__(self, num_slots: int, fan_in: int, splits: list[int], rank: int, dtype: torch.dtype,
                 device: torch.device):
        super().__init__()
        self.splits = list(splits)
        self.register_buffer("a", torch.zeros(num_slots, fan_in, len(splits) * rank, dtype=dtype, device=device))
        self.register_buffer("b", torch.zeros(num_slots, rank, sum(splits), dtype=dtype, device=device))

    def forward(self, x: torch.Tensor, y: torch.Tensor, lora: LoraBatch) -> torch.Tensor:
        """y (the base projection of x), each adapter token's LoRA term added in place."""
        if native_lora(self.a.dtype, self.a.device):
            torch.ops.kaiten_cpu.lora_add_(y, x, self.a, self.b, self.splits, lora.token_index, lora.bounds)
        else:
            lora_add_(y, x, self.a, self.b, self.splits, *lora.args())
        return y

    @torch.no_grad()
    def write(self, slot: int, a: torch.Tensor | None, b: torch.Tensor | None) -> None:
        """Put an adapter's pair in `slot`, or zeros (None)."""
        if a is None:
            self.a[slot].zero_()
            self.b[slot].zero_()
        else:
            self.a[slot].copy_(a)
            self.b[slot].copy_(b)
