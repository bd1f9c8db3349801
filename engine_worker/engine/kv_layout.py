"""What a stored KV chunk holds and whose it is: the model's identity, the KV geometry and dtype,
the block size, the chunk's length in blocks and the value format's version. Two engines share
chunks only where all of it is equal (``layout_id``).

A chunk is the fewest full blocks whose KV reaches CHUNK_MIN_BYTES: below it Redis moves bytes at a
fraction of its speed (bench/results/kv_store/README.md), and a smaller chunk is a finer hit.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from hashlib import blake2b

from engine_worker.model.fingerprint import model_fingerprint

LAYOUT_VERSION = 1
CHUNK_MIN_BYTES = 256 * 1024


def chunk_blocks_for(block_bytes: int, chunk_tokens: int, block_size: int) -> int:
    """Blocks in a chunk: `chunk_tokens` rounded up to whole blocks where given, else measured."""
    if chunk_tokens > 0:
        return -(-chunk_tokens // block_size)
    return max(1, -(-CHUNK_MIN_BYTES // block_bytes))


@dataclass(slots=True, frozen=True)
class KVLayout:
    model_id: str             # the weights' and config's fingerprint (engine_worker/model/fingerprint.py)
    kv_dtype: str             # "torch.bfloat16", ...
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    itemsize: int
    chunk_blocks: int
    version: int = LAYOUT_VERSION

    @classmethod
    def build(cls, model_id: str, kv_dtype, block_size: int, num_layers: int, num_kv_heads: int, head_dim: int,
              chunk_tokens: int = 0) -> KVLayout:
        """The layout of an engine's cache; `chunk_tokens` 0: the chunk measured best."""
        layout = cls(model_id, str(kv_dtype), block_size, num_layers, num_kv_heads, head_dim, kv_dtype.itemsize, 1)
        return dataclasses.replace(layout, chunk_blocks=chunk_blocks_for(layout.block_bytes, chunk_tokens,
                                                                         block_size))

    @property
    def layout_id(self) -> bytes:
        """16 bytes naming everything above: a chunk of another layout is never read as this one."""
        text = "|".join(str(v) for v in (self.model_id, self.kv_dtype, self.block_size, self.num_layers,
                                          self.num_kv_heads, self.head_dim, self.itemsize, self.chunk_blocks,
                                          self.version))
        return blake2b(text.encode(), digest_size=16).digest()

    @property
    def block_bytes(self) -> int:
        """K and V of every layer for one block."""
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * self.itemsize

    @property
    def chunk_tokens(self) -> int:
        return self.chunk_blocks * self.block_size

    def block_shape(self) -> tuple[int, ...]:
        """One block's KV as stored: layers, K/V, tokens, heads, head_dim."""
        return (self.num_layers, 2, self.block_size, self.num_kv_heads, self.head_dim)


class AdapterIds:
    """A LoRA adapter as the store names it: its name and its files' fingerprint, so an adapter
    changed under the same name never reads the old one's chunks. `path_of` gives a served
    adapter's directory."""

    def __init__(self, path_of: Callable[[str], str]):
        self.path_of = path_of
        self._ids: dict[str, str] = {}

    def __call__(self, name: str) -> str:
        if not name:
            return ""
        if name not in self._ids:
            self._ids[name] = f"{name}-{model_fingerprint(self.path_of(name))[:16]}"
        return self._ids[name]

    def forget(self, name: str) -> None:
        """The adapter was removed: a new one of that name is fingerprinted again."""
        self._ids.pop(name, None)
