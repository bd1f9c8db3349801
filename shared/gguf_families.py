"""The GGUF architectures Kaiten converts, one record each: the Hugging Face config built from the
file's metadata, its tensors' Hugging Face names, and what llama.cpp's converter
(convert_hf_to_gguf.py) did to them that the conversion undoes.

    general.architecture   Hugging Face class            what differs
    llama                  LlamaForCausalLM              q/k rows permuted; llama3 rope from rope_freqs
                           MistralForCausalLM            the same, where the file has a sliding window
    qwen2                  Qwen2ForCausalLM              q/k/v biases
    qwen3                  Qwen3ForCausalLM              q/k norms, head_dim from attention.key_length
    gemma3                 Gemma3ForCausalLM             norms stored + 1; four per layer; sliding layers
    phi3                   Phi3ForCausalLM               fused qkv and gate_up (kept fused, as HF has
                                                         them); longrope; partial rotary
    smollm3                SmolLM3ForCausalLM            q/k rows permuted; every 4th layer NoPE

What llama.cpp does not store is rebuilt as llama.cpp itself assumes it: SmolLM3's NoPE layers
(every 4th, hard-coded in llama.cpp, no GGUF key), Gemma 3's layer pattern (5 sliding, 1 full,
unless the file says otherwise), its sliding layers' rope base (10,000) and query scale (the head
dim; hidden / heads for the 62-layer 27B). Tied embeddings: no ``output.weight``.

The config holds rope parameters twice, identical: ``rope_parameters`` as transformers 5 writes
them, and ``rope_theta``/``rope_scaling`` (Gemma 3: ``rope_local_base_freq``) as 4.x reads them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from shared.gguf_rope import (default_parameters, f32, llama3_parameters, longrope_parameters,
                              scaling_from_metadata)

# Tensors that llama.cpp derives from the config: read back into it, not weights.
CONFIG_TENSORS = frozenset({"rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight"})
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_ATTENTION = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
              "attn_output": "self_attn.o_proj"}
_MLP = {"ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
_NORMS = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}
_QK_NORMS = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
_REQUIRED = object()


@dataclass(slots=True)
class Source:
    """What a config is built from: the file's metadata and its tensors by GGUF name."""
    meta: Any                    # .get(key, default) and .require(key), as gguf_convert._Meta
    tensors: dict[str, Any]      # GGUF name -> gguf ReaderTensor
    arch: str

    def key(self, name: str, default=_REQUIRED):
        full = f"{self.arch}.{name}"
        return self.meta.require(full) if default is _REQUIRED else self.meta.get(full, default)

    def vector(self, name: str):
        import gguf
        import numpy as np
        t = self.tensors[name]
        return np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float64).ravel()


@dataclass(slots=True)
class Family:
    arch: str                                    # general.architecture
    config: Callable[[Source], dict]
    layer_names: dict[str, str]                  # GGUF leaf -> HF module within a layer
    permuted_qk: bool = False                    # attn_q/attn_k rows interleaved for llama.cpp's rope
    norms_plus_one: bool = False                 # norm weights stored with Gemma's 1 added
    biases: tuple[str, ...] = ()                 # leaves whose bias the HF class always has


# --------------------------------------------------------------------------- configs

def _int(value, name: str) -> int:
    """A count that some files store per layer: one value is all a Hugging Face config takes."""
    if isinstance(value, list):
        if len(set(value)) != 1:
            raise ValueError(f"{name} differs between layers ({sorted(set(value))}): not supported")
        value = value[0]
    return int(value)


def _token_id(src: Source, kind: str) -> int | None:
    tid = src.meta.get(f"tokenizer.ggml.{kind}_token_id")
    return None if tid is None else int(tid)


