"""A loaded model cut to one tensor-parallel rank's share, as Megatron-LM and vLLM split one.

Column-parallel (output rows split): each rank's attention heads of qkv_proj (its q heads, and the
KV heads they read: split where there are at least as many as ranks, else the one a rank's q
heads share, replicated) and its slice of gate_up_proj's gate and up. Row-parallel (input columns
split): o_proj and down_proj take the matching columns, each rank's output is a partial sum, and
ParallelAttention / ParallelGatedMLP add them over the ranks with one all-reduce each
(kaiten_cpu::shm_all_reduce_; DistParallelAttention / DistParallelGatedMLP through
torch.distributed, tp_dist.py), after the LoRA term, so a row-parallel adapter sums too. A
row-parallel bias is added by rank 0 alone. Norms and the embedding stay whole on every rank:
the hidden states after each all-reduce are the same bits on every rank.

The output layer (lm_head, or a copy of the tied embedding's rows) is split by vocabulary: each
rank computes the logits of its contiguous slice of it from the same hidden rows (rank 0 sends the
rows in each step, tp_comm.StepChannel), and rank 0 gathers the slices into the whole logits
(tp_comm.LogitsGather, tp_dist.DistLogitsGather). A logit is one row's dot product with one
weight row, so the split changes no bits: the int8 activation row's scale is over the hidden
size, which it does not cut.

Dense (fp32, bf16-stored) weights are sliced by rows or columns; quantized tiles
(quant_tiles.py) by whole tiles of rows and whole groups of inputs, without dequantizing.
"""
from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from engine_worker.model.bf16_layers import Bf16Linear
from engine_worker.model.config import ModelConfig
from engine_worker.model.layers.attention import Attention
from engine_worker.model.layers.mlp import GatedMLP
from engine_worker.model.quant_layers import QuantLinear
from engine_worker.model.quant_tiles import TILE_ROWS
from engine_worker.model.tp_comm import ShmComm
from engine_worker.model.tp_dist import DistComm

MLP_UNIT = 32       # the intermediate features split in runs of a quantization group


@dataclass(frozen=True, slots=True)
class TPRank:
    """One rank of a tensor-parallel model and its communicator: the all-reduce's and the logits
    gather's (tp_comm.ShmComm, shared memory, or tp_dist.DistComm, torch.distributed)."""
    rank: int
    world: int
    comm: ShmComm | DistComm


@dataclass(frozen=True, slots=True)
class HeadSplit:
    """Rank `rank`'s attention heads: q heads [q_first, q_first + q_heads), KV heads
    [kv_first, kv_first + kv_heads)."""
    q_first: int
    q_heads: int
    kv_first: int
    kv_heads: int


def head_split(num_heads: int, num_kv_heads: int, rank: int, world: int) -> HeadSplit:
    """Whole KV groups (a KV head and the q heads that read it) a rank, as evenly as they go: the
    attention kernel maps q head h to KV head h // (q heads / KV heads), so every rank's groups
    must be of one size. Fewer KV heads than ranks: world / KV heads ranks share each KV head (a
    copy each) and split its q heads as evenly as they go (SmolLM2's 9 heads in 3 groups over 2
    ranks: groups 0 and 1 on rank 0, 2 on rank 1)."""
    group = num_heads // num_kv_heads
    if num_kv_heads >= world:
        first, end = rank * num_kv_heads // world, (rank + 1) * num_kv_heads // world
        return HeadSplit(first * group, (end - first) * group, first, end - first)
    sharing = world // num_kv_heads
    kv, part = divmod(rank, sharing)
    q_first, q_end = kv * group + part * group // sharing, kv * group + (part + 1) * group // sharing
    return HeadSplit(q_first, q_end - q_first, kv, 1)


