"""Draft-model proposals: a small model with the target's vocabulary runs greedily k tokens ahead
of each sequence, on its own paged KV cache.

Each sequence the drafts are for has a shadow: the draft cache's view of it (token ids, computed
count, block table in the draft's own BlockManager). After every step the shadow is matched to the
sequence's tokens: verification keeps a prefix of the drafts and appends one token, so the cache
stays valid up to the sequence's last token but one; a rejected draft's entries are overwritten.
"""
from __future__ import annotations

from engine_worker.engine.block_manager import BlockManager
from engine_worker.engine.sampler import argmax_rows
from engine_worker.model.model_runner import ModelRunner
from engine_worker.engine.scheduler import ScheduledBatch
from engine_worker.engine.sequence import Sequence
from shared.config import EngineConfig, SpeculativeConfig


class DraftModelProposer:
    def __init__(self, config: SpeculativeConfig, engine_config: EngineConfig, vocab_size: int):
        from shared.model_source import resolve_model
        path = str(resolve_model(config.model))
        # no adapters; whole on rank 0 of a tensor-parallel engine
        self.runner = ModelRunner(engine_config.with_overrides(model=path, max_loras=0, tensor_parallel_size=1), path)
        if self.runner.model_config.vocab_size != vocab_size:
            raise ValueError(f"the draft model {path} has {self.runner.model_config.vocab_size} tokens in its "
                             f"vocabulary; the target has {vocab_size}: they must share the tokenizer")
        self.block_manager = BlockManager(self.runner.num_blocks, self.runner.block_size, False)
        self.shadows: dict[str, Sequence] = {}

    def sync(self, running: list[Sequence]) -> None:
        """Match every shadow to its sequence's tokens; free those of sequences no longer running."""
        live = {seq.request_id: seq for seq in running}
        for rid in [rid for rid in self.shadows if rid not in live]:
            self.block_manager.free(self.shadows.pop(rid))
        for rid, shadow in self.shadows.items():
            tokens = live[rid].token_ids
            shadow.num_computed_tokens = min(shadow.num_computed_tokens, len(tokens) - 1)
            shadow.token_ids = list(tokens)
            self.block_manager.trim(shadow)

    def propose(self, seqs: list[Sequence], counts: list[int]) -> list[list[int]]:
        """Up to counts[i] greedy draft tokens for seqs[i]: one forward pass of the draft model per
        draft position, over every sequence still drafting (the first also catches up on the
        tokens the shadow has not computed: the prompt, or the last step's tokens)."""
        shadows = [self._shadow(seq) for seq in seqs]
        drafts: list[list[int]] = [[] for _ in seqs]
        active = list(range(len(seqs)))
        while active:
            batch = ScheduledBatch()
            for i in list(active):
                n = shadows[i].num_tokens - shadows[i].num_computed_tokens
                if self.block_manager.allocate(shadows[i], n):
                    batch.add(shadows[i], n)
                else:                              # the draft cache is full: no more drafts for it
                    active.remove(i)
            if not active:
                break
            logits, _ = self.runner.run(batch, list(range(len(active))))
            for i, token in zip(active, argmax_rows(logits).tolist()):
                shadows[i].num_computed_tokens = shadows[i].num_tokens
                shadows[i].token_ids.append(token)
                drafts[i].append(token)
            active = [i for i in active if len(drafts[i]) < counts[i]]
        return drafts

    def _shadow(self, seq: Sequence) -> Sequence:
        shadow = self.shadows.get(seq.request_id)
        if shadow is None:
            shadow = Sequence(seq.request_id, list(seq.token_ids), seq.num_prompt_tokens, seq.params)
            self.shadows[seq.request_id] = shadow
        return shadow
