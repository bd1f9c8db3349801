"""The memory layout kaiten_cpu::quant_linear reads (kernels/csrc/quant_linear_cpu.cpp): a packed
weight's rows in tiles of TILE_ROWS, each tile one run of bytes, read front to back:

    scales [G][TILE_ROWS] | mins [G][TILE_ROWS] (where there are mins) | integers [G][TILE_ROWS][bytes]

for the G groups of a row; bytes is 16 for an int4 group of 32, the group size for int8, and 20
for the 5-bit groups of 32 that int8 weights take where their values fit 5 bits (Q5_0's -16..15
without mins, Q5_1's and Q5_K's 0..31 with them): 16 bytes of low nibbles as int4 stores them, then
the 32 fifth bits (bit j of the 4 little-endian bytes: element j); without mins the value is the 5
bits less 16. So Q5_0 stays 5.5 bits a weight resident, not int8's 8.5. Scales and mins are fp16
where that is exact (Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0 store them so), else fp32 (the K-quants'
products of two scales), so the layout is lossless. The last tile is padded with zero rows.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from shared.gguf_quant import PackedWeight

TILE_ROWS = 4


@dataclass(frozen=True, slots=True)
class TileFormat:
    n: int                 # rows (output features)
    k: int                 # inputs
    bits: int              # 4, 5 or 8
    group: int             # inputs a scale
    has_mins: bool
    scale_dtype: torch.dtype

    @property
    def groups(self) -> int:
        return self.k // self.group

    @property
    def int_bytes(self) -> int:
        """Bytes of one row's group of integers."""
        return self.group * self.bits // 8

    @property
    def offset(self) -> int:
        """What the 5-bit layout's values are less (16 without mins), else 0."""
        return 16 if self.bits == 5 and not self.has_mins else 0


def _exact_in_fp16(a: np.ndarray) -> bool:
    with np.errstate(over="ignore"):
        return bool(np.array_equal(a.astype(np.float16).astype(np.float32), a))


def _bits(p: PackedWeight, five_bit: bool) -> int:
    if p.kind == "int4":
        return 4
    if p.group != 32 or not five_bit:
        return 8
    low, high = (0, 31) if p.mins is not None else (-16, 15)
    return 5 if low <= int(p.qweight.min()) and int(p.qweight.max()) <= high else 8


def _five_bit_ints(q: np.ndarray, offset: int, tiles: int) -> np.ndarray:
    """int8 values [N, K] (N padded to whole tiles) as the 5-bit layout's bytes, [tiles, G * 80]:
    per group the 4 rows' nibbles, then each pair of rows' fifth bits in the 8 bytes the kernel
    shifts by qword (kernels/csrc/quant/tiles.h, Ints5)."""
    u = (q.astype(np.int16) + offset).astype(np.uint8).reshape(tiles, TILE_ROWS, -1, 32).swapaxes(1, 2)
    nibbles = (u[..., :16] & 0x0F) | ((u[..., 16:] & 0x0F) << 4)            # [tiles, G, 4, 16]
    # a pair's elements as its vectors hold them: qword Q = 2 * (row of the pair) + element // 8
    f = (u >> 4).reshape(*u.shape[:2], 2, 2, 2, 16).swapaxes(-2, -3)        # [t, G, pair, half, row, 16]
    f = f.reshape(*u.shape[:2], 2, 2, 4, 8)                                   # [t, G, pair, half, Q, k]
    shift = np.arange(4, dtype=np.uint8)[:, None]
    fifth = ((f[:, :, :, 0] << (4 + shift)) | (f[:, :, :, 1] << shift)).astype(np.uint8)
    fifth = np.bitwise_or.reduce(fifth, axis=-2)                              # [t, G, pair, 8]
    return np.concatenate([nibbles.reshape(*u.shape[:2], 64), fifth.reshape(*u.shape[:2], 16)], axis=-1).reshape(tiles, -1)


