"""Iteration-level scheduling: the waiting and running queues, chunked prefill and preemption.

Every step: running sequences first (decodes and unfinished prefill chunks), in admission order;
then waiting sequences FCFS while blocks, the token budget and the batch cap allow. When a running
sequence cannot get a block, the most recently admitted one is preempted by recompute: its blocks
are freed and it returns to the front of the waiting queue with the tokens it already generated.
With a shared KV store (kv_offload.py) a sequence LOADING its prefix is passed over until its
fetch ends; then its loaded blocks that continue its prefix-cache hits count as computed.
"""
from __future__ import annotations

import time
from collections import Counter, deque
from dataclasses import dataclass, field

from engine_worker.engine.block_manager import BlockManager
from engine_worker.engine.sequence import Sequence, SequenceStatus


@dataclass(slots=True)
class ScheduledBatch:
    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)   # tokens computed this step, per seq
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def add(self, seq: Sequence, n: int) -> None:
        self.seqs.append(seq)
        self.num_new_tokens.append(n)


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_batched_tokens: int, max_num_seqs: int,
                 max_loras: int = 0):
        self.block_manager = block_manager
        self.max_loras = max_loras
        self.running_loras: Counter[str] = Counter()   # adapter -> running requests
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.by_id: dict[str, Sequence] = {}       # every waiting or running sequence
        self.num_preemptions = 0
        self.kv_loads = None        # kv_offload.KVOffload where a shared KV store is attached

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)
        self.by_id[seq.request_id] = seq

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def find(self, request_id: str) -> Sequence | None:
        return self.by_id.get(request_id)

    def loras_in_use(self) -> set[str]:
        """The adapters of every waiting or running request."""
        return {seq.lora_name for seq in self.by_id.values() if seq.lora_name}

    def finish(self, seq: Sequence, reason: str) -> None:
        """Take `seq` out of the queues and free its blocks."""
        if seq.status is SequenceStatus.RUNNING:
            self._stop_running(seq)
        elif seq.status in (SequenceStatus.WAITING, SequenceStatus.LOADING):
            self.waiting.remove(seq)
        self.by_id.pop(seq.request_id, None)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.finished_time = time.time()

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = self._num_new_tokens(seq, budget)
            if self._allocate_or_preempt(seq, n, batch):
                batch.add(seq, n)
                budget -= n
                i += 1
        if not batch.preempted:
            self._admit(batch, budget)
        return batch

    def _num_new_tokens(self, seq: Sequence, budget: int) -> int:
        """The sequence's uncomputed tokens plus the drafts that the budget and free blocks allow
        (drafts are trimmed to what is scheduled, and dropped rather than preempting anyone)."""
        remaining = seq.num_tokens - seq.num_computed_tokens
        n = min(remaining + len(seq.spec_token_ids), budget)
        del seq.spec_token_ids[max(0, n - remaining):]
        if seq.spec_token_ids and not self.block_manager.allocate(seq, n):
            seq.spec_token_ids = []
            n = min(remaining, budget)
        return n

    def _allocate_or_preempt(self, seq: Sequence, n: int, batch: ScheduledBatch) -> bool:
        while not self.block_manager.allocate(seq, n):
            victim = self.running[-1]          # most recently admitted
            self._preempt(victim)
            batch.preempted.append(victim)
            if victim is seq:
                return False
        return True

    def _stop_running(self, seq: Sequence) -> None:
        self.running.remove(seq)
        if seq.lora_name:
            self.running_loras[seq.lora_name] -= 1
            if not self.running_loras[seq.lora_name]:
                del self.running_loras[seq.lora_name]

    def _lora_fits(self, seq: Sequence) -> bool:
        name = seq.lora_name
        return not name or name in self.running_loras or len(self.running_loras) < self.max_loras

    def _preempt(self, seq: Sequence) -> None:
        self._stop_running(seq)
        if self.kv_loads is not None:
            self.kv_loads.swap_out(seq)        # while its blocks still hold its KV
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.spec_token_ids = []
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def _admit(self, batch: ScheduledBatch, budget: int) -> None:
        passed: list[Sequence] = []            # waiting for an adapter slot, in queue order
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if seq.status is SequenceStatus.LOADING or not self._lora_fits(seq):
                passed.append(self.waiting.popleft())
                continue
            cached = [] if seq.needs_prompt_logprobs else self.block_manager.find_cached_prefix(seq)
            loaded = self.kv_loads.usable(seq, len(cached)) if seq.kv_load is not None else 0
            bs = self.block_manager.block_size
            num_cached = (len(cached) + loaded) * bs
            n = min(seq.num_tokens - num_cached, budget)
            if not self.block_manager.allocate(seq, loaded * bs + n, cached):
                break                              # FCFS: nobody overtakes the head of the queue
            self.waiting.popleft()
            if loaded:
                self.kv_loads.write(seq, len(cached), loaded)
            seq.kv_load = None
            seq.num_computed_tokens = num_cached
            self.block_manager.record_prefix_lookup(seq.num_tokens, len(cached) * bs)
            if seq.num_preemptions == 0:
                seq.num_cached_tokens = num_cached
                seq.num_loaded_tokens = loaded * bs
                seq.scheduled_time = time.time()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            if seq.lora_name:
                self.running_loras[seq.lora_name] += 1
            batch.add(seq, n)
            budget -= n
        self.waiting.extendleft(reversed(passed))
