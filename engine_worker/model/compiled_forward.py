"""The model forward with its decoder layers compiled by torch.compile (Inductor's C++/OpenMP
codegen) for the CPU: regional compilation, one graph per structure of a region of consecutive
layers (graph_signature), traced and built once and called for every region of that structure, so
a cold start compiles a region, not the whole model. The embedding, the step's rotary cos/sin and the final norm run eagerly.

Inductor fuses the elementwise work between the projections (RMSNorm, RoPE, SiLU * up, the
residual adds); the projections and paged attention stay library calls. The KV write and paged
attention are custom ops (``kaiten::write_kv``, ``kaiten::paged_attention``), opaque to the
compiler, so the graph never breaks: they take the metadata as tensors and find the attention
backend by name, so any AttentionBackend plugs in.

A backend plans attention once per step from the metadata's host lists (AttentionMetadata), which
cannot cross the op boundary. The runner therefore registers the step's backend and metadata in
STEP_CONTEXT_CACHE (per thread) before calling the compiled forward; an op whose metadata tensors
are that step's uses them (one plan per step, as in eager mode). Called outside such a step, an
op rebuilds the metadata from its tensors and uses BACKEND_CACHE's instance of the backend.

The token count and the batch's shape vary per step: they are dynamic dimensions, without
specialising on 0 or 1 (unbacked sizes), so one graph serves every step. Tensors of one length
share one size (shape_id): the graph takes five sizes a step, where a size per tensor, every
layer's K and V pool its own, made 67 for SmolLM2 and a one-stream decode step 1.06x the time
(bench/engine/graph_sizes.py).

The graph's wrapper, which calls its kernels and ops in order, is C++ (Inductor's cpp_wrapper),
not Python: a SmolLM2 step makes about 270 such calls (9 a layer), and made from C++ they left a
whole-model graph's one-stream step 0.88x the time (Zen 4, Q8_0 weights, 7.6 against 8.7 ms), for about 30 s more of a cold start
(89 against 57 s from a new GGUF file).
"""
from __future__ import annotations

import contextlib
import dataclasses
import enum
import hashlib
import itertools
import logging
import os
import re
import threading
import time
import types
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from engine_worker.model.lora_layers import LoraBatch
from kernels.interface import AttentionBackend, AttentionMetadata, TwoCalls
from kernels.registry import get_attention_backend

log = logging.getLogger(__name__)

BACKEND_CACHE: dict[str, AttentionBackend] = {}     # backends by name, for ops called outside a step
STEP_CONTEXT_CACHE = threading.local()              # .backend, .meta: the step this thread runs


def _backend(name: str, device: torch.device) -> AttentionBackend:
    """The step's backend when it is the one named, else BACKEND_CACHE's."""
    backend = getattr(STEP_CONTEXT_CACHE, "backend", None)
    if backend is not None and backend.name == name:
        return backend
    if name not in BACKEND_CACHE:
        BACKEND_CACHE[name] = get_attention_backend(name, device)
    return BACKEND_CACHE[name]


def _metadata(cu_seqlens_q: torch.Tensor, seqlens_k: torch.Tensor, block_tables: torch.Tensor) -> AttentionMetadata:
    """The step's metadata when these are its tensors, else one built from them."""
    meta = getattr(STEP_CONTEXT_CACHE, "meta", None)
    if (meta is not None and meta.cu_seqlens_q.data_ptr() == cu_seqlens_q.data_ptr()
            and meta.seqlens_k.data_ptr() == seqlens_k.data_ptr()
            and meta.block_tables.data_ptr() == block_tables.data_ptr()
            and meta.block_tables.shape == block_tables.shape):
        return meta
    qlens, klens = torch.diff(cu_seqlens_q).tolist(), seqlens_k.tolist()
    return AttentionMetadata(cu_seqlens_q, seqlens_k, block_tables, torch.empty(0, dtype=torch.int64),
                             max(qlens, default=0), max(klens, default=0), qlens, klens)


@torch.library.custom_op("kaiten::write_kv", mutates_args=("k_cache", "v_cache"))
def write_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, backend: str) -> None:
    """The step's new K/V into the paged cache (slot -1: skipped)."""
    _backend(backend, key.device).write_kv(key, value, k_cache, v_cache, slot_mapping)


@write_kv.register_fake
def _write_kv_fake(key, value, k_cache, v_cache, slot_mapping, backend):
    return None


