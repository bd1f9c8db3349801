"""The engine: admit requests, schedule a step, run it, sample, and report what changed.

The core knows nothing about where requests come from: callers ``add_request`` and
``abort_request``, then ``step()`` (schedule -> run -> postprocess) returns what each request got.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from engine_worker.block_manager import BlockManager
from engine_worker.model_runner import ModelRunner
from engine_worker.sampler import Sampler
from engine_worker.sampling_params import SamplingParams
from engine_worker.scheduler import ScheduledBatch, Scheduler
from engine_worker.sequence import Sequence
from shared.config import EngineConfig
from shared.protocol import TokenLogprob

log = logging.getLogger(__name__)


@dataclass(slots=True)
class RequestOutput:
    """What one request got in one step: new tokens, and on its last step the finish reason."""
    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprob] | None
    finish_reason: str | None
    error: str | None
    num_prompt_tokens: int
    num_cached_tokens: int
    num_output_tokens: int
    metrics: dict[str, float] = field(default_factory=dict)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class EngineStats:
    num_running: int
    num_waiting: int
    num_waiting_tokens: int
    kv_cache_usage: float
    prefix_cache_hit_rate: float
    num_free_blocks: int
    num_blocks: int
    max_num_seqs: int
    num_preemptions: int
    step_count: int
    prefix_cache_queries: int            # prompt tokens looked up in the prefix cache (cumulative)
    prefix_cache_hits: int               # of which the cache served (cumulative)


class LLMEngine:
    def __init__(self, config: EngineConfig):
        if not config.model:
            from shared.gguf_convert import ensure_default_model
            config = config.with_overrides(model=str(ensure_default_model()))
        config = config.with_overrides(max_num_batched_tokens=config.token_budget())
        self.config = config
        self.model_name = Path(config.model).name
        self.runner = ModelRunner(config, config.model)
        cfg = self.runner.model_config
        self.vocab_size = cfg.vocab_size
        self.eos_token_ids = cfg.eos_token_ids
        self.max_model_len = self.runner.max_model_len
        self.block_manager = BlockManager(self.runner.num_blocks, self.runner.block_size,
                                          config.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, config.max_num_batched_tokens, config.max_num_seqs)
        self.sampler = Sampler()
        self._pending_outputs: list[RequestOutput] = []
        self.step_count = 0
        log.info("engine ready: model=%s dtype=%s blocks=%d x %d tokens, backend=%s", self.model_name,
                 self.runner.dtype, self.runner.num_blocks, self.runner.block_size, self.runner.backend.name)

    @property
    def eos_token_id(self) -> int | None:
        return self.eos_token_ids[0] if self.eos_token_ids else None

    # ---- admission ---------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Queue a request for the next step. Raises ValueError, leaving the engine untouched, for
        invalid input."""
        params.validate()
        self._validate_prompt(prompt_token_ids, params)
        if self.scheduler.find(request_id) is not None:
            raise ValueError(f"request id {request_id!r} is already running")
        seq = Sequence(request_id, list(prompt_token_ids), len(prompt_token_ids), params)
        if params.seed is not None:
            seq.generator = torch.Generator(self.runner.device).manual_seed(params.seed)
        self.scheduler.add(seq)

    def _validate_prompt(self, ids: list[int], params: SamplingParams) -> None:
        if not ids:
            raise ValueError("the prompt is empty")
        bad = next((t for t in ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise ValueError(f"token id {bad!r} is outside the vocabulary [0, {self.vocab_size})")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"the prompt has {len(ids)} tokens; this model's context is {self.max_model_len} "
                             "and at least one must remain for the output")
        total = len(ids) + params.max_tokens
        if total > self.max_model_len:
            raise ValueError(f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) = {total} "
                             f"exceeds the context length {self.max_model_len}")
        capacity = self.block_manager.num_blocks * self.block_manager.block_size
        if total > capacity:
            raise ValueError(f"prompt + max_tokens = {total} tokens can never fit the KV cache ({capacity} tokens)")

    def abort_request(self, request_id: str) -> bool:
        """Free the request's blocks now; its abort output comes with the next step."""
        seq = self.scheduler.find(request_id)
        if seq is None:
            return False
        self.scheduler.finish(seq, "abort")
        self._pending_outputs.append(self._output(seq, [], None))
        return True

    def free_capacity(self) -> int:
        """How many more requests this engine wants queued now."""
        s = self.scheduler
        if sum(q.num_tokens for q in s.waiting) > self.block_manager.num_free_blocks * self.block_manager.block_size:
            return 0
        return max(0, s.max_num_seqs - len(s.running) - len(s.waiting))

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._pending_outputs)

    # ---- the step ------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One iteration: schedule, run the model, sample; returns every request's news since the
        last step (aborts included)."""
        outputs, self._pending_outputs = self._pending_outputs, []
        batch = self.scheduler.schedule()
        if batch.seqs:
            outputs.extend(self._run(batch))
        self.step_count += 1
        return outputs

    def _run(self, batch: ScheduledBatch) -> list[RequestOutput]:
        # Sample only for sequences whose whole context is computed after this step.
        rows = [i for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_new_tokens))
                if seq.num_computed_tokens + n == seq.num_tokens]
        logits = self.runner.run(batch, rows)
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            seq.num_computed_tokens += n
            self.block_manager.cache_full_blocks(seq)
        if not rows:
            return []
        seqs = [batch.seqs[i] for i in rows]
        sampled = self.sampler(logits, seqs)
        outputs = []
        now = time.time()
        for seq, token, logprob in zip(seqs, sampled.token_ids, sampled.logprobs):
            seq.token_ids.append(token)
            if not seq.first_token_time:
                seq.first_token_time = now
            reason = self._stop_reason(seq, token)
            if reason:
                self.scheduler.finish(seq, reason)
            outputs.append(self._output(seq, [token], [logprob] if logprob else None))
        return outputs

    def _stop_reason(self, seq: Sequence, token: int) -> str | None:
        p = seq.params
        if (not p.ignore_eos and token in self.eos_token_ids) or token in p.stop_token_ids:
            return "stop"
        if seq.num_output_tokens >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    @staticmethod
    def _output(seq: Sequence, tokens: list[int], logprobs) -> RequestOutput:
        return RequestOutput(seq.request_id, tokens, logprobs, seq.finish_reason, None, seq.num_prompt_tokens,
                             seq.num_cached_tokens, seq.num_output_tokens, seq.metrics())

    def stats(self) -> EngineStats:
        s, bm = self.scheduler, self.block_manager
        return EngineStats(
            num_running=len(s.running), num_waiting=len(s.waiting),
            num_waiting_tokens=sum(q.num_tokens - q.num_computed_tokens for q in s.waiting),
            kv_cache_usage=bm.usage, prefix_cache_hit_rate=bm.prefix_cache_hit_rate,
            num_free_blocks=bm.num_free_blocks, num_blocks=bm.num_blocks, max_num_seqs=s.max_num_seqs,
            num_preemptions=s.num_preemptions, step_count=self.step_count,
            prefix_cache_queries=bm.num_queried_tokens, prefix_cache_hits=bm.num_hit_tokens)

    def check_block_accounting(self) -> None:
        """Assert that all blocks are free, cached or held by a live sequence (used by tests)."""
        self.block_manager.check_invariants(self.scheduler.running + list(self.scheduler.waiting))