def mlp_split(width: int, hidden: int, head_dim: int, heads: list[HeadSplit], rank: int) -> tuple[int, int]:
    """(first, count) of the rank's intermediate features, in whole runs of MLP_UNIT where the
    width has them (quantized tiles split on groups of 32 inputs). Balanced with the attention:
    a rank with more heads (`heads`: every rank's) takes fewer features, so every rank holds
    about the same weights, which a decode step reads once (SmolLM2 over 2 ranks: 864 and 672
    of 1536, 1.77M weights a layer each, where 768 each would leave rank 1 with 9% more)."""
    unit = MLP_UNIT if width % MLP_UNIT == 0 else 1
    attn = [hidden * head_dim * 2 * (h.q_heads + h.kv_heads) for h in heads]
    share = (sum(attn) + 3 * hidden * width) / len(heads)
    wants = [max(0.0, share - a) for a in attn]
    edges, total = [0], 0.0
    for w in wants:
        total += w
        edges.append(round(total / sum(wants) * width / unit) * unit)
    return edges[rank], edges[rank + 1] - edges[rank]


def check_splittable(cfg: ModelConfig, world: int) -> None:
    """ValueError, in one line, where `cfg`'s model cannot be cut into `world` ranks."""
    flag = f"--tensor-parallel-size {world}"
    kv = cfg.num_kv_heads
    if kv < world and world % kv:
        raise ValueError(f"{flag}: the model's {kv} KV heads are fewer than the ranks and do not replicate "
                         f"evenly over them")
    if kv < world and cfg.num_heads // kv < world // kv:
        raise ValueError(f"{flag}: the model's {cfg.num_heads} attention heads are fewer than the ranks")
    if cfg.intermediate_size < world:
        raise ValueError(f"{flag}: the model's MLP width {cfg.intermediate_size} is less than the ranks")


def kv_heads_of_rank(cfg: ModelConfig, tp: TPRank) -> int:
    return head_split(cfg.num_heads, cfg.num_kv_heads, tp.rank, tp.world).kv_heads


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


class DistParallelAttention(Attention):
    """ParallelAttention through torch.distributed's default group (Dynamo traces the all-reduce
    as a functional collective in the compiled layers)."""

    def forward(self, x, rope, kv_cache, meta, backend, lora=None):
        out = super().forward(x, rope, kv_cache, meta, backend, lora)
        dist.all_reduce(out)
        return out


class DistParallelGatedMLP(GatedMLP):
    """ParallelGatedMLP through torch.distributed's default group."""

    def forward(self, x, lora=None):
        out = super().forward(x, lora)
        dist.all_reduce(out)
        return out


# each communicator's layers: a layer class keys its compiled graph (compiled_forward.graph_signature)
PARALLEL = {ShmComm: {Attention: ParallelAttention, GatedMLP: ParallelGatedMLP},
            DistComm: {Attention: DistParallelAttention, GatedMLP: DistParallelGatedMLP}}


