"""The Llama family in plain torch (Llama, Mistral, Qwen2): RMSNorm, RoPE, GQA, SwiGLU.

The forward pass takes a packed varlen batch (no padding) and reads and writes the paged KV cache
through a kernels.AttentionBackend. Projections are fused at load time: one qkv matmul, one
gate_up matmul per layer.
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import nn

from engine_worker.model.bf16_layers import Bf16Embedding, Bf16Linear
from engine_worker.model.lora_layers import LoraBatch, LoraStack, projection_shapes
from engine_worker.model.quant_layers import QuantEmbedding, QuantLinear
from kernels.cpu_attention import cpu_ops_loaded
from kernels.interface import AttentionBackend, AttentionMetadata
from shared.gguf_convert import QUANTIZED_FILE
from shared.gguf_quant import PackedWeight, concat
from shared.progress import Progress

SUPPORTED_ARCHITECTURES = {"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"}


@dataclass(slots=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    eos_token_ids: list[int]

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> "ModelConfig":
        model_dir = Path(model_dir)
        cfg = json.loads((model_dir / "config.json").read_text())
        arch = (cfg.get("architectures") or ["LlamaForCausalLM"])[0]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"unsupported architecture {arch}; supported: {sorted(SUPPORTED_ARCHITECTURES)}")
        rope_scaling = cfg.get("rope_scaling") or (cfg.get("rope_parameters") or {})
        if rope_scaling.get("rope_type", rope_scaling.get("type", "default")) not in ("default", None):
            raise ValueError(f"unsupported rope_scaling {rope_scaling}")
        if cfg.get("sliding_window") and cfg.get("use_sliding_window", arch == "MistralForCausalLM"):
            if cfg["sliding_window"] < cfg.get("max_position_embeddings", 0):
                raise ValueError("sliding-window attention is not supported")
        rope_theta = cfg.get("rope_theta", rope_scaling.get("rope_theta", 10000.0))
        num_heads = cfg["num_attention_heads"]
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads", num_heads),
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // num_heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            attention_bias=cfg.get("attention_bias", arch == "Qwen2ForCausalLM"),
            eos_token_ids=_eos_ids(model_dir, cfg),
        )


def _eos_ids(model_dir: Path, cfg: dict) -> list[int]:
    eos = cfg.get("eos_token_id")
    gen = model_dir / "generation_config.json"
    if gen.exists():
        eos = json.loads(gen.read_text()).get("eos_token_id", eos)
    if eos is None:
        return []
    return list(eos) if isinstance(eos, list) else [eos]


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 and scale in the model dtype, as the reference implementation does.
        return self.weight * F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_positions: int, theta: float):
        super().__init__()
        inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        cos = self.cos[positions].unsqueeze(1).to(q.dtype)   # [T, 1, D]
        sin = self.sin[positions].unsqueeze(1).to(q.dtype)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=False)
        self.scale = self.head_dim ** -0.5
        self.lora: nn.ModuleDict | None = None       # "qkv", "o": LoraStacks (enable_lora)

    def forward(self, x, positions, rope, kv_cache, meta: AttentionMetadata, backend: AttentionBackend,
                lora: LoraBatch | None = None):
        qkv = _project(self.qkv_proj, x, self, "qkv", lora)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        q, k = rope(positions, q, k)
        k_cache, v_cache = kv_cache
        out = backend.write_kv_and_attention(q, k, v, k_cache, v_cache, meta, self.scale)
        return _project(self.o_proj, out.reshape(-1, self.q_size), self, "o", lora)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.lora: nn.ModuleDict | None = None       # "gate_up", "down": LoraStacks (enable_lora)

    def forward(self, x, lora: LoraBatch | None = None):
        gate, up = _project(self.gate_up_proj, x, self, "gate_up", lora).chunk(2, dim=-1)
        return _project(self.down_proj, F.silu(gate) * up, self, "down", lora)


def _project(linear: nn.Module, x: torch.Tensor, owner: nn.Module, key: str, lora: LoraBatch | None) -> torch.Tensor:
    """linear(x), plus the LoRA term of `owner`'s stack `key` for a step with adapter tokens. A
    base-model step never reads `owner.lora`: the compiled base graph keeps no guard on it, so
    enabling LoRA later (the first adapter) does not recompile it."""
    y = linear(x)
    return y if lora is None else owner.lora[key](x, y, lora)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, positions, rope, kv_cache, meta, backend, lora: LoraBatch | None = None):
        x = x + self.self_attn(self.input_layernorm(x), positions, rope, kv_cache, meta, backend, lora)
        return x + self.mlp(self.post_attention_layernorm(x), lora)


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rope = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def forward(self, input_ids, positions, kv_caches, meta, backend, lora: LoraBatch | None = None) -> torch.Tensor:
        """input_ids, positions: [T] -> hidden states [T, hidden]; `lora`: the step's adapter tokens."""
        x = self.embed_tokens(input_ids)
        for layer, kv_cache in zip(self.layers, kv_caches):
            x = layer(x, positions, self.rope, kv_cache, meta, backend, lora)
        return self.norm(x)

    @property
    def lora_enabled(self) -> bool:
        return self.layers[0].mlp.lora is not None

    def enable_lora(self, num_slots: int, max_rank: int, dtype: torch.dtype, device: torch.device) -> None:
        """Give every projection `num_slots` zeroed adapter slots of rank up to `max_rank`."""
        shapes = projection_shapes(self.cfg)
        for layer in self.layers:
            for module, keys in ((layer.self_attn, ("qkv", "o")), (layer.mlp, ("gate_up", "down"))):
                module.lora = nn.ModuleDict({
                    k: LoraStack(num_slots, shapes[k][0], shapes[k][1], max_rank, dtype, device)
                    for k in keys})

    def write_lora(self, slot: int, weights: dict | None) -> None:
        """Load an adapter's {(layer, projection): (A, B)} (lora_weights.LoraWeights.weights) into
        `slot`, or clear it (None)."""
        for i, layer in enumerate(self.layers):
            for module in (layer.self_attn, layer.mlp):
                for key, stack in module.lora.items():
                    pair = None if weights is None else weights.get((i, key))
                    stack.write(slot, *(pair or (None, None)))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = F.linear(hidden, self.embed_tokens.weight) if self.lm_head is None else self.lm_head(hidden)
        return logits.float()

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

    def use_quantized(self, packed: dict[str, PackedWeight], dtype: torch.dtype) -> None:
        """Swap the projections, the embedding and the output layer whose weights `packed` holds
        (by HF module name) for quantized layers; q/k/v and gate/up only when every part is there.
        Call before load_weights, which then skips them."""
        fused = {("self_attn", "qkv_proj"): ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
                 ("self_attn", "o_proj"): ("self_attn.o_proj",),
                 ("mlp", "gate_up_proj"): ("mlp.gate_proj", "mlp.up_proj"),
                 ("mlp", "down_proj"): ("mlp.down_proj",)}
        for i, layer in enumerate(self.layers):
            for (block, attr), parts in fused.items():
                names = [f"model.layers.{i}.{part}" for part in parts]
                module = getattr(layer, block)
                if all(n in packed for n in names) and getattr(module, attr).bias is None:
                    setattr(module, attr, QuantLinear(concat([packed[n] for n in names])))
        # The output layer takes int8 activations where the projections do, as llama.cpp computes it.
        # 2-core Zen 3, Q8_0 file, fp32: a 32-row decode step 0.95x the time with exact logits (79.4
        # against 83.4 ms), one row 0.98x; perplexity on GPL-3 18.373 against 18.347 (the exact
        # dequantization 18.299). Int8 logits turn SmolLM2's near tie on "What is the capital of
        # France?" to "L'Étoile...", as int8 projections in the prompt's rows do and llama-server does.
        if "model.embed_tokens" in packed:
            self.embed_tokens = QuantEmbedding(QuantLinear(packed["model.embed_tokens"]), dtype)
            if self.lm_head is None:
                self.lm_head = self.embed_tokens.table
        if "lm_head" in packed:
            self.lm_head = QuantLinear(packed["lm_head"])

    def use_bf16_weights(self) -> int:
        """Swap every nn.Linear and the nn.Embedding for layers that keep their weights in bf16 and
        compute in fp32 (a tied output layer shares the embedding's bf16 table). Call before
        load_weights, which fills them as it would the originals. Returns the matrices swapped."""
        swapped = 0
        for module in list(self.modules()):
            for name, child in list(module.named_children()):
                if isinstance(child, nn.Linear):
                    setattr(module, name, Bf16Linear.like(child))
                    swapped += 1
        if isinstance(self.embed_tokens, nn.Embedding):
            self.embed_tokens = Bf16Embedding(self.cfg.vocab_size, self.cfg.hidden_size)
            swapped += 1
            if self.lm_head is None:
                self.lm_head = Bf16Linear(self.cfg.hidden_size, self.cfg.vocab_size, False, self.embed_tokens.weight)
        return swapped

    @torch.no_grad()
    def load_weights(self, model_dir: str | Path) -> None:
        """Load HF-named safetensors, fusing q/k/v and gate/up as they arrive; weights of layers
        that use_quantized swapped are not read."""
        params = dict(self.named_parameters())
        quantized = {f"{name}.weight" for name, m in self.named_modules(remove_duplicate=False)
                     if isinstance(m, (QuantLinear, QuantEmbedding))}
        fused = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
                 "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
        loaded: set[str] = set()
        files = sorted(p for p in Path(model_dir).glob("*.safetensors") if p.name != QUANTIZED_FILE)
        if not files:
            raise FileNotFoundError(f"no *.safetensors in {model_dir}")
        progress = Progress(logging.getLogger("kaiten.engine"), f"loading weights from {model_dir}",
                            _count_tensors(files))
        for path in files:
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():
                    progress.advance()
                    target = name.removeprefix("model.")
                    if "rotary_emb" in target:
                        continue
                    tensor = f.get_tensor(name)
                    parts = target.split(".")
                    if len(parts) >= 2 and parts[-2] in fused:
                        new, shard = fused[parts[-2]]
                        target = ".".join(parts[:-2] + [new, parts[-1]])
                        if target in quantized:
                            continue
                        _copy_shard(params[target], tensor, shard, self.cfg)
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


