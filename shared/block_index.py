"""The wire form of an engine's prefix-cache contents: which ``shared.block_hash`` hashes it holds.

An engine's heartbeat thread writes it to ``names.blocks_key`` when it changes (at most once per
heartbeat interval); gateways read it when the heartbeat's ``blocks_version`` moves. Packed
little-endian uint64s, the version first: 8 bytes per cached block, so bounded by the KV pool
(SmolLM2-135M's 1 GiB bf16 pool: about 2,900 blocks, 23 KB).
"""
from __future__ import annotations

import sys
from array import array


def pack_blocks(version: int, hashes: list[int]) -> bytes:
    a = array("Q", [version])
    a.extend(hashes)
    if sys.byteorder != "little":
        a.byteswap()
    return a.tobytes()


def unpack_blocks(data: bytes) -> tuple[int, frozenset[int]]:
    """(version, hashes); raises ValueError on a malformed value."""
    if not data or len(data) % 8:
        raise ValueError(f"a block list must be a non-empty multiple of 8 bytes, got {len(data or b'')}")
    a = array("Q")
    a.frombytes(data)
    if sys.byteorder != "little":
        a.byteswap()
    return a[0], frozenset(a[1:])
