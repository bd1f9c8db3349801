"""A stored KV chunk's value: a header that names it, a CRC32, then the KV bytes of its blocks.

    magic "KVC1" | layout id (16 B) | blocks (u16) | payload bytes (u64) | crc32 (u32)
    | each block's chained hash (u64) | each block's token ids (i32) | payload

The payload is every block's K and V of every layer (``KVLayout.block_shape`` per block, blocks
in order). The CRC covers the hashes, the token ids and the payload. ``decode`` accepts a value
only when its layout, hashes and token ids are the ones asked for and the CRC and lengths agree:
anything else (another model or dtype, a partial write, a flipped bit) is a miss.
"""
from __future__ import annotations

import struct
import zlib
from array import array
from typing import Sequence

import numpy as np
import torch

from engine_worker.engine.kv_layout import KVLayout

MAGIC = b"KVC1"
_HEAD = struct.Struct("<4s16sHQI")


def _meta(block_hashes: Sequence[int], token_ids: Sequence[int]) -> bytes:
    return array("Q", block_hashes).tobytes() + array("i", token_ids).tobytes()


def encode(layout: KVLayout, block_hashes: Sequence[int], token_ids: Sequence[int], payload) -> bytes:
    """The value for a chunk; `payload` is a bytes-like object of its blocks' KV."""
    meta = _meta(block_hashes, token_ids)
    view = memoryview(payload).cast("B")
    crc = zlib.crc32(view, zlib.crc32(meta))
    head = _HEAD.pack(MAGIC, layout.layout_id, len(block_hashes), view.nbytes, crc)
    return b"".join((head, meta, view))


def decode(layout: KVLayout, block_hashes: Sequence[int], token_ids: Sequence[int], value: bytes | None,
           out: torch.Tensor) -> bool:
    """Copy the chunk's KV into `out` (a contiguous (blocks, *block_shape) tensor); False, leaving
    `out` as it was, where `value` is not exactly the chunk asked for."""
    if value is None or len(value) < _HEAD.size:
        return False
    magic, layout_id, n, size, crc = _HEAD.unpack_from(value)
    meta = _meta(block_hashes, token_ids)
    if magic != MAGIC or layout_id != layout.layout_id or n != len(block_hashes):
        return False
    if size != n * layout.block_bytes or len(value) != _HEAD.size + len(meta) + size or out.nbytes != size:
        return False
    body = memoryview(value)[_HEAD.size:]
    if body[:len(meta)] != meta or zlib.crc32(body[len(meta):], zlib.crc32(meta)) != crc:
        return False
    out.view(-1).view(torch.uint8).numpy()[:] = np.frombuffer(body[len(meta):], dtype=np.uint8)
    return True
