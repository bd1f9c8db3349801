"""Turns a scheduled batch into tensors, runs the model over the paged KV cache, returns logits."""
from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path

import numpy as np
import torch

from engine_worker.engine.scheduler import ScheduledBatch
from engine_worker.model.background_compile import BackgroundCompile
from engine_worker.model.compiled_forward import CompiledForward
from engine_worker.model.cuda_graphs import DecodeGraphRunner
from engine_worker.model.dtype_choice import DEFAULT_SHAPES, cpu_auto_dtype
from engine_worker.model.host_memory import Prefault, onto_huge_pages, zeros_on_huge_pages
from engine_worker.model.causal_lm import without_random_init
from engine_worker.model.checkpoint import stored_in_bf16
from engine_worker.model.config import ModelConfig
from engine_worker.model.packed_linear import PackedLinear
from engine_worker.model.registry import model_class
from engine_worker.model.tensor_parallel import (TPRank, check_splittable, kv_heads_of_rank, lora_shapes, shard_lora,
                                                 shard_model)
from engine_worker.model.lora_layers import LoraBatch, projection_shapes
from engine_worker.model.tp_comm import StepInputs
from engine_worker.model.tp_dist import check_joinable, rank_device, resolve_backend
from engine_worker.model.tp_ranks import RankGroup
from kernels.cpu_ops_build import cpu_ops_available
from kernels.interface import AttentionMetadata
from kernels.registry import get_attention_backend
from shared import gguf_quant
from shared.config import EngineConfig, parse_memory
from shared.gguf_quant import QUANTIZED_FILE
from shared.gguf_quant import PackedWeight
from shared.startup_stages import StartupStages, stage

log = logging.getLogger(__name__)

CPU_KV_CACHE_MEMORY = "1GiB"       # kv_cache_memory "auto" on the CPU

DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float32": torch.float32,
          "fp32": torch.float32, "float16": torch.float16, "fp16": torch.float16}
DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float32: "float32", torch.float16: "float16"}


def resolve_dtype(name: str, device: torch.device, shapes=DEFAULT_SHAPES) -> torch.dtype:
    """'auto' is bf16 on CUDA; on the CPU whichever of bf16 and fp32 runs GEMMs of `shapes` (the
    model's projections, (N, K)) faster here, measured once and cached (dtype_choice.py)."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else cpu_auto_dtype(shapes)
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; choose auto or one of {sorted(DTYPES)}") from None


def gemm_shapes(cfg: ModelConfig) -> tuple[tuple[int, int], ...]:
    """(N, K) of a layer's fused projections: qkv, o, gate_up, down."""
    return tuple((sum(parts), fan_in) for fan_in, parts in projection_shapes(cfg).values())


def kv_budget_from_profile(total: int, free: int, reserved: int, peak: int, utilization: float) -> int:
    """CUDA KV budget in bytes: `utilization` of the GPU's `total` memory, less this process's
    peak torch allocation during the warm-up profile (weights and activations, `peak`) and less
    the memory torch does not account for (CUDA context, other processes: total - free - reserved).
    """
    if not 0 < utilization <= 1:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {utilization}")
    non_torch = max(0, total - free - reserved)
    return int(total * utilization) - peak - non_torch