def stored_in_bf16(model_dir: str | Path) -> bool:
    """Whether every matrix in the model's safetensors (the quantized file aside) is stored in bf16."""
    dtypes = set()
    for path in Path(model_dir).glob("*.safetensors"):
        if path.name == QUANTIZED_FILE:
            continue
        with safe_open(str(path), framework="pt") as f:
            dtypes |= {f.get_slice(name).get_dtype() for name in f.keys() if len(f.get_slice(name).get_shape()) == 2}
    return dtypes == {"BF16"}


def _count_tensors(files: list[Path]) -> int:
    total = 0
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            total += len(f.keys())
    return total


class PackedLinear(nn.Module):
    """A linear layer whose weight oneDNN has reordered into its blocked layout once, at load.
    On the CPU, MKL's GEMM is slow for the few rows of a decode step (bench/kernels/cpu_linear.py: on a
    2-core AVX2 EPYC, SmolLM2's projections run about 2x faster at 8 rows and 1.1-1.3x faster at
    1, 64 and 512). fp32 anywhere; bf16 where the CPU has native bf16 (AVX512-BF16/AMX), since
    oneDNN emulates it elsewhere. Inference only (no autograd). Under torch.compile it runs as the
    opaque op kaiten_cpu::packed_linear from the C++ extension where it is loaded, else the Python
    op kaiten::packed_linear (Inductor lowers oneDNN linears only for frozen weights)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.out_features = weight.shape[0]
        self.register_buffer("packed", torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 64))
        self.register_buffer("bias", None if bias is None else bias.detach().clone())

    @staticmethod
    def supported(device: torch.device, dtype: torch.dtype) -> bool:
        if device.type != "cpu" or not torch.backends.mkldnn.is_available():
            return False
        return dtype == torch.float32 or (dtype == torch.bfloat16 and cpu_has_native_bf16())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            op = torch.ops.kaiten_cpu.packed_linear if cpu_ops_loaded() else torch.ops.kaiten.packed_linear
            return op(x, self.packed, self.bias, self.out_features)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


@torch.library.custom_op("kaiten::packed_linear", mutates_args=())
def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None,
                  out_features: int) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


@packed_linear.register_fake
def _packed_linear_fake(x, packed, bias, out_features):
    return x.new_empty((*x.shape[:-1], out_features))


def cpu_has_native_bf16() -> bool:
    """AVX512-BF16 or AMX: bf16 matmuls run natively (elsewhere torch and oneDNN emulate them)."""
    try:
        flags = open("/proc/cpuinfo").read()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def _copy_shard(param: torch.Tensor, tensor: torch.Tensor, shard: int, cfg: ModelConfig) -> None:
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    if param.shape[0] == q + 2 * kv:                  # qkv_proj (weight or bias)
        start = [0, q, q + kv][shard]
    else:                                             # gate_up_proj
        start = shard * cfg.intermediate_size
    param[start:start + tensor.shape[0]].copy_(tensor)
