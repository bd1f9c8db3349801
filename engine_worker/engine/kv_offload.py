"""The engine's side of a shared KV store: which chunks a new sequence asks for, putting loaded
chunks into its blocks at admission, and which full chunks to write after a step.

- ``start_load``: a sequence whose prompt has full chunks beyond its local prefix-cache hits waits
  (LOADING) while the connector reads them; the scheduler passes over it meanwhile, the running
  batch goes on. ``poll`` returns it to the queue with what was found.
- ``usable``/``write`` (the scheduler, at admission): the loaded blocks that continue the local
  hits are copied into the blocks just allocated, and count as computed.
- ``save_full_chunks`` (after each step, before finished sequences free their blocks): every
  chunk that became full and computed -- of prompts and of running sequences, so a continuation
  or a preempted sequence finds them -- unless this engine knows it is stored. A chunk dropped
  because the write queue was full is tried again after the next step, and ``swap_out`` tries
  once more when its sequence is preempted, before its blocks are freed.
- The choice is measured: a load is asked for unless the measured load time per token exceeds
  the measured prefill time per token (every PROBE_EVERY-th candidate is loaded anyway, to keep
  the load's figure current).
"""
from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine_worker.engine.kv_connector import ChunkRef, FetchRequest, KVConnector, SaveChunk
from engine_worker.engine.kv_layout import KVLayout
from engine_worker.engine.sequence import Sequence, SequenceStatus
from shared.block_hash import prefix_block_hashes

KNOWN_MAX = 1 << 16          # chunk hashes remembered as stored (loaded or written here)
PROBE_EVERY = 16
EMA = 0.2
MIN_PREFILL_TOKENS = 64      # steps this large measure prefill time per token


@dataclass(slots=True)
class LoadedPrefix:
    first_block: int
    kv: torch.Tensor             # (blocks, *KVLayout.block_shape())

    @property
    def end_block(self) -> int:
        return self.first_block + len(self.kv)


@dataclass(slots=True)
class OffloadStats:
    loads_skipped: int = 0       # candidates not loaded: a load measured slower than a prefill
    loaded_tokens: int = 0       # prompt tokens put into blocks from the store
    dropped_writes: int = 0      # chunks not even copied out: the connector's queue was full
    load_s_per_token: float = 0.0
    prefill_s_per_token: float = 0.0