@torch.library.custom_op("kaiten::paged_attention", mutates_args=())
def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    cu_seqlens_q: torch.Tensor, seqlens_k: torch.Tensor, block_tables: torch.Tensor,
                    scale: float, backend: str, window: int = 0) -> torch.Tensor:
    """q [T, H, D] against the paged cache -> [T, H, D] (kernels/interface.py's contract; window:
    the layer's sliding window, 0 for none)."""
    meta = _metadata(cu_seqlens_q, seqlens_k, block_tables)
    out = _backend(backend, q.device).attention(q, k_cache, v_cache, meta, scale, window)
    return out.clone() if out is q else out         # a custom op's output must not alias an input


@paged_attention.register_fake
def _paged_attention_fake(q, k_cache, v_cache, cu_seqlens_q, seqlens_k, block_tables, scale, backend, window=0):
    return torch.empty_like(q)


class OpAttention(TwoCalls):
    """An AttentionBackend for the model inside torch.compile: it forwards to the custom ops,
    which call the backend named `name` (for backends that are not compile_safe)."""

    cuda_graph_safe = False
    compile_safe = True

    def __init__(self, name: str):
        self.name = name

    def write_kv(self, key, value, k_cache, v_cache, slot_mapping) -> None:
        torch.ops.kaiten.write_kv(key, value, k_cache, v_cache, slot_mapping, self.name)

    def attention(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float, window: int = 0) -> torch.Tensor:
        return torch.ops.kaiten.paged_attention(q, k_cache, v_cache, meta.cu_seqlens_q, meta.seqlens_k,
                                                meta.block_tables, scale, self.name, window)


@contextlib.contextmanager
def step_context(backend: AttentionBackend, meta: AttentionMetadata):
    """Registers the step's backend and metadata for the ops (see the module docstring)."""
    STEP_CONTEXT_CACHE.backend, STEP_CONTEXT_CACHE.meta = backend, meta
    try:
        yield
    finally:
        STEP_CONTEXT_CACHE.backend = STEP_CONTEXT_CACHE.meta = None


def inductor_cache_dir() -> Path:
    """Where Inductor keeps compiled artifacts across restarts: TORCHINDUCTOR_CACHE_DIR if set,
    else ~/.cache/kaiten/inductor."""
    return Path(os.environ.get("TORCHINDUCTOR_CACHE_DIR") or Path.home() / ".cache" / "kaiten" / "inductor")


def ops_schema_tag() -> str:
    """A digest of every kaiten:: and kaiten_cpu:: op's schema. Inductor's graph cache keys a graph
    by its code, in which a call that leaves an argument at its default reads the same under an
    older schema without it: compiled code for the old schema would be loaded and call the op
    with too few arguments (a segmentation fault). The tag is part of every key."""
    names = sorted(n for n in torch._C._dispatch_get_all_op_names() if n.startswith(("kaiten::", "kaiten_cpu::")))
    schemas = "\n".join(str(s) for n in names for s in torch._C._jit_get_schemas_for_operator(n))
    return "kaiten-ops-" + hashlib.sha1(schemas.encode()).hexdigest()[:12]


def configure_inductor() -> None:
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(inductor_cache_dir()))
    torch.compiler.config.cache_key_tag = ops_schema_tag()
    import torch._inductor.config as inductor_config
    inductor_config.fx_graph_cache = True
    inductor_config.autotune_local_cache = True
    # Off: the generated wrapper's checks, every step, of each input's and op output's size and
    # stride against the traced ones (about 400 Python calls a SmolLM2 step, 4-12% of a one-stream
    # step). A debugging aid; the tests compare the compiled model's outputs instead.
    inductor_config.size_asserts = False
    inductor_config.alignment_asserts = False
    # On: Inductor takes the vector ISA that the CPU's flags and ATen's capability name instead
    # of building and loading a probe library in six subprocesses first (1.2 s of a 2.9 s load
    # from warm caches); the C++ ops' build needs a compiler for that ISA already.
    inductor_config.cpp.vec_isa_ok = True
    # On: Dynamo keeps what it traced (bytecode and the backend's artifacts) in the cache folder
    # too, so a start with warm caches loads a region's graph without tracing its layers again:
    # 1.3 s against 5.5 s for SmolLM2's 15-layer regions (bench/results/cold_start/README.md).
    # Its key is the function's qualified name: compiled_layer_for names each copy by its
    # graph signature. Saved after each compile (save_traced_regions).
    torch._dynamo.config.caching_precompile = True


