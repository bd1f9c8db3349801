"""The chained hash of a full KV-cache block: ONE function for the engine's prefix cache and the
gateways' cache-aware routing, so both name a block the same way in every process.

A block's hash covers its parent's hash and its token ids, so equal hashes mean equal prefixes.
It is a 64-bit BLAKE2b digest (not Python's ``hash()``, which is salted per process for strings and
differs between builds), returned as a non-negative int.
"""
from __future__ import annotations

from array import array
from hashlib import blake2b
from typing import Sequence

ROOT = 0            # the parent hash of a sequence's first block


def block_hash(parent_hash: int, token_ids: Sequence[int]) -> int:
    h = blake2b(parent_hash.to_bytes(8, "little"), digest_size=8)
    h.update(array("q", token_ids).tobytes())
    return int.from_bytes(h.digest(), "little")


def prefix_block_hashes(token_ids: Sequence[int], block_size: int, max_blocks: int | None = None) -> list[int]:
    """The chained hashes of the full blocks of ``token_ids`` (at most ``max_blocks``)."""
    n = len(token_ids) // block_size
    if max_blocks is not None:
        n = min(n, max_blocks)
    hashes, parent = [], ROOT
    for i in range(n):
        parent = block_hash(parent, token_ids[i * block_size:(i + 1) * block_size])
        hashes.append(parent)
    return hashes