@torch.no_grad()
def shard_model(model: nn.Module, tp: TPRank) -> None:
    """Cut every decoder layer of a loaded model (before pack_for_cpu) to rank `tp.rank`'s share."""
    parallel = PARALLEL[type(tp.comm)]
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        for module in (attn, mlp):
            if type(module) not in parallel:
                raise ValueError(f"tensor parallelism does not know how to split {type(module).__name__}")
        heads = [head_split(attn.num_heads, attn.num_kv_heads, r, tp.world) for r in range(tp.world)]
        hidden = attn.o_proj.fmt.n if isinstance(attn.o_proj, QuantLinear) else attn.o_proj.weight.shape[0]
        _shard_mlp(mlp, mlp_split(_out_features(mlp.gate_up_proj) // 2, hidden, attn.head_dim, heads, tp.rank), tp)
        _shard_attention(attn, tp)
        for module in (attn, mlp):
            module.__class__ = parallel[type(module)]
            if isinstance(tp.comm, ShmComm):
                module.tp_handle = tp.comm.handle
    _shard_output(model, tp)


def vocab_split(vocab: int, world: int) -> list[int]:
    """Each rank's first row of the output layer, then `vocab`: as even as whole quantized tiles go."""
    return [min(vocab, round(r * vocab / world / TILE_ROWS) * TILE_ROWS) for r in range(world)] + [vocab]


def _shard_output(model: nn.Module, tp: TPRank) -> None:
    """The output layer cut to the rank's rows of the vocabulary, its logits gathered to rank 0.
    A tied one becomes a layer of its own: the embedding's lookup needs every row."""
    edges = vocab_split(model.cfg.vocab_size, tp.world)
    first, end = edges[tp.rank], edges[tp.rank + 1]
    if model.lm_head is None:
        weight = model.embed_tokens.weight
        head = nn.Linear(weight.shape[1], end - first, bias=False, dtype=weight.dtype, device=weight.device)
        head.weight = nn.Parameter(weight[first:end].clone(), requires_grad=False)
    else:
        head = copy.deepcopy(model.lm_head) if model.cfg.tie_word_embeddings else model.lm_head
        head = take_rows(head, np.arange(first, end))
    model.lm_head = head
    model.logits_gather = tp.comm.logits_gather(edges)


def _shard_attention(attn: Attention, tp: TPRank) -> None:
    s, hd = head_split(attn.num_heads, attn.num_kv_heads, tp.rank, tp.world), attn.head_dim
    q_rows = np.arange(s.q_first * hd, (s.q_first + s.q_heads) * hd)
    kv_rows = np.arange(s.kv_first * hd, (s.kv_first + s.kv_heads) * hd)
    rows = np.concatenate([q_rows, attn.q_size + kv_rows, attn.q_size + attn.kv_size + kv_rows])
    attn.qkv_proj = take_rows(attn.qkv_proj, rows)
    attn.o_proj = take_columns(attn.o_proj, q_rows[0], len(q_rows), keep_bias=tp.rank == 0)
    attn.tp_lora_slices = {"qkv": ("rows", torch.from_numpy(rows)), "o": ("columns", int(q_rows[0]), len(q_rows))}
    attn.num_heads, attn.num_kv_heads = s.q_heads, s.kv_heads
    attn.q_size, attn.kv_size = s.q_heads * hd, s.kv_heads * hd


def _shard_mlp(mlp: GatedMLP, split: tuple[int, int], tp: TPRank) -> None:
    width = _out_features(mlp.gate_up_proj) // 2
    first, count = split
    cols = np.arange(first, first + count)
    rows = np.concatenate([cols, width + cols])
    mlp.gate_up_proj = take_rows(mlp.gate_up_proj, rows)
    mlp.down_proj = take_columns(mlp.down_proj, first, count, keep_bias=tp.rank == 0)
    mlp.tp_lora_slices = {"gate_up": ("rows", torch.from_numpy(rows)), "down": ("columns", first, count)}


def lora_shapes(model: nn.Module) -> dict[str, tuple[int, list[int]]]:
    """lora_layers.projection_shapes of the rank's share: (input features, each part's outputs)."""
    attn, mlp = model.layers[0].self_attn, model.layers[0].mlp
    hidden, share = model.cfg.hidden_size, mlp.tp_lora_slices["down"][2]
    return {"qkv": (hidden, [attn.q_size, attn.kv_size, attn.kv_size]), "o": (attn.q_size, [hidden]),
            "gate_up": (hidden, [share, share]), "down": (share, [hidden])}


def shard_lora(model: nn.Module, weights: dict | None) -> dict | None:
    """An adapter's {(layer, projection key): (A, B)} (lora_weights.py) cut as its base layers are:
    B's columns of a column-parallel projection, A's rows (its inputs) of a row-parallel one."""
    if weights is None:
        return None
    out = {}
    for (layer, key), (a, b) in weights.items():
        block = model.layers[layer]
        owner = block.self_attn if key in block.self_attn.tp_lora_slices else block.mlp
        how = owner.tp_lora_slices[key]
        if how[0] == "rows":
            out[layer, key] = (a, b[:, how[1]].contiguous())
        else:
            out[layer, key] = (a[how[1]:how[1] + how[2]].contiguous(), b)
    return out


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
    """Whole tiles of TILE_ROWS rows: each run of the selection must start and end on a tile, or
    end at the last row, in the last tile's padding."""
    n, tiles = linear.fmt.n, linear.tiles.shape[0]
    pad = -len(rows) % TILE_ROWS if len(rows) and rows[-1] == n - 1 else 0
    padded = np.concatenate([rows, np.arange(n, n + pad)])
    runs = padded.reshape(-1, TILE_ROWS) if len(padded) % TILE_ROWS == 0 else None
    if (runs is None or np.any(runs[:, 0] % TILE_ROWS) or np.any(np.diff(runs, axis=1) != 1)
            or runs[-1, -1] >= tiles * TILE_ROWS):
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
