"""The engine: admit requests, schedule a step, run it, sample, and report what changed.

The core knows nothing about where requests come from: callers ``add_request`` and
``abort_request``, then ``step()`` (schedule -> run -> postprocess) returns what each request got.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from engine_worker.engine.block_manager import BlockManager
from engine_worker.engine.kv_connector import KVConnector
from engine_worker.engine.kv_layout import AdapterIds, KVLayout
from engine_worker.engine.kv_offload import KVOffload
from engine_worker.engine.lora_registry import LoraRegistry
from engine_worker.model.model_runner import ModelRunner
from engine_worker.engine.sampler import Sampler
from engine_worker.engine.sampling_params import SamplingParams
from engine_worker.engine.scheduler import ScheduledBatch, Scheduler
from engine_worker.engine.sequence import Sequence
from engine_worker.engine.speculative import Speculator, make_proposer
from engine_worker.engine.structured_output import StructuredOutput
from engine_worker.model.fingerprint import model_fingerprint
from engine_worker.model.lora_weights import load_lora
from shared.block_hash import root_hash
from shared.config import EngineConfig
from shared.protocol import TokenLogprob
from shared.startup_stages import StartupStages

log = logging.getLogger(__name__)

# An idle engine's slice of KV page backing (between_steps): what a request arriving meanwhile
# waits for at most (about 3 pages at 3.4 ms each on a 2-core Zen 4 under KVM: bench/results/kv_prefault).
PREFAULT_SLICE_S = 0.01


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
    stop_reason: int | None = None        # the stop token id that finished it (not EOS)
    prompt_logprobs: list[TokenLogprob | None] | None = None   # with the first token, if asked

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
    spec_decode_num_drafts: int = 0      # speculative decoding (cumulative): verifications,
    spec_decode_num_draft_tokens: int = 0     # drafts scored,
    spec_decode_num_accepted_tokens: int = 0  # drafts accepted,
    spec_decode_accepted_per_position: list[int] = field(default_factory=list)   # and by draft position
    kv_store_hit_chunks: int = 0         # the shared KV store (cumulative): chunks loaded,
    kv_store_miss_chunks: int = 0        # fetches that ended before their last chunk,
    kv_store_invalid_chunks: int = 0     # values refused (corrupt, partial, another layout),
    kv_store_loaded_tokens: int = 0      # prompt tokens put into blocks from the store,
    kv_store_bytes_loaded: int = 0
    kv_store_load_seconds: float = 0.0
    kv_store_saved_chunks: int = 0
    kv_store_bytes_stored: int = 0
    kv_store_store_seconds: float = 0.0
    kv_store_dropped_writes: int = 0     # saves dropped: the write queue was full
    kv_store_errors: int = 0
    kv_store_loads_skipped: int = 0      # loads not asked for: measured slower than a prefill


class LLMEngine:
    """`stages`: where ModelRunner records the start-up's stages."""

    def __init__(self, config: EngineConfig, stages: StartupStages | None = None):
        from shared.model_source import resolve_model
        config = config.with_overrides(model=str(resolve_model(config.model)))
        config = config.with_overrides(max_num_batched_tokens=config.token_budget())
        self.config = config
        self.model_name = Path(config.model).name
        self.runner = ModelRunner(config, config.model, stages)
        cfg = self.runner.model_config
        self.vocab_size = cfg.vocab_size
        self.eos_token_ids = cfg.eos_token_ids
        self.max_model_len = self.runner.max_model_len
        self.block_manager = BlockManager(self.runner.num_blocks, self.runner.block_size,
                                          config.enable_prefix_caching, self.runner.kv_window)
        self.scheduler = Scheduler(self.block_manager, config.max_num_batched_tokens, config.max_num_seqs,
                                   config.max_loras)
        self.loras = self._lora_registry(config)
        self.sampler = Sampler(self.eos_token_ids)
        spec = config.speculative()
        self.speculator = None
        if spec is not None:
            self.speculator = Speculator(spec, make_proposer(spec, config, self.vocab_size), self.max_model_len,
                                         config.max_num_batched_tokens)
        self.structured = StructuredOutput(config.model, self.vocab_size, self.eos_token_ids)
        self._pending_outputs: list[RequestOutput] = []
        self.step_count = 0
        self.kv: KVOffload | None = None       # a shared KV store (attach_kv_connector)
        log.info("engine ready: model=%s dtype=%s kv cache %s, blocks=%d x %d tokens, backend=%s", self.model_name,
                 self.runner.dtype, self.runner.kv_dtype, self.runner.num_blocks, self.runner.block_size,
                 self.runner.backend.name)

    def _lora_registry(self, config: EngineConfig) -> LoraRegistry | None:
        modules = config.lora_module_paths()
        if config.max_loras <= 0:
            if modules:
                raise ValueError("--lora-modules needs LoRA slots (--max-loras above 0)")
            return None
        cfg, rank, dtype = self.runner.model_config, config.max_lora_rank, self.runner.dtype
        registry = LoraRegistry(config.max_loras, config.max_cpu_loras or config.max_loras,
                                lambda name, path: load_lora(name, path, cfg, rank, dtype),
                                self.runner.write_lora)
        if modules:
            self.runner.enable_lora()
        for name, path in modules.items():
            registry.add(name, path)
            log.info("LoRA adapter %s loaded from %s", name, path)
        return registry

    # ---- LoRA adapters -------------------------------------------------------------------------
    def add_lora(self, name: str, path: str) -> None:
        """Serve the PEFT adapter in directory `path` as `name`. ValueError for a bad adapter, one
        that does not fit this model or max_lora_rank, or a name already served."""
        if self.loras is None:
            raise ValueError("LoRA is disabled on this engine (max_loras is 0)")
        self.runner.enable_lora()
        self.loras.add(name, path)
        if self.kv is not None:
            self.kv.adapter_id.forget(name)

    def remove_lora(self, name: str) -> bool:
        """Stop serving `name` (False: not served). Requests already using it finish with it;
        its prefix-cache blocks are dropped once they have."""
        in_use = name in self.scheduler.loras_in_use()
        if self.loras is None or not self.loras.remove(name, in_use):
            return False
        if self.kv is not None:
            self.kv.adapter_id.forget(name)
        if not in_use:
            self.block_manager.drop_root(root_hash(name))
        return True

    def lora_adapters(self) -> dict[str, str]:
        return {} if self.loras is None else dict(self.loras.paths)

    def _retire_loras(self) -> None:
        if self.loras is not None and self.loras.retiring:
            for name in self.loras.retire_unused(self.scheduler.loras_in_use()):
                self.block_manager.drop_root(root_hash(name))

    def _lora_slots(self, seqs: list[Sequence]) -> list[int] | None:
        """Each sequence's adapter slot (-1: the base model), loading adapters into slots."""
        needed = {seq.lora_name for seq in seqs if seq.lora_name}
        if not needed:
            return None
        where = self.loras.slot_map(needed, self.scheduler.running_loras)
        return [where[seq.lora_name] if seq.lora_name else -1 for seq in seqs]

    # ---- a shared KV store ---------------------------------------------------------------------
    def kv_layout(self) -> KVLayout:
        """What this engine's stored chunks hold, and whose they are (kv_layout.py)."""
        cfg, r = self.runner.model_config, self.runner
        model_id = model_fingerprint(self.config.model, str(r.dtype), self.config.quantization)
        return KVLayout.build(model_id, r.kv_dtype, r.block_size, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim,
                              self.config.kv_store_chunk_tokens)

    def attach_kv_connector(self, connector: KVConnector, layout: KVLayout) -> None:
        """Read prompts' KV from, and write full chunks to, a store shared with other engines."""
        if not self.config.enable_prefix_caching:
            raise ValueError("a KV store needs prefix caching (its chunks are named by the prefix cache's hashes)")
        if self.runner.kv_window:
            raise ValueError("a KV store cannot serve a model whose every layer slides (blocks behind the window "
                             "are released)")
        adapter_ids = AdapterIds(lambda name: self.loras.paths.get(name) or self.loras.retiring[name])
        self.kv = KVOffload(connector, layout, self.runner.kv_caches, self.runner.kv_dtype, adapter_ids)
        self.scheduler.kv_loads = self.kv

    def _enqueue(self, seq: Sequence) -> None:
        """To the scheduler's queue; LOADING first where the store may hold more of its prompt."""
        self.scheduler.add(seq)
        if self.kv is not None:
            self.kv.start_load(seq, len(self.block_manager.find_cached_prefix(seq)))

    @property
    def eos_token_id(self) -> int | None:
        return self.eos_token_ids[0] if self.eos_token_ids else None

    # ---- admission ---------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    num_generated: int = 0, lora_name: str = "") -> None:
        """Queue a request for the next step, through the LoRA adapter `lora_name` ("": the base
        model). Raises ValueError, leaving the engine untouched, for invalid input or an unknown
        adapter. A continuation (failover) names how many of the prompt's last tokens it
        generated before: penalties count them as output, and the seeded generator's position
        goes on from them."""
        params.validate()
        if lora_name and (self.loras is None or not self.loras.knows(lora_name)):
            raise ValueError(f"unknown LoRA adapter {lora_name!r}; this engine serves "
                             f"{sorted(self.lora_adapters()) or 'none'}")
        self._validate_prompt(prompt_token_ids, params)
        if not 0 <= num_generated < len(prompt_token_ids):
            raise ValueError(f"num_generated must be in [0, {len(prompt_token_ids)}), got {num_generated!r}")
        if self.scheduler.find(request_id) is not None or self.structured.find(request_id) is not None:
            raise ValueError(f"request id {request_id!r} is already running")
        seq = Sequence(request_id, list(prompt_token_ids), len(prompt_token_ids), params, num_generated=num_generated,
                       lora_name=lora_name)
        if params.seed is not None:
            seq.generator = torch.Generator(self.runner.device)
        if params.structured_output is not None:
            self.structured.submit(seq)       # to the scheduler once its grammar is compiled
        else:
            self._enqueue(seq)

    def _validate_prompt(self, ids: list[int], params: SamplingParams) -> None:
        if not ids:
            raise ValueError("the prompt is empty")
        bad = next((t for t in ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise ValueError(f"token id {bad!r} is outside the vocabulary [0, {self.vocab_size})")
        named = list(params.stop_token_ids) + [int(t) for t, _ in params.logit_bias]
        bad = next((t for t in named if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise ValueError(f"token id {bad} in stop_token_ids or logit_bias is outside the vocabulary "
                             f"[0, {self.vocab_size})")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"the prompt has {len(ids)} tokens; this model's context is {self.max_model_len} "
                             "and at least one must remain for the output")
        total = len(ids) + params.max_tokens
        if total > self.max_model_len:
            raise ValueError(f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) = {total} "
                             f"exceeds the context length {self.max_model_len}")
        bm = self.block_manager
        if bm.most_blocks_held(total, self.config.max_num_batched_tokens) > bm.num_blocks:
            raise ValueError(f"prompt + max_tokens = {total} tokens can never fit the KV cache "
                             f"({bm.num_blocks * bm.block_size} tokens)")

    def abort_request(self, request_id: str) -> bool:
        """Free the request's blocks now; its abort output comes with the next step."""
        seq = self.structured.drop(request_id)
        if seq is not None:
            seq.finish_reason = "abort"
        else:
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
        return max(0, s.max_num_seqs - len(s.running) - len(s.waiting) - len(self.structured.pending))

    def between_steps(self) -> bool:
        """What an idle engine does at a step boundary: switch to the compiled forward where the
        background has loaded it (every forward pass does the same first), then back a slice of
        the KV cache's pages. True while such idle work remains (the caller comes back soon)."""
        self.runner.take_compiled()
        return self.runner.prefault_kv(PREFAULT_SLICE_S)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._pending_outputs) or bool(self.structured.pending)

    # ---- the step ------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One iteration: schedule, run the model, sample; returns every request's news since the
        last step (aborts included)."""
        self._admit_compiled()
        if self.kv is not None:
            self.kv.poll()
        outputs, self._pending_outputs = self._pending_outputs, []
        start = time.perf_counter()
        batch = self.scheduler.schedule()
        if self.kv is not None:
            self._after_schedule(batch)
        if batch.seqs:
            decoding = self.speculator is not None and all(s.num_computed_tokens == s.num_tokens - 1
                                                           for s in batch.seqs)
            outputs.extend(self._run(batch))
            if self.kv is not None:
                self.kv.observe_step(batch.num_tokens, time.perf_counter() - start)
            if self.speculator is not None:        # a step's time includes proposing the next drafts
                self.speculator.propose(self.scheduler.running)
                if decoding:
                    self.speculator.observe_step(sum(batch.num_new_tokens), time.perf_counter() - start)
        self._retire_loras()
        self.step_count += 1
        return outputs

    def _after_schedule(self, batch: ScheduledBatch) -> None:
        """Preempted sequences read all their stored chunks back (swap-in: the blocks they leave
        cached are the first to be evicted under the pressure that preempted them); with nothing
        to run but loads, wait a little for one rather than spin."""
        for seq in batch.preempted:
            self.kv.start_load(seq, 0)
        if not batch.seqs and self.kv.has_pending():
            self.kv.connector.wait(0.005)

    def _admit_compiled(self) -> None:
        """Constrained requests whose grammar is compiled go to the scheduler; failed ones end."""
        if not self.scheduler.has_unfinished() and not self._pending_outputs:
            self.structured.wait(0.005)        # nothing else to run: do not spin
        ready, failed = self.structured.take_ready()
        for seq in ready:
            self._enqueue(seq)
        for seq, error in failed:
            seq.finish_reason = "error"
            self._pending_outputs.append(self._output(seq, [], None, error))

    def _run(self, batch: ScheduledBatch) -> list[RequestOutput]:
        # Sample only for sequences whose whole context (and drafts) is computed after this step.
        rows = [i for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_new_tokens))
                if seq.num_computed_tokens + n == seq.num_tokens + len(seq.spec_token_ids)]
        spans, targets = self._prompt_logprob_spans(batch)
        counts = [1 + len(batch.seqs[i].spec_token_ids) for i in rows]
        logits, prompt_logits = self.runner.run(batch, rows, [(r, first, len(t)) for r, first, t in spans], counts,
                                                self._lora_slots(batch.seqs))
        if prompt_logits is not None:
            self._collect_prompt_logprobs(batch, spans, prompt_logits, targets)
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            seq.num_computed_tokens += n - len(seq.spec_token_ids)     # drafts count once accepted
            self.block_manager.computed(seq)
        if self.kv is not None:                # before finished sequences free their blocks
            self.kv.save_full_chunks(batch.seqs)
        if not rows:
            return []
        seqs = [batch.seqs[i] for i in rows]
        self.structured.apply_bitmasks(logits, seqs)
        scored = Speculator.expand(seqs) if len(logits) > len(seqs) else seqs
        sampled = self.sampler(logits, scored)
        verified = []              # (first row, tokens verified: the accepted drafts and the one after them)
        for seq, start, count in zip(seqs, np.cumsum([0] + counts), counts):
            accepted = self.speculator.accept(seq, sampled.token_ids[start:start + count]) if count > 1 else 0
            verified.append((start, accepted + 1))
        grammar = self.structured.accept(seqs, [sampled.token_ids[start:start + n] for start, n in verified])
        now = time.time()
        return [self._append(seq, sampled.token_ids[start:start + n], sampled.logprobs[start:start + n], g, now)
                for seq, (start, n), g in zip(seqs, verified, grammar)]

    def _append(self, seq: Sequence, tokens: list[int], logprobs: list, grammar: tuple[int, str | None],
                now: float) -> RequestOutput:
        """Add a step's verified tokens to `seq` up to the first that finishes it (`grammar`: its
        matcher's (n, state), see StructuredOutput.accept); release the blocks only rejected
        drafts used, and cache the blocks the accepted drafts filled (releasing those their window
        has passed)."""
        num_drafts, seq.spec_token_ids = len(tokens) - 1, []
        if not seq.first_token_time:
            seq.first_token_time = now
        end, state = grammar
        reason = None
        kept = 0
        for token in tokens:
            seq.token_ids.append(token)
            kept += 1
            if state is not None and kept == end:
                reason = "stop" if state == "terminated" else "error"
            else:
                reason = self._stop_reason(seq, token)
            if reason:
                break
        error = state if reason == "error" else None
        if num_drafts:
            seq.num_computed_tokens += min(num_drafts, kept)
            self.block_manager.computed(seq)
            self.block_manager.trim(seq)
        if reason:
            self.scheduler.finish(seq, reason)
        lps = [lp for lp in logprobs[:kept] if lp]
        out = self._output(seq, tokens[:kept], lps or None, error)
        if seq.params.prompt_logprobs is not None and seq.num_output_tokens == kept:
            out.prompt_logprobs = [None] + seq.prompt_logprobs
        return out

    @staticmethod
    def _prompt_logprob_spans(batch: ScheduledBatch) -> tuple[list[tuple[int, int, list[int]]], list[int]]:
        """For each sequence that still needs prompt logprobs: (batch row, first new token whose
        logits predict a prompt token not scored yet, the prompt tokens they predict); and all
        those target tokens in order."""
        spans, targets = [], []
        for row, (seq, n) in enumerate(zip(batch.seqs, batch.num_new_tokens)):
            if not seq.needs_prompt_logprobs:
                continue
            start = seq.num_computed_tokens
            first = len(seq.prompt_logprobs)          # position whose logits predict the next unscored token
            end = min(start + n, seq.num_prompt_tokens - 1)
            if first < start or first >= end:
                continue
            wanted = seq.token_ids[first + 1:end + 1]
            spans.append((row, first - start, wanted))
            targets += wanted
        return spans, targets

    def _collect_prompt_logprobs(self, batch: ScheduledBatch, spans, logits: torch.Tensor, targets: list[int]) -> None:
        k = max(batch.seqs[r].params.prompt_logprobs for r, _, _ in spans)
        scored = self.sampler.score(logits, targets, k)
        i = 0
        for row, _, wanted in spans:
            seq = batch.seqs[row]
            n = seq.params.prompt_logprobs
            for lp in scored[i:i + len(wanted)]:
                lp.top = lp.top[:n]
                seq.prompt_logprobs.append(lp)
            i += len(wanted)

    def _stop_reason(self, seq: Sequence, token: int) -> str | None:
        """The finish reason after `token` (vLLM's order: EOS, then stop token ids, then length);
        a stop token id is kept as the sequence's stop_reason. Nothing stops before min_tokens."""
        p = seq.params
        if seq.num_output_tokens >= p.min_tokens:
            if not p.ignore_eos and token in self.eos_token_ids:
                return "stop"
            if token in p.stop_token_ids:
                seq.stop_reason = token
                return "stop"
        if seq.num_output_tokens >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    @staticmethod
    def _output(seq: Sequence, tokens: list[int], logprobs, error: str | None = None) -> RequestOutput:
        return RequestOutput(seq.request_id, tokens, logprobs, seq.finish_reason, error, seq.num_prompt_tokens,
                             seq.num_cached_tokens, seq.num_output_tokens, seq.metrics(), seq.stop_reason)

    def stats(self) -> EngineStats:
        s, bm = self.scheduler, self.block_manager
        return EngineStats(
            num_running=len(s.running), num_waiting=len(s.waiting) + len(self.structured.pending),
            num_waiting_tokens=sum(q.num_tokens - q.num_computed_tokens for q in s.waiting),
            kv_cache_usage=bm.usage, prefix_cache_hit_rate=bm.prefix_cache_hit_rate,
            num_free_blocks=bm.num_free_blocks, num_blocks=bm.num_blocks, max_num_seqs=s.max_num_seqs,
            num_preemptions=s.num_preemptions, step_count=self.step_count,
            prefix_cache_queries=bm.num_queried_tokens, prefix_cache_hits=bm.num_hit_tokens,
            **self._spec_stats(), **self._kv_store_stats())

    def _kv_store_stats(self) -> dict:
        return {} if self.kv is None else self.kv.engine_stats()

    def _spec_stats(self) -> dict:
        if self.speculator is None:
            return {}
        st = self.speculator.stats
        return dict(spec_decode_num_drafts=st.num_drafts, spec_decode_num_draft_tokens=st.num_draft_tokens,
                    spec_decode_num_accepted_tokens=st.num_accepted_tokens,
                    spec_decode_accepted_per_position=list(st.accepted_per_position))

    @property
    def block_size(self) -> int:
        return self.block_manager.block_size

    def prefix_cache_version(self) -> int:
        """Changes whenever the set of cached block hashes does."""
        return self.block_manager.cache_version

    def cached_block_hashes(self) -> list[int]:
        return self.block_manager.cached_hashes()

    def check_block_accounting(self) -> None:
        """Assert that all blocks are free, cached or held by a live sequence (used by tests)."""
        self.block_manager.check_invariants(self.scheduler.running + list(self.scheduler.waiting))