class KVOffload:
    def __init__(self, connector: KVConnector, layout: KVLayout, kv_caches, dtype: torch.dtype,
                 adapter_id: Callable[[str], str] = str):
        self.connector = connector
        self.adapter_id = adapter_id          # an adapter's name -> its name in keys (with its fingerprint)
        self.layout = layout
        self.kv_caches = kv_caches
        self.dtype = dtype
        self.pending: dict[int, tuple[Sequence, list[ChunkRef]]] = {}
        self.known: OrderedDict[int, None] = OrderedDict()
        self.stats = OffloadStats()
        self._tickets = itertools.count()
        self._candidates = 0

    # ---- reading -------------------------------------------------------------------------
    def start_load(self, seq: Sequence, num_local_blocks: int) -> bool:
        """Ask for the stored chunks beyond `num_local_blocks`; True: `seq` is LOADING."""
        C, bs = self.layout.chunk_blocks, self.layout.block_size
        num_chunks = (seq.num_tokens - 1) // bs // C        # the last token is always computed
        first = num_local_blocks // C
        if seq.needs_prompt_logprobs or first >= num_chunks or not self._worth_loading():
            return False
        hashes = prefix_block_hashes(seq.token_ids, bs, num_chunks * C, seq.lora_name)
        refs = [ChunkRef(tuple(hashes[i * C:(i + 1) * C]), tuple(seq.token_ids[i * C * bs:(i + 1) * C * bs]))
                for i in range(first, num_chunks)]
        ticket = next(self._tickets)
        self.pending[ticket] = (seq, refs)
        seq.status = SequenceStatus.LOADING
        self.connector.fetch(FetchRequest(ticket, self.adapter_id(seq.lora_name), first * C, refs))
        return True

    def _worth_loading(self) -> bool:
        st = self.stats
        self._candidates += 1
        if not st.load_s_per_token or not st.prefill_s_per_token or st.load_s_per_token <= st.prefill_s_per_token:
            return True
        if self._candidates % PROBE_EVERY == 0:
            return True
        st.loads_skipped += 1
        return False

    def poll(self) -> None:
        """Return the sequences whose fetch finished to the queue, with what it found."""
        for result in self.connector.done():
            seq, refs = self.pending.pop(result.ticket)
            if result.num_chunks:
                self._measure_load(result.seconds, len(result.kv) * self.layout.block_size)
            for ref in refs[:result.num_chunks]:
                self._remember(ref)
            if seq.status is not SequenceStatus.LOADING:
                continue                                     # aborted while it loaded
            seq.status = SequenceStatus.WAITING
            if result.num_chunks:
                seq.kv_load = LoadedPrefix(result.first_block, result.kv)

    def has_pending(self) -> bool:
        return bool(self.pending)

    def usable(self, seq: Sequence, num_local_blocks: int) -> int:
        """Loaded blocks that continue `num_local_blocks` local hits."""
        load = seq.kv_load
        if load is None or not load.first_block <= num_local_blocks < load.end_block:
            return 0
        return load.end_block - num_local_blocks

    def write(self, seq: Sequence, first_block: int, count: int) -> None:
        """Copy `count` loaded blocks from index `first_block` into the sequence's blocks."""
        load = seq.kv_load
        rows = load.kv[first_block - load.first_block:first_block - load.first_block + count]
        index = torch.tensor(seq.block_table[first_block:first_block + count], dtype=torch.long)
        for layer, (k, v) in enumerate(self.kv_caches):
            index_d = index.to(k.device)
            k.index_copy_(0, index_d, rows[:, layer, 0].to(k.device))
            v.index_copy_(0, index_d, rows[:, layer, 1].to(v.device))
        self.stats.loaded_tokens += count * self.layout.block_size

    # ---- writing -------------------------------------------------------------------------
    def save_full_chunks(self, seqs: list[Sequence]) -> None:
        for seq in seqs:
            self._save(seq)

    def swap_out(self, seq: Sequence) -> None:
        """`seq` is preempted and its blocks are about to be freed: write its full chunks not
        written yet (those dropped while the queue was full), so its swap-in finds them."""
        self._save(seq)

    def _save(self, seq: Sequence) -> None:
        """Queue the sequence's full computed chunks from its first one not queued yet; a chunk
        that finds the queue full is dropped and counted, and retried after the next step."""
        C, bs = self.layout.chunk_blocks, self.layout.block_size
        full = min(len(seq.block_hashes), seq.num_computed_tokens // bs) // C
        for i in range(seq.num_stored_chunks, full):
            hashes = tuple(seq.block_hashes[i * C:(i + 1) * C])
            if hashes[-1] not in self.known:
                ref = ChunkRef(hashes, tuple(seq.token_ids[i * C * bs:(i + 1) * C * bs]))
                if not self.connector.has_room():
                    self.stats.dropped_writes += 1
                    return
                payload = self._gather(seq.block_table[i * C:(i + 1) * C])
                if not self.connector.save(SaveChunk(self.adapter_id(seq.lora_name), ref, payload)):
                    return                                   # counted by the connector
                self._remember(ref)
            seq.num_stored_chunks = i + 1

    def _gather(self, block_ids: list[int]) -> torch.Tensor:
        out = torch.empty((len(block_ids), *self.layout.block_shape()), dtype=self.dtype)
        k0 = self.kv_caches[0][0]
        index = torch.tensor(block_ids, dtype=torch.long, device=k0.device)
        for layer, (k, v) in enumerate(self.kv_caches):
            out[:, layer, 0] = k.index_select(0, index).cpu()
            out[:, layer, 1] = v.index_select(0, index).cpu()
        return out

    def _remember(self, ref: ChunkRef) -> None:
        self.known[ref.block_hashes[-1]] = None
        self.known.move_to_end(ref.block_hashes[-1])
        if len(self.known) > KNOWN_MAX:
            self.known.popitem(last=False)

    def engine_stats(self) -> dict:
        """The store's counts as EngineStats fields."""
        c, own = self.connector.stats(), self.stats
        return dict(kv_store_hit_chunks=c.hit_chunks, kv_store_miss_chunks=c.miss_chunks,
                    kv_store_invalid_chunks=c.invalid_chunks, kv_store_loaded_tokens=own.loaded_tokens,
                    kv_store_bytes_loaded=c.bytes_loaded, kv_store_load_seconds=c.load_seconds,
                    kv_store_saved_chunks=c.saved_chunks, kv_store_bytes_stored=c.bytes_stored,
                    kv_store_store_seconds=c.store_seconds,
                    kv_store_dropped_writes=c.dropped_writes + own.dropped_writes,
                    kv_store_errors=c.errors, kv_store_loads_skipped=own.loads_skipped)

    # ---- measuring -----------------------------------------------------------------------
    def _measure_load(self, seconds: float, tokens: int) -> None:
        st = self.stats
        x = seconds / tokens
        st.load_s_per_token = x if not st.load_s_per_token else (1 - EMA) * st.load_s_per_token + EMA * x

    def observe_step(self, num_prefill_tokens: int, seconds: float) -> None:
        """A step's time, to measure what a prompt token costs to compute here."""
        if num_prefill_tokens < MIN_PREFILL_TOKENS:
            return
        st = self.stats
        x = seconds / num_prefill_tokens
        st.prefill_s_per_token = x if not st.prefill_s_per_token else (1 - EMA) * st.prefill_s_per_token + EMA * x
