"""Paged KV-cache blocks: allocation, reference counts and prefix-cache hashes. Nothing else.

A full block's hash chains from its parent's hash and its token ids (``shared.block_hash``, the
function gateways route with), so equal hashes mean equal prefixes (confirmed by comparing the
tokens). A freed block that holds a hash stays in the cache and is evicted least-recently-used when
a fresh block is needed. ``cache_version`` changes whenever the set of cached hashes does.
A sequence's chain starts at its LoRA adapter's root (``root_hash``), so adapters never share a
block; ``drop_root`` forgets an adapter's blocks when it is removed.

Where every layer of the model slides over a window of W keys (Mistral), a sequence holds only
the blocks its window can still read: once its next token's window starts past a block, the
block is released (it stays in the prefix cache if hashed) and its block-table entry becomes
NO_BLOCK, which the attention kernels never read (kernels/interface.py).
"""
from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field

from engine_worker.engine.sequence import Sequence
from shared.block_hash import block_hash, root_hash

NO_HASH = -1
NO_BLOCK = -1          # a block-table entry whose block fell out of every layer's window


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    hash: int = NO_HASH
    token_ids: list[int] = field(default_factory=list)   # kept to confirm prefix-cache hits
    root: int = NO_HASH                                  # the chain's root (its adapter's)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True, window: int = 0):
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.window = window            # keys every layer reads behind a query (0: all of them)
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_ids: deque[int] = deque(range(num_blocks))         # ref 0, no hash
        self.evictable: OrderedDict[int, None] = OrderedDict()       # ref 0, hashed; LRU first
        self.hash_to_block: dict[int, int] = {}
        self.num_queried_tokens = 0
        self.num_hit_tokens = 0
        self.cache_version = 0                                       # bumped when hash_to_block changes

    # ---- numbers -------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_ids) + len(self.evictable)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.num_hit_tokens / self.num_queried_tokens if self.num_queried_tokens else 0.0

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def most_blocks_held(self, num_tokens: int, chunk: int) -> int:
        """The most blocks a sequence of `num_tokens` holds at once, computed `chunk` tokens a step
        at most: all of them, or with a window, those of the window and a chunk."""
        if not self.window:
            return self.blocks_needed(num_tokens)
        return min(self.blocks_needed(num_tokens), self.blocks_needed(self.window - 1 + chunk) + 1)

    def _first_live_block(self, num_computed: int) -> int:
        """The first block the window of the query at position `num_computed` reads."""
        return max(0, num_computed - self.window + 1) // self.block_size if self.window else 0

    # ---- prefix cache ----------------------------------------------------------------------
    def find_cached_prefix(self, seq: Sequence) -> list[int]:
        """Block ids of the longest cached prefix of full blocks. It never covers the last token,
        so the forward pass always computes at least that token's logits."""
        if not self.enable_prefix_caching:
            return []
        hits, parent = [], root_hash(seq.lora_name)
        max_blocks = (seq.num_tokens - 1) // self.block_size
        for i in range(max_blocks):
            tokens = seq.token_ids[i * self.block_size:(i + 1) * self.block_size]
            h = block_hash(parent, tokens)
            block_id = self.hash_to_block.get(h)
            if block_id is None or self.blocks[block_id].token_ids != tokens:
                break
            hits.append(block_id)
            parent = h
        return hits

    def cached_hashes(self) -> list[int]:
        """Every block hash the cache holds now (in use or evictable)."""
        return list(self.hash_to_block)

    def record_prefix_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        self.num_queried_tokens += num_tokens
        self.num_hit_tokens += num_hit_tokens

    def computed(self, seq: Sequence) -> None:
        """After a step computed tokens of `seq`: cache its full blocks, then release those its
        window has passed."""
        self.cache_full_blocks(seq)
        for i in range(self._first_live_block(seq.num_computed_tokens)):
            if seq.block_table[i] != NO_BLOCK:
                self._release(seq.block_table[i])
                seq.block_table[i] = NO_BLOCK

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Hash the blocks that became full (and computed) since the last call."""
        if not self.enable_prefix_caching:
            return
        num_full = seq.num_computed_tokens // self.block_size
        if num_full <= len(seq.block_hashes):
            return
        root = root_hash(seq.lora_name)
        for i in range(len(seq.block_hashes), num_full):
            parent = seq.block_hashes[-1] if seq.block_hashes else root
            tokens = seq.token_ids[i * self.block_size:(i + 1) * self.block_size]
            h = block_hash(parent, tokens)
            seq.block_hashes.append(h)
            if seq.block_table[i] == NO_BLOCK:     # came from the prefix cache, left behind by the window
                continue
            block = self.blocks[seq.block_table[i]]
            if block.hash == NO_HASH and h not in self.hash_to_block:
                block.hash, block.token_ids, block.root = h, tokens, root
                self.hash_to_block[h] = block.block_id
                self.cache_version += 1

    def drop_root(self, root: int) -> None:
        """Forget every cached block whose chain starts at `root` (a removed adapter's)."""
        for block_id in [b for b in self.hash_to_block.values() if self.blocks[b].root == root]:
            block = self.blocks[block_id]
            self._unhash(block)
            if block.ref_count == 0:
                del self.evictable[block_id]
                self.free_ids.append(block_id)

    # ---- allocation --------------------------------------------------------------------------
    def allocate(self, seq: Sequence, num_new_tokens: int, cached_blocks: list[int] = ()) -> bool:
        """Give `seq` the blocks for `num_new_tokens` more tokens, first taking `cached_blocks`
        (a prefix-cache hit). Returns False, changing nothing, when the pool is too small."""
        computed = seq.num_computed_tokens + len(cached_blocks) * self.block_size
        num_new_blocks = self.blocks_needed(computed + num_new_tokens) - len(seq.block_table) - len(cached_blocks)
        behind = max(0, self._first_live_block(computed) - len(seq.block_table))   # hits the window has passed
        revived = sum(1 for b in cached_blocks[behind:] if self.blocks[b].ref_count == 0)
        if num_new_blocks > self.num_free_blocks - revived:
            return False
        seq.block_table.extend([NO_BLOCK] * min(behind, len(cached_blocks)))
        for block_id in cached_blocks[behind:]:
            self._take(block_id)
            seq.block_table.append(block_id)
        for _ in range(max(num_new_blocks, 0)):
            seq.block_table.append(self._take(self._pop_free()))
        return True

    def free(self, seq: Sequence) -> None:
        """Release the sequence's blocks. Hashed blocks stay cached, most recently used last."""
        for block_id in reversed(seq.block_table):
            if block_id != NO_BLOCK:
                self._release(block_id)
        seq.block_table = []
        seq.block_hashes = []

    def trim(self, seq: Sequence) -> None:
        """Release the blocks past the sequence's tokens (those only rejected drafts used)."""
        keep = self.blocks_needed(seq.num_tokens)
        while len(seq.block_table) > keep:
            self._release(seq.block_table.pop())

    def _release(self, block_id: int) -> None:
        block = self.blocks[block_id]
        block.ref_count -= 1
        assert block.ref_count >= 0, f"block {block_id} freed twice"
        if block.ref_count == 0:
            if block.hash == NO_HASH:
                self.free_ids.append(block_id)
            else:
                self.evictable[block_id] = None

    def _pop_free(self) -> int:
        if self.free_ids:
            return self.free_ids.popleft()
        block_id, _ = self.evictable.popitem(last=False)      # evict the least recently used
        self._unhash(self.blocks[block_id])
        return block_id

    def _unhash(self, block: Block) -> None:
        del self.hash_to_block[block.hash]
        block.hash, block.token_ids, block.root = NO_HASH, [], NO_HASH
        self.cache_version += 1

    def _take(self, block_id: int) -> int:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            self.evictable.pop(block_id, None)
        block.ref_count += 1
        return block_id

    def check_invariants(self, live: list[Sequence] = ()) -> None:
        """Every block is free, cached or referenced exactly as often as live block tables say."""
        refs = [0] * self.num_blocks
        for seq in live:
            for block_id in seq.block_table:
                if block_id != NO_BLOCK:
                    refs[block_id] += 1
        for block in self.blocks:
            assert block.ref_count >= 0, f"negative ref count on block {block.block_id}"
            assert block.ref_count == refs[block.block_id], (
                f"block {block.block_id}: ref_count {block.ref_count}, referenced {refs[block.block_id]} times")
        idle = set(self.free_ids) | set(self.evictable)
        assert len(idle) == len(self.free_ids) + len(self.evictable), "a block is listed twice as free"
        assert idle == {b.block_id for b in self.blocks if b.ref_count == 0}, "free lists disagree with ref counts"
        for h, block_id in self.hash_to_block.items():
            assert self.blocks[block_id].hash == h
