"""A loaded model cut to one tensor-parallel rank's share, as Megatron-LM and vLLM split one.

Column-parallel (output rows split): each rank's attention heads of qkv_proj (its q heads, and the
KV heads they read: split where there are at least as many as ranks, else the one a rank's q
heads share, replicated) and its slice of gate_up_proj's gate and up. Row-parallel (input columns
split): o_proj and down_proj take the matching columns, each rank's output is a partial sum, and
ParallelAttention / ParallelGatedMLP add them over the ranks with one all-reduce each
(kaiten_cpu::shm_all_reduce_), after the LoRA term, so a row-parallel adapter sums too. A
row-parallel bias is added by rank 0 alone. Norms, embeddings and the output layer stay whole on
every rank: the hidden states after each all-reduce are the same bits on every rank, and rank 0
computes the logits from its own.

Dense (fp32, bf16-stored) weights are sliced by rows or columns; quantized tiles
(quant_tiles.py) by whole tiles of rows and whole groups of inputs, without dequantizing.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from engine_worker.model.bf16_layers import Bf16Linear
from engine_worker.model.config import ModelConfig
from engine_worker.model.layers.attention import Attention
from engine_worker.model.layers.mlp import GatedMLP
from engine_worker.model.quant_layers import QuantLinear
from engine_worker.model.quant_tiles import TILE_ROWS


@dataclass(frozen=True, slots=True)
class TPRank:
    """One rank of a tensor-parallel model: `handle` names its all-reduce communicator
    (tp_comm.ShmComm) in this process."""
    rank: int
    world: int
    handle: int


@dataclass(frozen=True, slots=True)
class HeadSplit:
    """Rank `rank`'s attention heads: q heads [q_first, q_first + q_heads), KV heads
    [kv_first, kv_first + kv_heads)."""
    q_first: int
    q_heads: int
    kv_first: int
    kv_heads: int


def head_split(num_heads: int, num_kv_heads: int, rank: int, world: int) -> HeadSplit:
    q = num_heads // world
    if num_kv_heads >= world:
        kv = num_kv_heads // world
        return HeadSplit(rank * q, q, rank * kv, kv)
    return HeadSplit(rank * q, q, rank * num_kv_heads // world, 1)   # replicated: world / kv ranks a head


def check_splittable(cfg: ModelConfig, world: int) -> None:
    """ValueError, in one line, where `cfg`'s model cannot be cut into `world` ranks."""
    flag = f"--tensor-parallel-size {world}"
    if cfg.num_heads % world:
        raise ValueError(f"{flag}: the model's {cfg.num_heads} attention heads do not split into {world} ranks")
    kv = cfg.num_kv_heads
    if (kv >= world and kv % world) or (kv < world and world % kv):
        raise ValueError(f"{flag}: the model's {kv} KV heads neither split into {world} ranks nor replicate "
                         f"evenly over them")
    if cfg.intermediate_size % world:
        raise ValueError(f"{flag}: the model's MLP width {cfg.intermediate_size} does not split into {world} ranks")


def kv_heads_of_rank(cfg: ModelConfig, world: int) -> int:
    return head_split(cfg.num_heads, cfg.num_kv_heads, 0, world).kv_heads


class ParallelAttention(Attention):
    """Attention over the rank's heads; its output summed over the ranks."""
    tp_handle: int

    def forward(self, x, rope, kv_cache, meta, backend, lora=None):
        out = super().forward(x, rope, kv_cache, meta, backend, lora)
        torch.ops.kaiten_cpu.shm_all_reduce_(out, self.tp_handle)
        return out


class ParallelGatedMLP(GatedMLP):
    """The MLP over the rank's slice of the intermediate features; its output summed over the ranks."""
    tp_handle: int

    def forward(self, x, lora=None):
        out = super().forward(x, lora)
        torch.ops.kaiten_cpu.shm_all_reduce_(out, self.tp_handle)
        return out


PARALLEL = {Attention: ParallelAttention, GatedMLP: ParallelGatedMLP}


@torch.no_grad()
def shard_model(model: nn.Module, tp: TPRank) -> None:
    """Cut every decoder layer of a loaded model (before pack_for_cpu) to rank `tp.rank`'s share."""
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        for module in (attn, mlp):
            if type(module) not in PARALLEL:
                raise ValueError(f"tensor parallelism does not know how to split {type(module).__name__}")
        _shard_attention(attn, tp)
        _shard_mlp(mlp, tp)
        for module in (attn, mlp):
            module.__class__ = PARALLEL[type(module)]
            module.tp_handle = tp.handle