def _five_bit_values(q: torch.Tensor, lane: torch.Tensor, offset: int) -> torch.Tensor:
    """The 5-bit layout's groups [rows, G, 80] read at each row's lane: values [rows, G, 32]."""
    e = torch.arange(16, device=q.device)
    nib = q.gather(-1, (16 * lane[:, None] + e).expand(q.shape[1], -1, -1).transpose(0, 1))
    v = q.gather(-1, (64 + 8 * (lane[:, None] // 2) + e % 8).expand(q.shape[1], -1, -1).transpose(0, 1))
    shift = (2 * (lane[:, None] % 2) + e // 8)[:, None, :].to(torch.uint8)      # the element's qword
    low = (nib & 0x0F) | (((v >> (4 + shift)) & 1) << 4)
    high = (nib >> 4) | (((v >> shift) & 1) << 4)
    return torch.cat([low, high], dim=-1).short() - offset


def to_tiles(p: PackedWeight, five_bit: bool = True) -> tuple[np.ndarray, TileFormat]:
    """p's bytes as tiles, uint8 [ceil(N / TILE_ROWS), tile bytes], and their format. five_bit=False:
    int8 tiles even where the values fit 5 bits (the layout before it, for A/B benchmarks)."""
    n, k = p.shape
    half = _exact_in_fp16(p.scales) and (p.mins is None or _exact_in_fp16(p.mins))
    fmt = TileFormat(n, k, _bits(p, five_bit), p.group, p.mins is not None, torch.float16 if half else torch.float32)
    tiles, pad = -(-n // TILE_ROWS), -n % TILE_ROWS

    def tiled(a: np.ndarray) -> np.ndarray:      # [N, G, ...] -> [tiles, G, TILE_ROWS, ...] as bytes
        a = np.concatenate([a, np.zeros((pad, *a.shape[1:]), a.dtype)]) if pad else a
        a = a.reshape(tiles, TILE_ROWS, *a.shape[1:]).swapaxes(1, 2)
        return np.ascontiguousarray(a).view(np.uint8).reshape(tiles, -1)

    sdt = np.float16 if half else np.float32
    parts = [tiled(p.scales.astype(sdt))]
    if p.mins is not None:
        parts.append(tiled(p.mins.astype(sdt)))
    if fmt.bits == 5:
        q = np.concatenate([p.qweight, np.full((pad, k), -fmt.offset, np.int8)]) if pad else p.qweight
        parts.append(_five_bit_ints(q, fmt.offset, tiles))
    else:
        parts.append(tiled(p.qweight.view(np.uint8).reshape(n, fmt.groups, fmt.int_bytes)))
    return np.concatenate(parts, axis=1), fmt


def dequantize(tiles: torch.Tensor, fmt: TileFormat, rows: torch.Tensor | None = None) -> torch.Tensor:
    """The weight's `rows` (default all) in fp32 [len(rows), K], computed as gguf's dequantizer
    does (one rounding after an exact product, then the min added)."""
    rows = torch.arange(fmt.n) if rows is None else rows
    tiles = tiles[rows // TILE_ROWS]       # each row's tile, gathered first: a lookup reads only those
    each, lane = torch.arange(len(rows), device=rows.device), rows % TILE_ROWS
    count = fmt.groups * TILE_ROWS * fmt.scale_dtype.itemsize

    def scale_part(i: int) -> torch.Tensor:      # [len(rows), G]
        return tiles[:, i * count:(i + 1) * count].view(fmt.scale_dtype).view(-1, fmt.groups, TILE_ROWS)[each, :, lane]

    start = count * (2 if fmt.has_mins else 1)
    if fmt.bits == 5:
        q = _five_bit_values(tiles[:, start:].view(-1, fmt.groups, TILE_ROWS * fmt.int_bytes), lane, fmt.offset)
    else:
        q = tiles[:, start:].view(-1, fmt.groups, TILE_ROWS, fmt.int_bytes)[each, :, lane]
    if fmt.bits == 4:
        q = torch.cat([q & 0x0F, q >> 4], dim=-1)
    elif fmt.bits == 8:
        q = q.view(torch.int8)
    w = q.float() * scale_part(0).float()[..., None]
    if fmt.has_mins:
        w = w + scale_part(1).float()[..., None]
    return w.flatten(-2)
