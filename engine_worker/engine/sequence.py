"""A request as the engine sees it: its tokens, its place in the KV cache and its event times."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum, auto
from typing import Any

import torch

from engine_worker.engine.sampling_params import SamplingParams
from shared.protocol import TokenLogprob


class SequenceStatus(Enum):
    WAITING = auto()
    LOADING = auto()       # waiting for its KV from the shared store (kv_offload.py); passed over
    RUNNING = auto()
    FINISHED = auto()


@dataclass(slots=True)
class Sequence:
    request_id: str
    token_ids: list[int]                 # prompt followed by the generated tokens
    num_prompt_tokens: int
    params: SamplingParams
    lora_name: str = ""                  # the LoRA adapter it runs through ("": the base model)
    status: SequenceStatus = SequenceStatus.WAITING
    block_table: list[int] = field(default_factory=list)    # append-only while the sequence lives
    block_hashes: list[int] = field(default_factory=list)   # chained hashes of its full blocks
    num_computed_tokens: int = 0         # tokens whose K/V is in the cache
    num_cached_tokens: int = 0           # prompt tokens served by the prefix cache (first admission)
    num_preemptions: int = 0
    num_loaded_tokens: int = 0           # prompt tokens whose KV came from the shared store
    num_stored_chunks: int = 0           # leading full chunks written to (or known in) the store
    kv_load: Any = None                  # kv_offload.LoadedPrefix: fetched, not yet in blocks
    finish_reason: str | None = None
    stop_reason: int | None = None       # the stop token id that finished it (EOS and length: None)
    generator: torch.Generator | None = None    # seeded requests; re-seeded per position (sampler)
    num_generated: int = 0               # a continuation: prompt tokens that were this request's output
    grammar: Any = None                  # xgrammar.GrammarMatcher of a structured-output request
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)   # of prompt tokens 1, 2, ...
    spec_token_ids: list[int] = field(default_factory=list)  # drafts to verify after token_ids
    spec_acceptance: float | None = None  # moving average of its drafts' acceptance (speculative.py)
    spec_backoff: int = 0                # decode steps left without proposals
    spec_num_backoffs: int = 0           # back-offs in a row (each one twice as long)
    # Engine-clock event times (time.time()); other processes' clocks are not comparable.
    queued_time: float = field(default_factory=time.time)
    scheduled_time: float = 0.0
    first_token_time: float = 0.0
    finished_time: float = 0.0

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        """Every token this request generated, a continuation's earlier ones included (penalties)."""
        return self.token_ids[self.num_prompt_tokens - self.num_generated:]

    @property
    def output_position(self) -> int:
        """The index, in the request's whole output, of the next token to sample."""
        return self.num_generated + self.num_output_tokens

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Asked for prompt logprobs and not all computed yet (the prefix cache cannot serve it)."""
        return self.params.prompt_logprobs is not None and len(self.prompt_logprobs) < self.num_prompt_tokens - 1

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def metrics(self) -> dict[str, float]:
        return {"queued": self.queued_time, "scheduled": self.scheduled_time,
                "first_token": self.first_token_time, "finished": self.finished_time}
