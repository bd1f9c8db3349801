"""Speculative decoding: propose draft tokens (n-gram prompt lookup or a draft model), verify
them in one step.

A decoding sequence may carry ``spec_token_ids``: k drafts scored with its last token in one
forward pass (k + 1 query tokens over the paged cache, like a short prefill chunk). Position j's
logits are sampled as if the drafts before it were the sequence's own tokens (penalties,
min_tokens and the seeded generator's position see them), and the drafts are accepted up to the
first that differs from what was sampled, whose sampled token ends the step's tokens (or the
bonus token after k accepted drafts).

With a point-mass draft (n-gram lookup, a greedy draft model) "sample from p, accept while equal" is rejection
sampling: a draft d is accepted with probability p(d), and on rejection the token comes from p
with d removed, renormalised. So the output distribution is the one without speculation, and a
seeded request, whose noise is a function of (seed, output position), gets the same tokens.
A structured-output request's drafts are cut to the prefix its grammar allows, and every scored
position is masked by its grammar (``structured_output``): the same holds for it.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from engine_worker.engine.sequence import Sequence
from engine_worker.engine.spec_policy import StepTimes, plan_drafts
from engine_worker.engine.structured_output import grammar_prefix
from shared.config import EngineConfig, SpeculativeConfig

ACCEPTANCE_EMA = 0.5          # weight of the latest verification in a sequence's acceptance rate
ENGINE_ACCEPTANCE_EMA = 0.05  # ... and in the engine's, a new sequence's first rate
MIN_ACCEPTANCE = 0.15         # below this a sequence stops proposing (the proposer's work is saved) ...
BACKOFF_STEPS = 8             # ... for this many decode steps, doubled at each back-off in a row
MAX_BACKOFF_STEPS = 256


class PerSequenceProposer:
    """A proposer that drafts from one sequence's tokens at a time and keeps no state."""

    def draft(self, token_ids: list[int], k: int) -> list[int]:
        raise NotImplementedError

    def sync(self, running: list[Sequence]) -> None:
        pass

    def propose(self, seqs: list[Sequence], counts: list[int]) -> list[list[int]]:
        return [self.draft(seq.token_ids, k) for seq, k in zip(seqs, counts)]


class NgramProposer(PerSequenceProposer):
    """Prompt lookup: find the last n tokens (n from prompt_lookup_max down to _min) earlier in
    the prompt and output, and propose the tokens that followed its latest occurrence."""

    def __init__(self, config: SpeculativeConfig):
        self.max_n, self.min_n = config.prompt_lookup_max, config.prompt_lookup_min

    def draft(self, token_ids: list[int], k: int) -> list[int]:
        if k <= 0:
            return []
        last, best_n, best_end = token_ids[-1], 0, -1
        for end in range(len(token_ids) - 2, -1, -1):       # latest first: a tie keeps the latest
            if token_ids[end] != last:
                continue
            n = 1
            while n < self.max_n and n <= end and token_ids[end - n] == token_ids[-1 - n]:
                n += 1
            if n > best_n:
                best_n, best_end = n, end
                if n == self.max_n:
                    break
        return token_ids[best_end + 1:best_end + 1 + k] if best_n >= self.min_n else []


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


def make_proposer(config: SpeculativeConfig, engine_config: EngineConfig, vocab_size: int):
    if config.method == "draft_model":
        from engine_worker.engine.draft_model import DraftModelProposer
        return DraftModelProposer(config, engine_config, vocab_size)
    return NgramProposer(config)


class Speculator:
    """Proposes drafts for the running decodes after each step, as many as the measured step
    times and acceptance say pay (``spec_policy``), and accepts verified ones."""

    def __init__(self, config: SpeculativeConfig, proposer, max_model_len: int, max_num_batched_tokens: int):
        self.config = config
        self.proposer = proposer          # propose(seqs, counts) -> drafts; sync(running)
        self.max_model_len = max_model_len
        self.max_num_batched_tokens = max_num_batched_tokens
        self.step_times = StepTimes()
        self.acceptance = 0.5             # the engine's acceptance rate, over every sequence's drafts
        self.stats = SpecStats()

    def observe_step(self, num_tokens: int, seconds: float) -> None:
        """A step that scored num_tokens tokens, all of them decodes and drafts, took `seconds`."""
        self.step_times.observe(num_tokens, seconds)

    def propose(self, running: list[Sequence]) -> None:
        """Set spec_token_ids of every decoding sequence the plan gives drafts to."""
        self.proposer.sync(running)
        decoding = [seq for seq in running if seq.num_computed_tokens == seq.num_tokens - 1]
        candidates = []
        for seq in running:
            seq.spec_token_ids = []
        for seq in decoding:
            if seq.spec_acceptance is None:      # new: as the engine's drafts have fared lately
                seq.spec_acceptance = self.acceptance
                self._back_off_if_poor(seq)
            if seq.spec_backoff > 0:
                seq.spec_backoff -= 1
                continue
            k = min(self.config.num_speculative_tokens, seq.params.max_tokens - seq.num_output_tokens - 1,
                    self.max_model_len - seq.num_tokens - 1)
            if k > 0:
                candidates.append((seq, k))
        if not candidates:
            return
        num_tokens = min(sum(seq.num_tokens - seq.num_computed_tokens for seq in running), self.max_num_batched_tokens)
        counts = plan_drafts([seq.spec_acceptance for seq, _ in candidates], [k for _, k in candidates],
                             len(decoding), num_tokens, self.step_times.predict)
        chosen = [(seq, n) for (seq, _), n in zip(candidates, counts) if n]
        if chosen:
            drafts = self.proposer.propose([seq for seq, _ in chosen], [n for _, n in chosen])
            for (seq, _), d in zip(chosen, drafts):
                seq.spec_token_ids = d if seq.grammar is None else grammar_prefix(seq.grammar, d)

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
        sequence's acceptance rate (accepted drafts per draft tested: the first rejected one is
        tested, those after it are not) and the counters."""
        drafts = seq.spec_token_ids
        accepted = 0
        while accepted < len(drafts) and drafts[accepted] == sampled[accepted]:
            accepted += 1
        if drafts:
            self.stats.record(len(drafts), accepted)
            rate = accepted / (accepted + (accepted < len(drafts)))
            seq.spec_acceptance += ACCEPTANCE_EMA * (rate - seq.spec_acceptance)
            self.acceptance += ENGINE_ACCEPTANCE_EMA * (rate - self.acceptance)
            self._back_off_if_poor(seq)
        return accepted

    @staticmethod
    def _back_off_if_poor(seq: Sequence) -> None:
        if seq.spec_acceptance > 2 * MIN_ACCEPTANCE:        # recovered: the next back-off is short again
            seq.spec_num_backoffs = 0
        if seq.spec_acceptance >= MIN_ACCEPTANCE:
            return
        seq.spec_backoff = min(BACKOFF_STEPS << seq.spec_num_backoffs, MAX_BACKOFF_STEPS)
        seq.spec_num_backoffs += 1
        seq.spec_acceptance = 2 * MIN_ACCEPTANCE        # the rate it probes with when the back-off ends