# A global that Dynamo installs in a traced function's module: `__builtins_dict___0`,
# `__compiled_fn_1_<uuid>`; the number is from one counter of the process that traced it.
_DYNAMO_GLOBAL = re.compile(r"^__\w*?_(\d+)(?:_[0-9a-f]{8}(?:_[0-9a-f]{4}){3}_[0-9a-f]{12})?$")


def skip_loaded_globals() -> None:
    """Move Dynamo's name counter past the globals that graphs loaded from its cache installed
    here (numbered in the process that traced them), before this process traces: else a name
    clashes ("already exists in scope") and the compile fails."""
    from torch._dynamo import bytecode_transformation
    taken = [int(m.group(1)) for name in list(_layers.__globals__) if (m := _DYNAMO_GLOBAL.match(name))]
    if taken:
        start = max(max(taken) + 1, next(bytecode_transformation._unique_id_counter))
        bytecode_transformation._unique_id_counter = itertools.count(start)


def save_traced_regions() -> None:
    """Write what Dynamo traced in this process to its cache (caching_precompile, above)."""
    from torch._dynamo.precompile_context import PrecompileContext
    PrecompileContext.save_to_dynamo_cache()
    torch._functorch.config.enable_autograd_cache = True


# The most consecutive layers compiled as one region. One layer a region compiles fastest, but
# every compiled call costs Dynamo's and AOTAutograd's wrappers: on SmolLM2 a one-stream decode step
# took 1.90x the whole model's graph's time with a call a layer; 15-layer regions took 0.97x the CPU
# time of 6-layer ones (32 streams 0.99x), for 43 s of cold compilation against 25 s, which the
# background compilation keeps off the path to ready (bench/results/step_cpu_ab/README.md).
REGION_LAYERS = 15


