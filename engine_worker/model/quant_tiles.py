"""The memory layout kaiten_cpu::quant_linear reads (kernels/csrc/quant_linear_cpu.cpp): a packed
weight's rows in tiles of TILE_ROWS, each tile one run of bytes, read front to back:

    scales [G][TILE_ROWS] | mins [G][TILE_ROWS] (where there are mins) | integers [G][TILE_ROWS][bytes]

for the G groups of a row; bytes is 16 for an int4 group of 32, the group size for int8. Scales
and mins are fp16 where that is exact (Q4_0, Q4_1 and Q8_0 store them so), else fp32 (the K-quants'
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
    bits: int              # 4 or 8
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


def _exact_in_fp16(a: np.ndarray) -> bool:
    with np.errstate(over="ignore"):
        return bool(np.array_equal(a.astype(np.float16).astype(np.float32), a))


def to_tiles(p: PackedWeight) -> tuple[np.ndarray, TileFormat]:
    """p's bytes as tiles, uint8 [ceil(N / TILE_ROWS), tile bytes], and their format."""
    n, k = p.shape
    half = _exact_in_fp16(p.scales) and (p.mins is None or _exact_in_fp16(p.mins))
    fmt = TileFormat(n, k, 4 if p.kind == "int4" else 8, p.group, p.mins is not None,
                     torch.float16 if half else torch.float32)
    tiles, pad = -(-n // TILE_ROWS), -n % TILE_ROWS

    def tiled(a: np.ndarray) -> np.ndarray:      # [N, G, ...] -> [tiles, G, TILE_ROWS, ...] as bytes
        a = np.concatenate([a, np.zeros((pad, *a.shape[1:]), a.dtype)]) if pad else a
        a = a.reshape(tiles, TILE_ROWS, *a.shape[1:]).swapaxes(1, 2)
        return np.ascontiguousarray(a).view(np.uint8).reshape(tiles, -1)

    sdt = np.float16 if half else np.float32
    parts = [tiled(p.scales.astype(sdt))]
    if p.mins is not None:
        parts.append(tiled(p.mins.astype(sdt)))
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
    q = tiles[:, start:].view(-1, fmt.groups, TILE_ROWS, fmt.int_bytes)[each, :, lane]
    q = torch.cat([q & 0x0F, q >> 4], dim=-1) if fmt.bits == 4 else q.view(torch.int8)
    w = q.float() * scale_part(0).float()[..., None]
    if fmt.has_mins:
        w = w + scale_part(1).float()[..., None]
    return w.flatten(-2)
