"""The decoder-only causal LM that every family is, and what the engine does to one: load its
weights, swap in quantized, bf16-stored or oneDNN-packed projections, and give it LoRA slots.

The calling contract of a model, for every family and on every path (eager, compiled, CUDA
graphs):

    hidden = model(input_ids, positions, kv_caches, meta, backend, lora)
        input_ids, positions  int64 [T]: the step's new tokens, packed varlen (kernels/interface.py)
        kv_caches             each layer's (k_cache, v_cache); the step's K/V are written to them
        meta, backend         AttentionMetadata and the AttentionBackend that reads it
        lora                  the step's adapter tokens (LoraBatch), or None
        -> hidden states [T, hidden_size]
    logits = model.compute_logits(hidden[rows])   -> fp32 [rows, vocab_size]

A family (engine_worker/model/models/) subclasses CausalLM and builds its decoder layers from the
shared ones (engine_worker/model/layers/). Everything else here reads the family's table of fused
projections (`projections`): which checkpoint modules each one stacks (q/k/v into qkv_proj,
gate/up into gate_up_proj), so weight loading, quantized weights, CPU packing and LoRA work
from the table, not from one family's names.
"""
from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from engine_worker.model.bf16_layers import Bf16Embedding, Bf16Linear
from engine_worker.model.checkpoint import count_tensors, tensors, weight_files
from engine_worker.model.config import SLIDING, ModelConfig
from engine_worker.model.layers.norm import RMSNorm
from engine_worker.model.layers.rotary import RotaryEmbedding, inverse_frequencies, rope_parameters
from engine_worker.model.lora_layers import LoraBatch, LoraStack, projection_shapes
from engine_worker.model.packed_linear import PackedLinear
from engine_worker.model.quant_layers import QuantEmbedding, QuantLinear
from shared.gguf_quant import PackedWeight, concat
from shared.progress import Progress


@dataclass(frozen=True, slots=True)
class Projection:
    """A fused projection of every decoder layer: `key` names its LoRA stack and its shapes
    (lora_layers.projection_shapes), `path` is the module within a layer, `parts` the checkpoint
    modules it stacks by rows, in order (a checkpoint may also hold it fused, under `path`)."""
    key: str
    path: str
    parts: tuple[str, ...] = ()