def _shard_attention(attn: Attention, tp: TPRank) -> None:
    s, hd = head_split(attn.num_heads, attn.num_kv_heads, tp.rank, tp.world), attn.head_dim
    q_rows = np.arange(s.q_first * hd, (s.q_first + s.q_heads) * hd)
    kv_rows = np.arange(s.kv_first * hd, (s.kv_first + s.kv_heads) * hd)
    rows = np.concatenate([q_rows, attn.q_size + kv_rows, attn.q_size + attn.kv_size + kv_rows])
    attn.qkv_proj = take_rows(attn.qkv_proj, rows)
    attn.o_proj = take_columns(attn.o_proj, q_rows[0], len(q_rows), keep_bias=tp.rank == 0)
    attn.num_heads, attn.num_kv_heads = s.q_heads, s.kv_heads
    attn.q_size, attn.kv_size = s.q_heads * hd, s.kv_heads * hd


def _shard_mlp(mlp: GatedMLP, tp: TPRank) -> None:
    width = _out_features(mlp.gate_up_proj) // 2
    share = width // tp.world
    cols = np.arange(tp.rank * share, (tp.rank + 1) * share)
    mlp.gate_up_proj = take_rows(mlp.gate_up_proj, np.concatenate([cols, width + cols]))
    mlp.down_proj = take_columns(mlp.down_proj, cols[0], share, keep_bias=tp.rank == 0)


def _out_features(linear: nn.Module) -> int:
    return linear.fmt.n if isinstance(linear, QuantLinear) else linear.weight.shape[0]


def take_rows(linear: nn.Module, rows: np.ndarray) -> nn.Module:
    """`linear` computing only the output features `rows` (column-parallel)."""
    index = torch.from_numpy(rows)
    if isinstance(linear, QuantLinear):
        _quant_rows(linear, rows)
    elif isinstance(linear, (nn.Linear, Bf16Linear)):
        linear.weight = nn.Parameter(linear.weight[index].contiguous(), requires_grad=False)
        if isinstance(linear, nn.Linear):
            linear.out_features = len(rows)
    else:
        raise ValueError(f"tensor parallelism cannot split a {type(linear).__name__}")
    if linear.bias is not None:
        linear.bias = nn.Parameter(linear.bias[index].contiguous(), requires_grad=False)
    return linear


def take_columns(linear: nn.Module, first: int, count: int, keep_bias: bool) -> nn.Module:
    """`linear` over the input features [first, first + count) only (row-parallel): a partial sum,
    its bias kept on one rank only (`keep_bias`)."""
    if isinstance(linear, QuantLinear):
        _quant_columns(linear, first, count)
    elif isinstance(linear, (nn.Linear, Bf16Linear)):
        linear.weight = nn.Parameter(linear.weight[:, first:first + count].contiguous(), requires_grad=False)
        if isinstance(linear, nn.Linear):
            linear.in_features = count
    else:
        raise ValueError(f"tensor parallelism cannot split a {type(linear).__name__}")
    if not keep_bias:
        linear.bias = None
    return linear


def _quant_rows(linear: QuantLinear, rows: np.ndarray) -> None:
    """Whole tiles of TILE_ROWS rows: each run of the selection must start and end on a tile."""
    runs = rows.reshape(-1, TILE_ROWS) if len(rows) % TILE_ROWS == 0 else None
    if (runs is None or np.any(runs[:, 0] % TILE_ROWS) or np.any(np.diff(runs, axis=1) != 1)
            or runs[-1, -1] >= linear.fmt.n):
        raise ValueError(f"tensor parallelism: a quantized projection of {linear.fmt.n} rows does not split "
                         f"along whole tiles of {TILE_ROWS} rows")
    linear.tiles = linear.tiles[torch.from_numpy(runs[:, 0] // TILE_ROWS)].contiguous()
    _set_format(linear, dataclasses.replace(linear.fmt, n=len(rows)))


def _quant_columns(linear: QuantLinear, first: int, count: int) -> None:
    """Whole groups of inputs: each part of a tile (scales, mins, integers) is [G][TILE_ROWS][...]."""
    f = linear.fmt
    if first % f.group or count % f.group:
        raise ValueError(f"tensor parallelism: a quantized projection with groups of {f.group} inputs does not "
                         f"split at input {first}")
    g0, g1 = first // f.group, (first + count) // f.group
    tiles, scale_bytes = linear.tiles, f.groups * TILE_ROWS * f.scale_dtype.itemsize
    parts = [scale_bytes] * (2 if f.has_mins else 1)
    parts.append(tiles.shape[1] - sum(parts))
    pieces, start = [], 0
    for size in parts:
        part = tiles[:, start:start + size].reshape(tiles.shape[0], f.groups, -1)
        pieces.append(part[:, g0:g1].reshape(tiles.shape[0], -1))
        start += size
    linear.tiles = torch.cat(pieces, dim=1).contiguous()
    _set_format(linear, dataclasses.replace(f, k=count))


def _set_format(linear: QuantLinear, fmt) -> None:
    linear.fmt = fmt
    linear.op_args = (fmt.n, fmt.k, fmt.bits, fmt.group, fmt.has_mins)