def region_layers(n: int, signature_of: Callable[[int, int], tuple]) -> int:
    """Layers a region for a model of n layers: the largest size up to REGION_LAYERS that splits
    them into equal regions of one structure (signature_of(start, size): the region's
    graph_signature), so that one graph serves every region; at least a third of REGION_LAYERS
    (or all n), else REGION_LAYERS with a shorter last region (two graphs)."""
    least = min(n, max(1, REGION_LAYERS // 3))
    for size in range(min(REGION_LAYERS, n), least - 1, -1):
        if n % size == 0 and len({signature_of(i, size) for i in range(0, n, size)}) == 1:
            return size
    return min(REGION_LAYERS, n)


def _layers(layers, x, ropes, kv_caches, backend, cu_seqlens_q, seqlens_k, block_tables, slot_mapping,
            *lora_args):
    """Consecutive decoder layers (a ModuleList); `ropes`: the step's (cos, sin) of each rotary
    table, computed once a step."""
    meta = AttentionMetadata(cu_seqlens_q, seqlens_k, block_tables, slot_mapping, 0, 0)
    lora = LoraBatch(*lora_args) if lora_args else None
    for layer, kv_cache in zip(layers, kv_caches):
        x = layer(x, ropes, kv_cache, meta, backend, lora)
    return x


COMPILED_LAYER_CACHE: dict[tuple, Callable] = {}     # compiled copies of _layers by graph_signature


def compiled_layer_for(signature: tuple) -> Callable:
    """_layers compiled for one graph_signature: a copy with its own code object, so Dynamo's
    cache for it holds that structure's graph alone and needs none of its guards (about 3,700
    checks of the weights, modules and inputs a SmolLM2 step, 0.8 ms of a 6 ms one-stream step).
    Layers of the same signature, in one model or in several, share the copy: their weights are
    graph inputs. The copy is named by the signature's hash, which keys its traced graph on
    disk (configure_inductor)."""
    fn = COMPILED_LAYER_CACHE.get(signature)
    if fn is None:
        name = f"_layers_{hashlib.sha1(repr(signature).encode()).hexdigest()[:16]}"
        code = _layers.__code__.replace(co_name=name, co_qualname=name)
        copy = types.FunctionType(code, _layers.__globals__, name)
        fn = torch.compile(copy, dynamic=False, fullgraph=True,
                           options={"guard_filter_fn": torch.compiler.skip_all_guards_unsafe, "cpp_wrapper": True})
        COMPILED_LAYER_CACHE[signature] = fn
    return fn


def graph_signature(modules: tuple[torch.nn.Module, ...], kv_caches, ops, lora: bool) -> tuple:
    """What the traced graph depends on, as the skipped guards would have checked it: every
    module's class and plain attributes (sizes, formats, configs), every parameter's and buffer's
    shape, stride and dtype, the KV caches' but for their dynamic first dimension, the attention
    ops, and whether the step carries adapter tokens. Values the forward reads must not change
    after the first call (the adapters' slots are written in place; the model's weights may)."""
    described = tuple((i, name, type(m).__qualname__, _attributes(m), _tensors(m._parameters), _tensors(m._buffers))
                      for i, module in enumerate(modules) for name, m in module.named_modules(remove_duplicate=False))
    caches = tuple((k.shape[1:], k.stride()[1:], k.dtype, v.shape[1:], v.stride()[1:], v.dtype) for k, v in kv_caches)
    return described, caches, (type(ops).__qualname__, _attributes(ops)), lora


def _attributes(obj) -> tuple:
    return tuple(sorted((k, _describe(v)) for k, v in vars(obj).items() if not k.startswith("_")))


def _tensors(named: dict) -> tuple:
    return tuple((k, _describe(t)) for k, t in named.items())


def _describe(value):
    if isinstance(value, torch.Tensor):
        return tuple(value.shape), value.stride(), value.dtype, value.device.type
    if value is None or isinstance(value, (bool, int, float, str, torch.dtype, torch.device)):
        return value
    if isinstance(value, (tuple, list)):
        return tuple(_describe(v) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((repr(k), _describe(v)) for k, v in value.items()))
    if dataclasses.is_dataclass(value) or isinstance(value, enum.Enum):
        return repr(value)
    return type(value).__qualname__          # a module (described by its own name) or a helper object


class CompiledForward:
    """model(input_ids, positions, kv_caches, meta, backend) with its decoder layers through
    torch.compile (regional compilation); call warm_up() once at start-up.

    The layers run in regions of consecutive layers (region_layers); a region's compiled function
    is traced and built once for every region of one structure (graph_signature), not once for
    the whole model: the compile time does not grow with the layers beyond a region's. The
    embedding, the rotary cos/sin and the final norm run eagerly.

    A region's layers, their KV caches and the backend are arguments of the compiled function,
    not constants: the weights are graph inputs, so the other regions, and another engine with
    the same model config in this process, reuse the graph instead of compiling their own.

    A step with adapter tokens passes its LoraBatch: a second graph, with the LoRA op, that
    warm_up(lora=True) compiles (the engine does when it gets its first adapter), so steps of
    the base model alone never run it."""

    def __init__(self, model: torch.nn.Module, kv_caches, backend: AttentionBackend, dtype: torch.dtype,
                 max_loras: int = 0):
        configure_inductor()
        self.model, self.kv_caches, self.backend = model, kv_caches, backend
        self.dtype, self.max_loras = dtype, max_loras           # the activations' dtype (the cache's may differ)
        self.ops = backend if backend.compile_safe else OpAttention(backend.name)
        # The pool's size differs between engines; every layer's K and V pool has the same one, a
        # single size the graph takes (a size of its own for each was 60 int arguments a step).
        for k_cache, v_cache in kv_caches:
            torch._dynamo.decorators.mark_unbacked(k_cache, 0, shape_id="kv_blocks")
            torch._dynamo.decorators.mark_unbacked(v_cache, 0, shape_id="kv_blocks")
        n = len(model.layers)
        size = region_layers(n, lambda i, size: graph_signature(
            (torch.nn.ModuleList(model.layers[i:i + size]), model.ropes), kv_caches[i:i + size], self.ops, False))
        self.regions = [(torch.nn.ModuleList(model.layers[i:i + size]), kv_caches[i:i + size])
                        for i in range(0, n, size)]
        self._fns: dict[bool, tuple[Callable, ...]] = {}    # each region's, by "the step has adapter tokens"

    def __call__(self, ids: torch.Tensor, pos: torch.Tensor, meta: AttentionMetadata,
                 lora: LoraBatch | None = None) -> torch.Tensor:
        model = self.model
        x = model.embed(ids)
        ropes = [rope(pos, x.dtype) for rope in model.ropes]
        fns = self._fns.get(lora is not None)
        tracing = fns is None
        if tracing:
            fns = self._fns[lora is not None] = self._first_call(ropes, meta, lora)
            skip_loaded_globals()
        extra = () if lora is None else lora.args()
        args = (self.ops, meta.cu_seqlens_q, meta.seqlens_k, meta.block_tables, meta.slot_mapping, *extra)
        with step_context(self.backend, meta):
            for (layers, kv_caches), fn in zip(self.regions, fns):
                if tracing:         # any region may be the first of its structure, traced now
                    torch._dynamo.decorators.mark_unbacked(x, 0, shape_id="tokens")
                x = fn(layers, x, ropes, kv_caches, *args)
        return model.norm(x)

    def _first_call(self, ropes, meta: AttentionMetadata, lora: LoraBatch | None) -> tuple[Callable, ...]:
        """Each region's compiled function for steps of this kind. A graph, if this call traces
        it, takes the token count and the batch's shape as dynamic sizes, each tensor of the same
        length sharing one size (shape_id); later calls check nothing."""
        for t in (meta.slot_mapping, *(t for cos_sin in ropes for t in cos_sin)):
            torch._dynamo.decorators.mark_unbacked(t, 0, shape_id="tokens")
        for t in (meta.seqlens_k, meta.block_tables):
            torch._dynamo.decorators.mark_unbacked(t, 0, shape_id="seqs")
        torch._dynamo.decorators.mark_unbacked(meta.cu_seqlens_q, 0)
        torch._dynamo.decorators.mark_unbacked(meta.block_tables, 1)
        if lora is not None:
            for t in (lora.token_index, lora.pad_index, lora.pad_rows):
                torch._dynamo.decorators.mark_unbacked(t, 0)
        return tuple(compiled_layer_for(signature) for signature in self.signatures(lora is not None))

    def adopt(self, other: CompiledForward, lora: bool) -> None:
        """Take `other`'s graphs (built over the same model) for one kind of step: a background
        thread loads them on a forward of its own, with a backend of its own, while this one serves."""
        self._fns[lora] = other._fns[lora]

    def signatures(self, lora: bool) -> tuple[tuple, ...]:
        """Each region's graph_signature for steps with (`lora`) or without adapter tokens."""
        return tuple(graph_signature((layers, self.model.ropes), kv_caches, self.ops, lora)
                     for layers, kv_caches in self.regions)

    @torch.inference_mode()
    def warm_up(self, lora: bool = False) -> float:
        """Compile (or load from Inductor's cache) before the first request: one graph for the
        layers of each structure serves every batch shape (`lora`: the graphs for steps with
        adapter tokens). The warm-up batch writes no KV (slot -1). Its inputs are inference
        tensors, as the runner's are (a tensor of another kind would fail a guard and recompile).
        Returns the seconds taken."""
        start = time.perf_counter()
        log.info("compiling the model's layers for %s%s ...", self.model.__class__.__name__,
                 " with LoRA" if lora else "")
        dev = self.kv_caches[0][0].device
        lens = [3, 1]
        meta = AttentionMetadata(
            cu_seqlens_q=torch.tensor([0, 3, 4], dtype=torch.int32, device=dev),
            seqlens_k=torch.tensor(lens, dtype=torch.int32, device=dev),
            block_tables=torch.zeros((2, 1), dtype=torch.int32, device=dev),
            slot_mapping=torch.full((4,), -1, dtype=torch.int64, device=dev),
            max_seqlen_q=3, max_seqlen_k=3, seqlens_q_list=lens, seqlens_k_list=lens)
        ids = torch.zeros(4, dtype=torch.int64, device=dev)
        pos = torch.tensor([0, 1, 2, 0], dtype=torch.int64, device=dev)
        batch = LoraBatch.for_step(np.array([0, -1, 0, -1]), self.max_loras, self.dtype, dev) \
            if lora else None
        self(ids, pos, meta, batch)
        save_traced_regions()
        seconds = time.perf_counter() - start
        graphs = len(set(self._fns[lora]))
        log.info("compiled the model in %.1f s: %d graph%s for %d regions of up to %d layers (Inductor cache: %s)",
                 seconds, graphs, "" if graphs == 1 else "s", len(self.regions), len(self.regions[0][0]),
                 os.environ["TORCHINDUCTOR_CACHE_DIR"])
        return seconds