PROJECTIONS = (
    Projection("qkv", "self_attn.qkv_proj", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
    Projection("o", "self_attn.o_proj"),
    Projection("gate_up", "mlp.gate_up_proj", ("mlp.gate_proj", "mlp.up_proj")),
    Projection("down", "mlp.down_proj"),
)


RANDOM_INITS = ("uniform_", "normal_", "kaiming_uniform_", "kaiming_normal_", "xavier_uniform_",
                "xavier_normal_", "trunc_normal_")


@contextlib.contextmanager
def without_random_init():
    """Build modules without their parameters' random initialisation (torch.nn.init's random
    fills do nothing meanwhile): every parameter is then loaded from the checkpoint, or
    load_weights raises. It was 0.6 s of an 8 s start for SmolLM2 (bench/results/cold_start).
    Only for start-up, while no other thread builds modules."""
    saved = {name: getattr(nn.init, name) for name in RANDOM_INITS}
    for name in RANDOM_INITS:
        setattr(nn.init, name, lambda tensor, *args, **kwargs: tensor)
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(nn.init, name, fn)


class CausalLM(nn.Module):
    projections: ClassVar[tuple[Projection, ...]] = PROJECTIONS
    norm_offset: ClassVar[bool] = False            # the final norm scales by 1 + w (Gemma)
    ignored_weights: ClassVar[tuple[str, ...]] = ("rotary_emb.",)   # checkpoint names not loaded

    def __init__(self, cfg: ModelConfig, max_model_len: int):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.ropes = nn.ModuleList()
        rope_keys: list[str | None] = []
        layers = []
        for i in range(cfg.num_layers):
            rope_index = -1
            if self.uses_rope(i):
                key = rope_parameters(cfg.hf, cfg.layer_types[i])[1]
                if key not in rope_keys:
                    rope_keys.append(key)
                    inv_freq, scaling = inverse_frequencies(cfg.hf, cfg.layer_types[i], cfg.head_dim, max_model_len)
                    self.ropes.append(RotaryEmbedding(inv_freq, scaling))
                rope_index = rope_keys.index(key)
            slides = cfg.layer_types[i] == SLIDING and cfg.sliding_window < max_model_len
            layers.append(self.build_layer(i, cfg.sliding_window if slides else 0, rope_index))
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, self.norm_offset)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.logit_softcap = float(getattr(cfg.hf, "final_logit_softcapping", None) or 0.0)
        self.logits_gather = None     # tensor parallelism's (tp_comm.LogitsGather): rank 0 gets the whole logits

    # ---- what a family defines ---------------------------------------------------------------
    def build_layer(self, index: int, window: int, rope_index: int) -> nn.Module:
        """Decoder layer `index`, sliding over `window` keys (0: none), taking rotary table
        `rope_index` (-1: none)."""
        raise NotImplementedError

    def uses_rope(self, index: int) -> bool:
        return True

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    # ---- the forward pass ---------------------------------------------------------------------
    def forward(self, input_ids, positions, kv_caches, meta, backend, lora: LoraBatch | None = None) -> torch.Tensor:
        x = self.embed(input_ids)
        ropes = [rope(positions, x.dtype) for rope in self.ropes]
        for layer, kv_cache in zip(self.layers, kv_caches):
            x = layer(x, ropes, kv_cache, meta, backend, lora)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = F.linear(hidden, self.embed_tokens.weight) if self.lm_head is None else self.lm_head(hidden)
        if self.logit_softcap:       # per logit: a tensor-parallel rank caps its slice
            logits = torch.tanh(logits / self.logit_softcap) * self.logit_softcap
        logits = logits.float()
        return logits if self.logits_gather is None else self.logits_gather(logits)

    # ---- the fused projections ----------------------------------------------------------------
    def _owners(self) -> list[tuple[int, nn.Module, Projection]]:
        """(layer, module that holds the projection, projection) for every layer's projections."""
        return [(i, layer.get_submodule(p.path.rsplit(".", 1)[0]), p)
                for i, layer in enumerate(self.layers) for p in self.projections]

    @classmethod
    def lora_targets(cls) -> dict[str, tuple[str, int | None]]:
        """A checkpoint module's name (q_proj, qkv_proj...) -> (its projection's key, its part;
        None: the whole fused projection), the modules a PEFT adapter may target."""
        targets: dict[str, tuple[str, int | None]] = {}
        for p in cls.projections:
            targets[p.path.rsplit(".", 1)[1]] = (p.key, None if p.parts else 0)
            for i, part in enumerate(p.parts):
                targets[part.rsplit(".", 1)[1]] = (p.key, i)
        return targets

    # ---- LoRA ---------------------------------------------------------------------------------
    @property
    def lora_enabled(self) -> bool:
        return self._owners()[0][1].lora is not None

    def enable_lora(self, num_slots: int, max_rank: int, dtype: torch.dtype, device: torch.device,
                    shapes: dict | None = None) -> None:
        """Give every projection `num_slots` zeroed adapter slots of rank up to `max_rank`; `shapes`:
        the projections' (projection_shapes), where they are not the config's (a tensor-parallel
        rank's share)."""
        shapes = shapes or projection_shapes(self.cfg)
        for _, owner, p in self._owners():
            if owner.lora is None:
                owner.lora = nn.ModuleDict()
            owner.lora[p.key] = LoraStack(num_slots, shapes[p.key][0], shapes[p.key][1], max_rank, dtype, device)

    def write_lora(self, slot: int, weights: dict | None) -> None:
        """Load an adapter's {(layer, projection key): (A, B)} (lora_weights.LoraWeights.weights)
        into `slot`, or clear it (None)."""
        for i, owner, p in self._owners():
            pair = None if weights is None else weights.get((i, p.key))
            owner.lora[p.key].write(slot, *(pair or (None, None)))

    # ---- weight formats ------------------------------------------------------------------------
    @torch.no_grad()
    def pack_for_cpu(self) -> None:
        """Swap every projection (and the output layer, tied or not) for a PackedLinear. Call
        after load_weights; inference only."""
        for module in list(self.modules()):
            for name, child in list(module.named_children()):
                if isinstance(child, nn.Linear):
                    setattr(module, name, PackedLinear(child.weight, child.bias))
        if self.lm_head is None:
            self.lm_head = PackedLinear(self.embed_tokens.weight, None)

    def use_quantized(self, packed: dict[str, PackedWeight], dtype: torch.dtype, deterministic: bool = True) -> None:
        """Swap the projections, the embedding and the output layer whose weights `packed` holds
        (by checkpoint module name, fused or every part) for quantized layers. Call before
        load_weights, which then loads only their biases. deterministic: each row's output the
        same whatever else is in the step (QuantLinear)."""
        for i, owner, p in self._owners():
            attr = p.path.rsplit(".", 1)[1]
            fused, parts = f"model.layers.{i}.{p.path}", [f"model.layers.{i}.{part}" for part in p.parts]
            if fused in packed:
                weight = packed[fused]
            elif parts and all(n in packed for n in parts):
                weight = concat([packed[n] for n in parts])
            else:
                continue
            bias = getattr(owner, attr).bias
            setattr(owner, attr, QuantLinear(weight, None if bias is None else bias.dtype, deterministic))
        # The output layer takes int8 activations where the projections do, as llama.cpp computes it.
        # 2-core Zen 3, Q8_0 file, fp32: a 32-row decode step 0.95x the time with exact logits (79.4
        # against 83.4 ms), one row 0.98x; perplexity on GPL-3 18.373 against 18.347 (the exact
        # dequantization 18.299). Int8 logits turn SmolLM2's near tie on "What is the capital of
        # France?" to "L'Étoile...", as int8 projections in the prompt's rows do and llama-server does.
        if "model.embed_tokens" in packed:
            self.embed_tokens = QuantEmbedding(QuantLinear(packed["model.embed_tokens"], None, deterministic), dtype)
            if self.lm_head is None:
                self.lm_head = self.embed_tokens.table
        if "lm_head" in packed:
            self.lm_head = QuantLinear(packed["lm_head"], None, deterministic)

    def use_bf16_weights(self, deterministic: bool = True) -> int:
        """Swap every nn.Linear and the nn.Embedding for layers that keep their weights in bf16 and
        compute in fp32 (a tied output layer shares the embedding's bf16 table). Call before
        load_weights, which fills them as it would the originals. Returns the matrices swapped.
        deterministic: every row in registers (Bf16Linear.deterministic)."""
        swapped = 0
        for module in list(self.modules()):
            for name, child in list(module.named_children()):
                if isinstance(child, nn.Linear):
                    setattr(module, name, Bf16Linear.like(child, deterministic))
                    swapped += 1
        if isinstance(self.embed_tokens, nn.Embedding):
            self.embed_tokens = Bf16Embedding(self.cfg.vocab_size, self.cfg.hidden_size)
            swapped += 1
            if self.lm_head is None:
                self.lm_head = Bf16Linear(self.cfg.hidden_size, self.cfg.vocab_size, False, self.embed_tokens.weight,
                                          deterministic)
        return swapped

    # ---- loading --------------------------------------------------------------------------------
    @torch.no_grad()
    def load_weights(self, model_dir: str | Path) -> None:
        """Load a checkpoint's safetensors, stacking each fused projection's parts as they arrive;
        the weights of layers that use_quantized swapped are not read."""
        params = dict(self.named_parameters())
        quantized = {f"{name}.weight" for name, m in self.named_modules(remove_duplicate=False)
                     if isinstance(m, (QuantLinear, QuantEmbedding))}
        part_of = {part: (p, i) for p in self.projections for i, part in enumerate(p.parts)}
        shapes = projection_shapes(self.cfg)
        loaded: set[str] = set()
        files = weight_files(model_dir)
        progress = Progress(logging.getLogger("kaiten.engine"), f"loading weights from {model_dir}",
                            count_tensors(files))
        for name, path, tensor in tensors(files):
            progress.advance()
            target = name.removeprefix("model.")
            if any(ignored in target for ignored in self.ignored_weights):
                continue
            module, _, suffix = target.rpartition(".")
            layer, _, within = module.partition(".")[2].partition(".") if module.startswith("layers.") else ("", "", "")
            if within in part_of:
                p, shard = part_of[within]
                target = f"layers.{layer}.{p.path}.{suffix}"
                if target in quantized:
                    continue
                start = sum(shapes[p.key][1][:shard])
                params[target][start:start + tensor.shape[0]].copy_(tensor)
                loaded.add(f"{target}#{shard}")
                continue
            if target not in params:
                if target in quantized or (target == "lm_head.weight" and self.cfg.tie_word_embeddings):
                    continue
                raise ValueError(f"unexpected weight {name} in {path.name}")
            params[target].copy_(tensor)
            loaded.add(target)
        missing = [n for n in params if n not in loaded and not any(k.startswith(n + "#") for k in loaded)]
        if missing:
            raise ValueError(f"weights missing from {model_dir}: {missing[:5]}")
        progress.finish()