class ModelRunner:
    """`stages`: where the start-up's stages are recorded (kernels, weights, KV cache, compilation).
    `tp_rank`: this runner is rank 1.. of a tensor-parallel engine (tp_ranks.py starts it); where
    config.tensor_parallel_size > 1 and it is None, this runner is rank 0 and starts the others."""

    def __init__(self, config: EngineConfig, model_dir: str, stages: StartupStages | None = None,
                 tp_rank: TPRank | None = None):
        self.config = config
        self.device = torch.device(config.device)
        tp_backend = resolve_backend(config.tensor_parallel_backend, self.device)
        if config.tensor_parallel_size > 1:
            self.device = rank_device(self.device, 0 if tp_rank is None else tp_rank.rank)
        if config.num_threads > 0:
            torch.set_num_threads(config.num_threads)
        self.model_config = ModelConfig.from_dir(model_dir)
        self.dtype = resolve_dtype(config.dtype, self.device, gemm_shapes(self.model_config))
        self.ranks: RankGroup | None = None       # rank 0 of a tensor-parallel engine: the other ranks
        self.tp = tp_rank
        if config.tensor_parallel_size > 1 and tp_rank is None:
            self._check_tensor_parallel(tp_backend)
            self.ranks = RankGroup(config.with_overrides(dtype=DTYPE_NAMES[self.dtype]), model_dir, tp_backend,
                                   self.device)
            self.tp = self.ranks.tp
        if self.tp is not None and config.num_threads <= 0:
            torch.set_num_threads(len(os.sched_getaffinity(0)))     # its own cores (cpu_binding.py)
        self.kv_heads = self.model_config.num_kv_heads if self.tp is None else \
            kv_heads_of_rank(self.model_config, self.tp)
        with stage(stages, "kernels"):          # "auto" on the CPU builds the C++ kernels on first use
            self.backend = get_attention_backend(config.attention_backend, self.device, config.deterministic)
        self.block_size = getattr(self.backend, "REQUIRED_BLOCK_SIZE", None) or config.block_size
        if self.block_size != config.block_size:
            log.warning("attention backend %s needs block_size %d (configured %d); using %d",
                        self.backend.name, self.block_size, config.block_size, self.block_size)
        self.max_model_len = config.max_model_len or self.model_config.max_position_embeddings
        if self.max_model_len > self.model_config.max_position_embeddings:
            raise ValueError(f"max_model_len {self.max_model_len} exceeds the model's "
                             f"{self.model_config.max_position_embeddings} positions")
        with stage(stages, "weights"):
            self._load_model(model_dir)
        with stage(stages, "kv_cache"):
            self.max_loras, self.max_lora_rank = config.max_loras, config.max_lora_rank
            # the keys every layer still reads behind a query: a sequence's KV blocks beyond it are released
            window = self.model_config.window_of_every_layer
            self.kv_window = window if window < self.max_model_len else 0
            self.kv_dtype = self._kv_cache_dtype(self._quantized)
            self.num_blocks = self._num_blocks(self._kv_budget())
            if self.tp is not None and self.device.type == "cuda":    # each rank profiled its own GPU
                self.num_blocks = self.tp.comm.fewest(self.num_blocks)
            self.kv_caches = self._allocate_kv_cache()
            self.kv_prefault = Prefault([t for kv in self.kv_caches for t in kv] if self.device.type == "cpu" else [])
        self.graphs: DecodeGraphRunner | None = None
        self._lora_compiled = False
        self.compiled: CompiledForward | None = None
        self.background: BackgroundCompile | None = None     # a server's compile (on the CPU)
        if self.device.type == "cpu" and not config.enforce_eager:
            if config.offline or self.ranks is not None or self.tp is not None:   # every rank compiles in step
                with stage(stages, "compilation"):
                    self.compiled = self._compile()
            else:
                self._compile_in_background(stages)
        want_graphs = self.device.type == "cuda" and not config.enforce_eager
        if want_graphs and not self.backend.cuda_graph_safe:
            log.warning("attention backend %s cannot run in CUDA graphs; decode runs eagerly", self.backend.name)
        elif want_graphs:
            with stage(stages, "compilation"):
                self._capture_graphs()

    def _load_model(self, model_dir: str) -> None:
        """The model in its weight formats (quantized as stored, bf16-stored, packed), its weights loaded."""
        config = self.config
        cls = model_class(self.model_config.architecture)
        with without_random_init():
            self.model = cls(self.model_config, self.max_model_len).to(device=self.device, dtype=self.dtype)
        packed = self._quantized_weights(model_dir)
        self._quantized = bool(packed)          # the KV cache's "auto" dtype depends on it
        if packed:
            self.model.use_quantized(packed, self.dtype, config.deterministic)
        if self._keep_bf16(model_dir):
            log.info("%d matrices kept in bf16 as stored, widened to fp32 in the kernel",
                     self.model.use_bf16_weights(config.deterministic))
        self.model.load_weights(model_dir)
        self.model.eval()
        if self.tp is not None:
            shard_model(self.model, self.tp)
        # deterministic packs regardless: oneDNN's GEMM on packed weights computes a row the same
        # whatever the rows beside it, MKL's on plain ones does not (bench/results/batch_invariance)
        if (config.pack_cpu_weights or config.deterministic) and PackedLinear.supported(self.device, self.dtype):
            if not config.pack_cpu_weights:
                log.warning("--no-pack-cpu-weights does not apply with --deterministic: the weights are packed "
                            "(add --no-deterministic for plain ones)")
            self.model.pack_for_cpu()
        if self.device.type == "cpu":
            onto_huge_pages(self.model)

    def _check_tensor_parallel(self, backend: str) -> None:
        """ValueError, in one line, for what a tensor-parallel engine over `backend` cannot do (yet)."""
        config, flag = self.config, f"--tensor-parallel-size {self.config.tensor_parallel_size}"
        if self.device.type not in ("cpu", "cuda"):
            raise ValueError(f"{flag} runs on the CPU or on CUDA GPUs, not on {self.device.type}")
        if backend == "shm" and not cpu_ops_available():
            raise ValueError(f"{flag} needs the C++ CPU ops (its all-reduce is one of them)")
        if backend != "shm":
            check_joinable(backend, self.device, config.tensor_parallel_size)
        if config.kv_store_url:
            raise ValueError(f"{flag} does not support a shared KV store (--kv-store-url) yet")
        check_splittable(self.model_config, config.tensor_parallel_size)

    def _capture_graphs(self) -> None:
        config = self.config
        self.graphs = DecodeGraphRunner(
            self.model, self.kv_caches, self.backend,
            max_batch=max(1, min(config.max_num_seqs, config.max_cuda_graph_batch)),
            max_blocks_per_seq=-(-self.max_model_len // self.block_size),
            max_seqlen_k=self.max_model_len, device=self.device)
        self.graphs.capture()

    def _quantized_weights(self, model_dir: str) -> dict[str, PackedWeight]:
        """The GGUF's quantized matrices as stored, where the model has them, --quantization is
        auto and the CPU kernel loads; else none (the dequantized weights are used)."""
        path = Path(model_dir) / QUANTIZED_FILE
        if self.config.quantization not in ("auto", "none"):
            raise ValueError(f"unknown quantization {self.config.quantization!r}; choose auto or none")
        if self.config.quantization == "none" or not path.is_file():
            return {}
        if self.device.type != "cpu" or not cpu_ops_available():
            log.warning("the quantized weights in %s need the CPU kernel; using the dequantized ones", path)
            return {}
        packed = gguf_quant.load(path)
        log.info("%d matrices served quantized as stored (%s)", len(packed),
                 ", ".join(sorted({f"{w.kind}/{w.group}" for w in packed.values()})))
        return packed

    def _keep_bf16(self, model_dir: str) -> bool:
        """bf16-stored weights in an fp32 model on the CPU stay bf16 (half the memory and the bytes
        a step reads) where the CPU kernel loads; elsewhere they widen to fp32 at load."""
        return (self.device.type == "cpu" and self.dtype == torch.float32 and stored_in_bf16(model_dir)
                and cpu_ops_available())

    def _kv_cache_dtype(self, quantized: bool) -> torch.dtype:
        """--kv-cache-dtype: 'auto' is fp16 where the engine serves a GGUF's quantized weights as
        stored in fp32 and the attention backend reads a cache of another dtype than the model's (as
        llama.cpp keeps the same file's KV in f16: half an fp32 cache's bytes, and decode attention
        is bound by reading them), else the model's dtype (exact: greedy output as Hugging Face's).
        A 16-bit model keeps its own: fp16 would save no bytes, and a bf16 cache under bf16 queries
        takes the kernel's bf16 dot products and, with AMX, ATen's flash attention for prefill."""
        name = self.config.kv_cache_dtype
        any_dtype = self.backend.any_kv_dtype
        if name == "auto":
            return torch.float16 if quantized and any_dtype and self.dtype == torch.float32 else self.dtype
        if name not in DTYPES:
            raise ValueError(f"unknown kv_cache_dtype {name!r}; choose auto or one of {sorted(DTYPES)}")
        dtype = DTYPES[name]
        if dtype != self.dtype and not any_dtype:
            raise ValueError(f"attention backend {self.backend.name} needs the KV cache in the model's dtype "
                             f"({self.dtype}), not {dtype}")
        return dtype

    def _kv_budget(self) -> int:
        if self.config.kv_cache_memory != "auto":
            return parse_memory(self.config.kv_cache_memory)
        if self.device.type != "cuda":
            return parse_memory(CPU_KV_CACHE_MEMORY)
        peak = self._profile_peak_memory()
        free, total = torch.cuda.mem_get_info(self.device)
        budget = kv_budget_from_profile(total, free, torch.cuda.memory_reserved(self.device), peak,
                                        self.config.gpu_memory_utilization)
        log.info("KV cache budget %.2f GiB: %.0f%% of %.1f GiB less a profiled peak of %.2f GiB",
                 budget / 2**30, 100 * self.config.gpu_memory_utilization, total / 2**30, peak / 2**30)
        return budget

    @torch.inference_mode()
    def _profile_peak_memory(self) -> int:
        """Peak torch memory of the largest step: a prefill of max_num_batched_tokens tokens, split
        into sequences of at most max_model_len, with the logits of max_num_seqs rows. Its KV goes
        to a scratch cache that is not counted."""
        cfg, bs = self.model_config, self.block_size
        tokens = min(self.config.max_num_batched_tokens, self.max_model_len * self.config.max_num_seqs)
        lens = [min(self.max_model_len, tokens - start) for start in range(0, tokens, self.max_model_len)]
        blocks = [-(-n // bs) for n in lens]
        shape = (sum(blocks), bs, self.kv_heads, cfg.head_dim)
        scratch = [(torch.zeros(shape, dtype=self.kv_dtype, device=self.device),
                    torch.zeros(shape, dtype=self.kv_dtype, device=self.device)) for _ in range(cfg.num_layers)]
        scratch_bytes = sum(2 * k.numel() * k.element_size() for k, _ in scratch)
        tables, slots, first = [], [], 0
        for n, nb in zip(lens, blocks):                 # each sequence on consecutive scratch blocks
            tables.append(list(range(first, first + nb)) + [0] * (max(blocks) - nb))
            slots.extend(range(first * bs, first * bs + n))
            first += nb
        dev = self.device
        cu = torch.tensor([0] + lens, device=dev).cumsum(0).to(torch.int32)
        meta = AttentionMetadata(cu, torch.tensor(lens, dtype=torch.int32, device=dev),
                                 torch.tensor(tables, dtype=torch.int32, device=dev),
                                 torch.tensor(slots, dtype=torch.int64, device=dev),
                                 max(lens), max(lens), lens, lens)
        ids = torch.zeros(tokens, dtype=torch.int64, device=dev)
        pos = torch.cat([torch.arange(n, device=dev) for n in lens])
        torch.cuda.synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        hidden = self.model(ids, pos, scratch, meta, self.backend)
        self.model.compute_logits(hidden[:min(tokens, self.config.max_num_seqs)])
        torch.cuda.synchronize(dev)
        peak = torch.cuda.max_memory_allocated(dev) - scratch_bytes
        del scratch, hidden
        torch.cuda.empty_cache()
        return peak

    def _bytes_per_block(self) -> int:
        cfg = self.model_config
        elem = self.kv_dtype.itemsize
        return 2 * cfg.num_layers * self.block_size * cfg.num_kv_heads * cfg.head_dim * elem

    def _num_blocks(self, budget_bytes: int) -> int:
        num_blocks = budget_bytes // self._bytes_per_block()
        if num_blocks < 1:
            raise ValueError(f"kv_cache_memory {budget_bytes} B holds no block of {self._bytes_per_block()} B")
        return num_blocks

    def _allocate_kv_cache(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        cfg = self.model_config
        shape = (self.num_blocks, self.block_size, self.kv_heads, cfg.head_dim)

        def zeros() -> torch.Tensor:
            if self.device.type == "cpu":
                return zeros_on_huge_pages(shape, self.kv_dtype, commit=False)
            return torch.zeros(shape, dtype=self.kv_dtype, device=self.device)
        return [(zeros(), zeros()) for _ in range(cfg.num_layers)]

    def enable_lora(self) -> None:
        """Allocate the adapter slots (max_loras of rank max_lora_rank on every projection: 145 MB
        for SmolLM2 in fp32) at the first adapter, not before: an engine that never serves one
        keeps that memory. Then compile the forward for steps with adapter tokens, once: on every
        rank of a tensor-parallel engine (the compilation's warm-up step runs their all-reduces), in
        the background on a server of one rank (its steps with adapter tokens eager until then)."""
        if self.model.lora_enabled and (self.compiled is None or self._lora_compiled):
            return
        if self.ranks is not None:
            self.ranks.channel.send_start("enable_lora")
        if not self.model.lora_enabled:
            shapes = None if self.tp is None else lora_shapes(self.model)
            self.model.enable_lora(self.max_loras, self.max_lora_rank, self.dtype, self.device, shapes)
        if self.compiled is not None and not self._lora_compiled:
            if self.background is not None:
                self.background.start(lora=True)
            else:
                self.compiled.warm_up(lora=True)
                self._lora_compiled = True
        if self.ranks is not None:
            self.ranks.channel.wait_acks("enable_lora")

    def write_lora(self, slot: int, weights: dict | None) -> None:
        """Load an adapter's weights into `slot` (CausalLM.write_lora), each rank its share."""
        if self.ranks is not None:
            self.ranks.call("write_lora", slot, weights)
        self.model.write_lora(slot, weights if self.tp is None else shard_lora(self.model, weights))

    def _compile_in_background(self, stages: StartupStages | None) -> None:
        """A server is ready once it can serve eagerly. Where a child compiled this model's graphs
        before (warm caches), they are loaded now, in about a second, and its first step runs
        compiled; else a child compiles them and the runner switches to them when they are loaded
        (background_compile.py)."""
        self.background = BackgroundCompile(self.config, self.model, self.kv_caches, self._own_backend, self.dtype,
                                            self.max_loras, stages)
        if self.background.is_warm():
            with stage(stages, "compilation"):
                self.compiled = self._compile()
            if self.compiled is not None:
                return
        self.background.start()

    def _own_backend(self):
        return get_attention_backend(self.config.attention_backend, self.device, self.config.deterministic)

    def prefault_kv(self, budget_s: float) -> bool:
        """Back about budget_s worth of the KV cache's pages not yet backed (Prefault), on every
        rank at once; True while some remain."""
        if self.kv_prefault.done:
            return False
        if self.ranks is not None:
            self.ranks.channel.send_start("prefault_kv", budget_s)
        more = self.kv_prefault.run(budget_s)
        if self.ranks is not None:
            self.ranks.channel.wait_acks("prefault_kv")
        return more

    def take_compiled(self) -> None:
        """At a step boundary, the graphs the background has loaded: the whole forward switches
        at once (steps with adapter tokens when theirs are loaded too). Cheap when there are none."""
        bg = self.background
        if bg is None or not bg.pending():
            return
        compiled = bg.take(lora=False)
        if compiled is not None:
            self.compiled = compiled
            if self.model.lora_enabled:
                bg.start(lora=True)
        with_lora = bg.take(lora=True)
        if with_lora is not None and self.compiled is not None:
            self.compiled.adopt(with_lora, lora=True)
            self._lora_compiled = True

    def _compile(self) -> CompiledForward | None:
        """The compiled CPU forward, or None (eager, with a warning) where Inductor cannot build
        it: its C++ code generation needs a C++ compiler, which a slim image may lack."""
        try:
            compiled = CompiledForward(self.model, self.kv_caches, self.backend, self.dtype, self.max_loras)
            compiled.warm_up()
            return compiled
        except Exception as e:      # InductorError (no compiler), a failed build, ...
            log.warning("torch.compile is unavailable here, running the eager model: %s: %s",
                        type(e).__name__, str(e).splitlines()[0] if str(e) else "")
            torch._dynamo.reset()
            return None

    def prepare(self, batch: ScheduledBatch, lora_slots: list[int] | None = None, host: bool = False
                ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, LoraBatch | None]:
        """Pack the step's new tokens of every sequence, with positions, slots and block tables,
        and its adapter tokens by slot (`lora_slots`: each sequence's adapter slot, -1 for the
        base model; None when no sequence uses an adapter). Per-token values (positions, slots) come
        from numpy ops over the batch, not Python loops. `host`: the tensors in host memory, for
        the step channel (on_device moves them)."""
        seqs, qlens = batch.seqs, batch.num_new_tokens
        klens = [seq.num_computed_tokens + n for seq, n in zip(seqs, qlens)]
        input_ids: list[int] = []
        for seq, n, end in zip(seqs, qlens, klens):
            if seq.spec_token_ids:           # the last token, then the drafts to verify
                input_ids += seq.token_ids[end - n:] + seq.spec_token_ids
            else:
                input_ids += seq.token_ids[end - n:end]
        width = max(len(seq.block_table) for seq in seqs)
        tables = np.array([seq.block_table + [-1] * (width - len(seq.block_table)) for seq in seqs], dtype=np.int32)
        q = np.array(qlens, dtype=np.int64)
        k = np.array(klens, dtype=np.int32)
        cu = np.zeros(len(seqs) + 1, dtype=np.int32)
        np.cumsum(q, out=cu[1:])
        if len(input_ids) == len(seqs):      # decode-only: one token per sequence, at klens - 1
            seq_of_token, positions = np.arange(len(seqs)), k.astype(np.int64) - 1
        else:                                # token t of sequence i sits at klens[i] - qlens[i] + t - cu[i]
            seq_of_token = np.repeat(np.arange(len(seqs)), q)
            positions = np.arange(len(input_ids), dtype=np.int64) + np.repeat(k - q - cu[:-1], q)
        bs = self.block_size
        slots = tables[seq_of_token, positions // bs].astype(np.int64) * bs + positions % bs
        dev = torch.device("cpu") if host else self.device
        meta = AttentionMetadata(
            cu_seqlens_q=torch.from_numpy(cu).to(dev), seqlens_k=torch.from_numpy(k).to(dev),
            block_tables=torch.from_numpy(tables).to(dev), slot_mapping=torch.from_numpy(slots).to(dev),
            max_seqlen_q=max(qlens), max_seqlen_k=max(klens), seqlens_q_list=qlens, seqlens_k_list=klens)
        ids = torch.tensor(input_ids, dtype=torch.int64, device=dev)
        lora = None
        if lora_slots is not None:
            lora = LoraBatch.for_step(np.array(lora_slots, dtype=np.int64)[seq_of_token], self.max_loras,
                                      self.dtype, self.device, at=dev)
        return ids, torch.from_numpy(positions).to(dev), meta, lora

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, pos: torch.Tensor, meta: AttentionMetadata, lora: LoraBatch | None
                ) -> torch.Tensor:
        """The model's hidden states [T, hidden] of a prepared step."""
        if (self.graphs is not None and lora is None and meta.is_decode_only
                and meta.num_seqs <= self.graphs.max_batch):       # graphs are captured without LoRA
            return self.graphs.run(ids, pos, meta)
        if self.compiled is not None and (lora is None or self._lora_compiled):
            return self.compiled(ids, pos, meta, lora)
        return self.model(ids, pos, self.kv_caches, meta, self.backend, lora)

    def close(self) -> None:
        """Stop a tensor-parallel engine's other ranks."""
        if self.ranks is not None:
            self.ranks.close()

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch, sample_rows: list[int], prompt_spans: list[tuple[int, int, int]] = (),
            sample_counts: list[int] | None = None, lora_slots: list[int] | None = None
            ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One forward pass; returns fp32 logits [sum(sample_counts), vocab] of the last
        sample_counts[i] (default 1: speculative drafts add theirs) tokens of the sequences at
        `sample_rows` (those whose whole context is computed after this step) and, for prompt
        logprobs, the logits of every token that `prompt_spans` names: (batch row, first of its
        new tokens, count), in order (None when there are none). `lora_slots`: see prepare."""
        self.take_compiled()
        host = self.ranks is not None and self.device.type != "cpu"      # the step channel carries host tensors
        ids, pos, meta, lora = self.prepare(batch, lora_slots, host)
        rows = self._logit_rows(batch, sample_rows, sample_counts)
        prompt_rows = None
        if prompt_spans:
            starts = np.concatenate([[0], np.cumsum(batch.num_new_tokens)])
            prompt_rows = torch.from_numpy(np.concatenate(
                [np.arange(starts[r] + first, starts[r] + first + n) for r, first, n in prompt_spans]))
        if self.ranks is not None:          # the rows too: every rank computes its slice of their logits
            self.ranks.send(ids, pos, meta, lora, rows, prompt_rows)
        if host:
            ids, pos, meta, lora = self.on_device(ids, pos, meta, lora)
        return self._logits(self.forward(ids, pos, meta, lora), rows, prompt_rows)

    @torch.inference_mode()
    def follow(self, step: StepInputs) -> None:
        """Rank 1..'s share of the step rank 0 runs (run): the forward, then its slice of the same logits."""
        ids, pos, meta, lora = step.ids, step.positions, step.meta, step.lora
        if self.device.type != "cpu":
            ids, pos, meta, lora = self.on_device(ids, pos, meta, lora)
        self._logits(self.forward(ids, pos, meta, lora), step.rows, step.prompt_rows)

    def on_device(self, ids: torch.Tensor, pos: torch.Tensor, meta: AttentionMetadata, lora: LoraBatch | None
                  ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, LoraBatch | None]:
        """A step's inputs in host memory (prepare's with `host`, the step channel's) on this rank's device."""
        dev = self.device
        meta = dataclasses.replace(meta, cu_seqlens_q=meta.cu_seqlens_q.to(dev), seqlens_k=meta.seqlens_k.to(dev),
                                   block_tables=meta.block_tables.to(dev), slot_mapping=meta.slot_mapping.to(dev))
        lora = None if lora is None else LoraBatch(*(t.to(dev) for t in lora.args()))
        return ids.to(dev), pos.to(dev), meta, lora

    @staticmethod
    def _logit_rows(batch: ScheduledBatch, sample_rows: list[int], sample_counts: list[int] | None) -> torch.Tensor:
        """The step's hidden rows whose logits are sampled (run): int64, on the CPU."""
        ends = np.cumsum(np.asarray(batch.num_new_tokens, dtype=np.int64))[np.asarray(sample_rows, dtype=np.int64)]
        if sample_counts is None or all(c == 1 for c in sample_counts):
            return torch.from_numpy(ends - 1)
        return torch.from_numpy(np.concatenate([np.arange(e - c, e) for e, c in zip(ends, sample_counts)]))

    def _logits(self, hidden: torch.Tensor, rows: torch.Tensor, prompt_rows: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The logits of `rows` and of `prompt_rows` (first: every rank gathers in the same order)."""
        dev = self.device
        prompt_logits = None if prompt_rows is None else self.model.compute_logits(hidden[prompt_rows.to(dev)])
        return self.model.compute_logits(hidden[rows.to(dev)]), prompt_logits