def _common(src: Source) -> dict:
    hidden = int(src.key("embedding_length"))
    heads = _int(src.key("attention.head_count"), "attention.head_count")
    embed = src.tensors.get("token_embd.weight")
    if embed is None:
        raise ValueError("GGUF has no token_embd.weight")
    eos = _token_id(src, "eos")
    pad = _token_id(src, "padding")
    return {
        "vocab_size": int(embed.shape[1]),          # GGUF lists dimensions innermost first
        "hidden_size": hidden,
        "intermediate_size": _int(src.key("feed_forward_length"), "feed_forward_length"),
        "num_hidden_layers": int(src.key("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": _int(src.key("attention.head_count_kv", heads), "attention.head_count_kv"),
        "head_dim": int(src.key("attention.key_length", hidden // heads)),
        "hidden_act": "silu",
        "max_position_embeddings": int(src.key("context_length")),
        "rms_norm_eps": f32(src.key("attention.layer_norm_rms_epsilon")),
        "initializer_range": 0.02,
        "attention_dropout": 0.0,
        "use_cache": True,
        "tie_word_embeddings": "output.weight" not in src.tensors,
        "bos_token_id": _token_id(src, "bos"),
        "eos_token_id": eos,
        "pad_token_id": eos if pad is None else pad,
    }


def _rope_fields(params: dict, **legacy) -> dict:
    scaling = None if params["rope_type"] == "default" else {k: v for k, v in params.items() if k != "rope_theta"}
    return {"rope_theta": params["rope_theta"], "rope_scaling": scaling, **legacy, "rope_parameters": params}


def _full_rotary(src: Source, cfg: dict) -> None:
    rotary = int(src.key("rope.dimension_count", cfg["head_dim"]))
    if rotary != cfg["head_dim"]:
        raise ValueError(f"partial rotary (rope dim {rotary} != head dim {cfg['head_dim']}) is not part of {src.arch}")


def _rope(src: Source, rotary_dim: int) -> dict:
    theta = f32(src.key("rope.freq_base", 10000.0))
    from_metadata = scaling_from_metadata(src.meta, src.arch, theta)
    if "rope_freqs.weight" in src.tensors:
        if from_metadata:
            raise ValueError("GGUF has both rope_freqs and rope.scaling metadata")
        return llama3_parameters(src.vector("rope_freqs.weight"), theta, rotary_dim) or default_parameters(theta)
    return from_metadata or default_parameters(theta)


def _has_bias(src: Source, leaf: str) -> bool:
    return f"blk.0.{leaf}.bias" in src.tensors


def _full_attention_layers(n: int) -> dict:
    return {"use_sliding_window": False, "sliding_window": None, "max_window_layers": n,
            "layer_types": ["full_attention"] * n}


def _llama(src: Source) -> dict:
    cfg = _common(src)
    _full_rotary(src, cfg)
    rope = _rope_fields(_rope(src, cfg["head_dim"]))
    window = int(src.key("attention.sliding_window", 0) or 0)
    if window:
        # Mistral as llama.cpp writes it: the llama architecture with a window on every layer.
        return {"architectures": ["MistralForCausalLM"], "model_type": "mistral", **cfg, **rope,
                "sliding_window": window}
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **cfg, **rope,
            "attention_bias": _has_bias(src, "attn_q"), "mlp_bias": _has_bias(src, "ffn_gate"), "pretraining_tp": 1}


def _qwen2(src: Source) -> dict:
    cfg = _common(src)
    _full_rotary(src, cfg)
    return {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", **cfg,
            **_rope_fields(_rope(src, cfg["head_dim"])), **_full_attention_layers(cfg["num_hidden_layers"])}


def _qwen3(src: Source) -> dict:
    cfg = _common(src)
    _full_rotary(src, cfg)
    return {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", **cfg,
            **_rope_fields(_rope(src, cfg["head_dim"])), "attention_bias": _has_bias(src, "attn_q"),
            **_full_attention_layers(cfg["num_hidden_layers"])}


# llama.cpp's Gemma 3 defaults (llama-model.cpp): every 6th layer full attention, sliding layers'
# rope base 10,000 without scaling, and the 27B (62 layers) scaling queries by hidden / heads.
_GEMMA3_PATTERN = 6
_GEMMA3_LOCAL_THETA = 10000.0
_GEMMA3_27B_LAYERS = 62


def _gemma3_layer_types(src: Source, n: int, window: int) -> list[str]:
    if not window:
        return ["full_attention"] * n
    pattern = src.key("attention.sliding_window_pattern", _GEMMA3_PATTERN)
    if isinstance(pattern, list):                   # per layer: true where it slides
        sliding = [bool(p) for p in pattern]
    else:                                           # every pattern-th layer full
        sliding = [bool((i + 1) % int(pattern)) for i in range(n)]
    return ["sliding_attention" if s else "full_attention" for s in sliding]


def _gemma3(src: Source) -> dict:
    cfg = _common(src)
    _full_rotary(src, cfg)
    del cfg["hidden_act"]
    n, window = cfg["num_hidden_layers"], int(src.key("attention.sliding_window", 0) or 0)
    theta = f32(src.key("rope.freq_base", 1_000_000.0))
    local = f32(src.key("rope.freq_base_swa", _GEMMA3_LOCAL_THETA))
    full = scaling_from_metadata(src.meta, src.arch, theta) or default_parameters(theta)
    rope = _rope_fields(full, rope_local_base_freq=local)
    rope["rope_parameters"] = {"sliding_attention": default_parameters(local), "full_attention": full}
    if (scale := src.key("attention.scale", None)) is not None:
        query_scalar = f32(1 / float(scale) ** 2)
    elif n == _GEMMA3_27B_LAYERS:
        query_scalar = cfg["hidden_size"] // cfg["num_attention_heads"]
    else:
        query_scalar = cfg["head_dim"]
    softcap = src.key("final_logit_softcapping", None)
    return {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", **cfg,
            "hidden_activation": "gelu_pytorch_tanh", **rope, "query_pre_attn_scalar": query_scalar,
            "sliding_window": window or None, "layer_types": _gemma3_layer_types(src, n, window),
            "final_logit_softcapping": None if softcap is None else f32(softcap), "attn_logit_softcapping": None,
            "attention_bias": _has_bias(src, "attn_q")}


def _phi3(src: Source) -> dict:
    cfg = _common(src)
    theta = f32(src.key("rope.freq_base", 10000.0))
    original = int(src.key("rope.scaling.original_context_length", cfg["max_position_embeddings"]))
    if "rope_factors_long.weight" in src.tensors:
        params = longrope_parameters(theta, src.vector("rope_factors_long.weight"),
                                     src.vector("rope_factors_short.weight"), original,
                                     src.key("rope.scaling.attn_factor", None))
    else:
        params = default_parameters(theta)
    rotary = int(src.key("rope.dimension_count", cfg["head_dim"]))
    partial = {}
    if rotary != cfg["head_dim"]:
        partial = {"partial_rotary_factor": rotary / cfg["head_dim"]}
        params |= partial
    return {"architectures": ["Phi3ForCausalLM"], "model_type": "phi3", **cfg, **_rope_fields(params), **partial,
            "original_max_position_embeddings": original, "resid_pdrop": 0.0, "embd_pdrop": 0.0,
            # llama.cpp's converter writes 0 for "no window" (Phi-4)
            "sliding_window": int(src.key("attention.sliding_window", 0) or 0) or None}


# llama.cpp hard-codes SmolLM3's NoPE layers as every 4th (n_no_rope_layer_step): no GGUF key.
_SMOLLM3_NO_ROPE_INTERVAL = 4


def _smollm3(src: Source) -> dict:
    cfg = _common(src)
    _full_rotary(src, cfg)
    n = cfg["num_hidden_layers"]
    return {"architectures": ["SmolLM3ForCausalLM"], "model_type": "smollm3", **cfg,
            **_rope_fields(_rope(src, cfg["head_dim"])), "attention_bias": _has_bias(src, "attn_q"),
            "mlp_bias": _has_bias(src, "ffn_gate"), **_full_attention_layers(n),
            # 1: the layer rotates; 0: NoPE
            "no_rope_layers": [int((i + 1) % _SMOLLM3_NO_ROPE_INTERVAL != 0) for i in range(n)],
            "no_rope_layer_interval": _SMOLLM3_NO_ROPE_INTERVAL}


# --------------------------------------------------------------------------- the table

_LLAMA_LAYERS = {**_NORMS, **_ATTENTION, **_MLP}
FAMILIES = {f.arch: f for f in (
    Family("llama", _llama, _LLAMA_LAYERS, permuted_qk=True),
    Family("qwen2", _qwen2, _LLAMA_LAYERS, biases=("attn_q", "attn_k", "attn_v")),
    Family("qwen3", _qwen3, {**_LLAMA_LAYERS, **_QK_NORMS}),
    Family("gemma3", _gemma3, {**_ATTENTION, **_MLP, **_QK_NORMS,
                               "attn_norm": "input_layernorm", "post_attention_norm": "post_attention_layernorm",
                               "ffn_norm": "pre_feedforward_layernorm", "post_ffw_norm": "post_feedforward_layernorm"},
           norms_plus_one=True),
    Family("phi3", _phi3, {**_NORMS, "attn_qkv": "self_attn.qkv_proj", "attn_output": "self_attn.o_proj",
                           "ffn_up": "mlp.gate_up_proj", "ffn_down": "mlp.down_proj"}),
    Family("smollm3", _smollm3, _LLAMA_LAYERS, permuted_qk=True),
)}


def family_for(arch: str) -> Family:
    if arch not in FAMILIES:
        raise ValueError(f"unsupported GGUF architecture {arch!r}; supported: {', '.join(sorted(FAMILIES))}")
    return FAMILIES[arch]


def hf_name(family: Family, gguf_name: str) -> str:
    """The Hugging Face name of a GGUF tensor (``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight``)."""
    module, _, suffix = gguf_name.rpartition(".")
    if module in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[module]}.{suffix}"
    parts = module.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in family.layer_names:
        return f"model.layers.{int(parts[1])}.{family.layer_names[parts[2]]}.{suffix}"
    raise ValueError(f"unsupported GGUF tensor {gguf_name!r} for {family.arch}")


def expected_names(family: Family, config: dict) -> set[str]:
    """Every tensor the Hugging Face class has, by its Hugging Face name."""
    names = {"model.embed_tokens.weight", "model.norm.weight"}
    if not config["tie_word_embeddings"]:
        names.add("lm_head.weight")
    biases = set(family.biases)
    if config.get("attention_bias"):
        biases |= set(_ATTENTION)
    if config.get("mlp_bias"):
        biases |= set(_MLP)
    for i in range(config["num_hidden_layers"]):
        names |= {f"model.layers.{i}.{hf}.weight" for hf in family.layer_names.values()}
        names |= {f"model.layers.{i}.{family.layer_names[leaf]}.bias" for leaf in biases}
    return names


def check_tensors(family: Family, config: dict, gguf_names: list[str]) -> None:
    """The file's weights are exactly the Hugging Face class's: none missing, none it would not load."""
    have = {hf_name(family, n) for n in gguf_names if n not in CONFIG_TENSORS}
    expected = expected_names(family, config)
    if missing := expected - have:
        raise ValueError(f"GGUF lacks tensors: {sorted(missing)[:5]}")
    if extra := have - expected:
        raise ValueError(f"GGUF has tensors {config['architectures'][0]} does not: {sorted(extra)[:5]}")
