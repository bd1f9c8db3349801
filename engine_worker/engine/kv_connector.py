"""The engine's view of a KV store shared with other engines: find and read stored chunks of a
prompt, write full chunks. The core knows nothing of where they are kept
(engine_worker/kv_store/ implements it on Redis).

A connector works off the step loop: ``fetch`` and ``save`` only queue work and return at once;
a fetch's result comes back through ``done()``. Every chunk a connector returns has been checked
(engine_worker/engine/kv_chunk.py): a missing, partial, stale or corrupt one ends the fetch there,
and the engine computes the rest.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch


@dataclass(slots=True, frozen=True)
class ChunkRef:
    """One chunk of a sequence: its blocks' chained hashes (the last one names it) and token ids."""
    block_hashes: tuple[int, ...]
    token_ids: tuple[int, ...]


@dataclass(slots=True)
class FetchRequest:
    ticket: int                      # the engine's number for this fetch
    adapter: str                     # the LoRA adapter ("": the base model)
    first_block: int                 # the block index where chunks[0] starts
    chunks: list[ChunkRef]


@dataclass(slots=True)
class FetchResult:
    ticket: int
    first_block: int
    num_chunks: int                  # the leading chunks stored intact
    kv: torch.Tensor                 # their blocks' KV: (blocks, *KVLayout.block_shape()), contiguous
    seconds: float                   # from the fetch's start to its last chunk checked


@dataclass(slots=True)
class SaveChunk:
    adapter: str
    chunk: ChunkRef
    payload: torch.Tensor            # (blocks, *KVLayout.block_shape()) on the CPU, contiguous


@dataclass(slots=True)
class KVConnectorStats:
    """Cumulative counts since the connector started."""
    fetches: int = 0
    hit_chunks: int = 0              # chunks read and accepted
    miss_chunks: int = 0             # fetches that ended before their last chunk (one per fetch)
    invalid_chunks: int = 0          # values present but refused: corrupt, partial, another layout
    bytes_loaded: int = 0
    load_seconds: float = 0.0
    saved_chunks: int = 0
    bytes_stored: int = 0
    store_seconds: float = 0.0
    dropped_writes: int = 0          # saves refused because the queue was full
    errors: int = 0                  # store errors (each one a miss or a lost write)


class KVConnector(ABC):
    @abstractmethod
    def fetch(self, request: FetchRequest) -> None:
        """Read the chunks in order, up to the first that is not stored intact (non-blocking)."""

    @abstractmethod
    def done(self) -> list[FetchResult]:
        """The fetches finished since the last call."""

    @abstractmethod
    def wait(self, timeout: float) -> None:
        """Return when a fetch finishes, or after `timeout` seconds."""

    @abstractmethod
    def has_room(self) -> bool:
        """Whether a save now would be queued rather than dropped."""

    @abstractmethod
    def save(self, chunk: SaveChunk) -> bool:
        """Queue a write (non-blocking); False: dropped, the queue being full."""

    @abstractmethod
    def stats(self) -> KVConnectorStats:
        ...

    @abstractmethod
    def close(self) -> None:
        ...
