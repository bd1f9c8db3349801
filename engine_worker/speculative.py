"""Speculative decoding: propose draft tokens (n-gram prompt lookup), verify them in one step.

A decoding sequence may carry ``spec_token_ids``: k drafts scored with its last token in one
forward pass (k + 1 query tokens over the paged cache, like a short prefill chunk). Position j's
logits are sampled as if the drafts before it were the sequence's own tokens (penalties,
min_tokens and the seeded generator's position see them), and the drafts are accepted up to the
first that differs from what was sampled, whose sampled token ends the step's tokens (or the
bonus token after k accepted drafts).

With a point-mass draft (n-gram lookup) "sample from p, accept while equal" is rejection
sampling: a draft d is accepted with probability p(d), and on rejection the token comes from p
with d removed, renormalised. So the output distribution is the one without speculation, and a
seeded request, whose noise is a function of (seed, output position), gets the same tokens.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import numpy as np

from engine_worker.sequence import Sequence
from shared.config import SpeculativeConfig

ACCEPTANCE_EMA = 0.3          # weight of the latest step in a sequence's acceptance average
MIN_ACCEPTANCE = 0.15         # below this (drafts accepted per draft proposed) a sequence backs off
BACKOFF_STEPS = 8             # decode steps without proposals before a sequence probes again


class NgramProposer:
    """Prompt lookup: find the last n tokens (n from prompt_lookup_max down to _min) earlier in
    the prompt and output, and propose the tokens that followed its latest occurrence."""

    def __init__(self, config: SpeculativeConfig):
        self.max_n, self.min_n = config.prompt_lookup_max, config.prompt_lookup_min

    def propose(self, token_ids: list[int], k: int) -> list[int]:
        if k <= 0 or len(token_ids) <= self.min_n:
            return []
        tokens = np.asarray(token_ids, dtype=np.int64)
        for n in range(min(self.max_n, len(tokens) - 1), self.min_n - 1, -1):
            windows = np.lib.stride_tricks.sliding_window_view(tokens[:-1], n)
            hits = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n
                return tokens[start:start + k].tolist()
        return []


@dataclass(slots=True)
class SpecStats:
    """Cumulative counters, as vLLM's spec_decode metrics."""
    num_drafts: int = 0                   # verification steps of a sequence with drafts
    num_draft_tokens: int = 0             # drafts proposed and scored
    num_accepted_tokens: int = 0          # drafts accepted
    accepted_per_position: list[int] = field(default_factory=list)

    def record(self, num_drafts: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_position) < num_drafts:
            self.accepted_per_position += [0] * (num_drafts - len(self.accepted_per_position))
        for j in range(num_accepted):
            self.accepted_per_position[j] += 1


class Speculator:
    """Proposes drafts for the running decodes after each step and accepts verified ones."""

    def __init__(self, config: SpeculativeConfig, max_model_len: int):
        self.config = config
        self.max_model_len = max_model_len
        self.proposer = NgramProposer(config)
        self.stats = SpecStats()

    def propose(self, running: list[Sequence]) -> None:
        """Set spec_token_ids of every decoding sequence that speculation may help."""
        for seq in running:
            seq.spec_token_ids = []
            if seq.num_computed_tokens != seq.num_tokens - 1 or seq.grammar is not None:
                continue
            if seq.spec_backoff > 0:
                seq.spec_backoff -= 1
                continue
            k = min(self.config.num_speculative_tokens, seq.params.max_tokens - seq.num_output_tokens - 1,
                    self.max_model_len - seq.num_tokens - 1)
            seq.spec_token_ids = self.proposer.propose(seq.token_ids, k)

    @staticmethod
    def expand(seqs: list[Sequence]) -> list[Sequence]:
        """One sampling row per scored position: a sequence with k drafts gives k + 1 rows, row j
        a view of it with drafts[:j] appended (what it will be if they are accepted)."""
        rows = []
        for seq in seqs:
            rows.append(seq)
            for j in range(1, len(seq.spec_token_ids) + 1):
                rows.append(dataclasses.replace(seq, token_ids=seq.token_ids + seq.spec_token_ids[:j]))
        return rows

    def accept(self, seq: Sequence, sampled: list[int]) -> int:
        """How many of seq's drafts `sampled` (its k + 1 rows' tokens) confirms; updates the
        sequence's acceptance average and the counters."""
        drafts = seq.spec_token_ids
        accepted = 0
        while accepted < len(drafts) and drafts[accepted] == sampled[accepted]:
            accepted += 1
        if drafts:
            self.stats.record(len(drafts), accepted)
            rate = accepted / len(drafts)
            seq.spec_acceptance = (1 - ACCEPTANCE_EMA) * seq.spec_acceptance + ACCEPTANCE_EMA * rate
            if seq.spec_acceptance < MIN_ACCEPTANCE:
                seq.spec_backoff, seq.spec_acceptance = BACKOFF_STEPS, MIN_ACCEPTANCE * 2
        return accepted
