"""The chained hash of a full KV-cache block: ONE function for the engine's prefix cache and the
gateways' cache-aware routing, so both name a block the same way in every process.

A block's hash covers its parent's hash and its token ids, so equal hashes mean equal prefixes.
It is a 64-bit BLAKE2b digest (not Python's ``hash()``, which is salted per process for strings and
differs between builds), returned as a non-negative int.

A sequence run through a LoRA adapter chains from that adapter's root (``root_hash``), so the KV
blocks of two adapters, or of an adapter and the base model, never share a hash.
"""
from __future__ import annotations

from array import array
from hashlib import blake2b
from typing import Sequence

ROOT = 0            # the parent hash of a base-model sequence's first block


def root_hash(lora_name: str = "") -> int:
    """The parent hash of a sequence's first block: ROOT for the base model, else the adapter's."""
    if not lora_name:
        return ROOT
    return int.from_bytes(blake2b(b"lora:" + lora_name.encode(), digest_size=8).digest(), "little")


def block_hash(parent_hash: int, token_ids: Sequence[int]) -> int:
    h = blake2b(parent_hash.to_bytes(8, "little"), digest_size=8)
    h.update(array("q", token_ids).tobytes())
    return int.from_bytes(h.digest(), "little")


def prefix_block_hashes(token_ids: Sequence[int], block_size: int, max_blocks: int | None = None,
                        lora_name: str = "") -> list[int]:
    """The chained hashes of the full blocks of ``token_ids`` (at most ``max_blocks``), run
    through the adapter ``lora_name`` ("" for the base model)."""
    n = len(token_ids) // block_size
    if max_blocks is not None:
        n = min(n, max_blocks)
    hashes, parent = [], root_hash(lora_name)
    for i in range(n):
        parent = block_hash(parent, token_ids[i * block_size:(i + 1) * block_size])
        hashes.append(parent)
    return hashes
