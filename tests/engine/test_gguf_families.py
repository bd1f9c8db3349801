"""GGUF files of each architecture shared/gguf_families.py converts, as llama.cpp's own converter
writes them from tiny random Hugging Face models (tests/support/family_models.py): the converted
directory loads with transformers as it is and gives the source model's logits, on sequences
longer than every window and original context. And quantized files: the sidecar's matrices
decode bit-identically to gguf's dequantizer, model.safetensors holds them rounded to bf16, and
types the engine does not multiply as stored are dequantized with one log line."""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from shared import gguf_quant
from shared.gguf_convert import convert_gguf
from shared.gguf_quant import QUANTIZED_FILE
from shared.gguf_families import FAMILIES as CONVERTED, Source, family_for, hf_name
from shared.gguf_rope import llama3_parameters
from tests.support.family_models import (FAMILIES, ORIGINAL_CONTEXT, SENTENCEPIECE_FAMILIES, SEQ_LEN, WINDOW,
                                         build_family_model, convert_model_only, llama_cpp_gguf, rewrite_gguf)

# Config fields each family's differences live in, beyond the common ones: equal to the source's.
COMMON_KEYS = ("architectures", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
               "num_attention_heads", "num_key_value_heads", "tie_word_embeddings", "max_position_embeddings")
FAMILY_KEYS = {
    "llama": ("head_dim", "rope_parameters"),
    "mistral": ("head_dim", "sliding_window"),
    "qwen2": (),
    "qwen3": ("head_dim",),
    "gemma3": ("head_dim", "sliding_window", "layer_types", "query_pre_attn_scalar", "final_logit_softcapping",
               "rope_parameters"),
    "phi3": ("partial_rotary_factor", "original_max_position_embeddings", "sliding_window"),
    "smollm3": ("no_rope_layers",),
}


@dataclass(slots=True)
class Converted:
    family: str
    source: Path          # the Hugging Face model
    gguf: Path            # as llama.cpp wrote it (F32)
    out: Path             # kaiten's conversion


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def converted(request, family_gguf, tmp_path_factory) -> Converted:
    family = request.param
    root = tmp_path_factory.mktemp(f"{family}-converted")
    source, gguf_file = family_gguf(family)
    if family == "mistral":
        # llama.cpp writes Mistral as llama and keeps no window (its LlamaModel has none); files
        # that have one carry llama.attention.sliding_window, as this one now does.
        assert "llama.attention.sliding_window" not in gguf.GGUFReader(str(gguf_file)).fields
        gguf_file = rewrite_gguf(gguf_file, root / "mistral-window.F32.gguf",
                                 extra={"llama.attention.sliding_window": (WINDOW, gguf.GGUFValueType.UINT32)})
    convert = convert_model_only if family in SENTENCEPIECE_FAMILIES else convert_gguf
    return Converted(family, source, gguf_file, convert(gguf_file, root / "converted"))


def _logits(model, n: int) -> torch.Tensor:
    ids = torch.randint(3, model.config.vocab_size, (1, n), generator=torch.Generator().manual_seed(n))
    with torch.no_grad():
        return model(ids).logits


def test_converted_directory_loads_with_transformers_and_gives_the_source_logits(converted):
    from transformers import AutoModelForCausalLM

    want = AutoModelForCausalLM.from_pretrained(converted.source, dtype=torch.float32).eval()
    got, info = AutoModelForCausalLM.from_pretrained(converted.out, output_loading_info=True)
    assert not any(info.values()), info                       # no missing, unexpected or mismatched keys
    assert got.dtype == torch.float32                         # an F32 file: an fp32 model
    for key in COMMON_KEYS + FAMILY_KEYS[converted.family]:
        assert getattr(got.config, key) == getattr(want.config, key), key
    # shorter and longer than the window (16) and original context (64): Phi-3's short and long factors
    for n in (ORIGINAL_CONTEXT // 2, SEQ_LEN):
        torch.testing.assert_close(_logits(got.eval(), n), _logits(want, n), rtol=1e-5, atol=1e-5)
    assert not (converted.out / QUANTIZED_FILE).exists()      # nothing quantized in an F32 file


@pytest.mark.parametrize("kind,dtype", [("F16", torch.float16), ("BF16", torch.bfloat16)])
def test_f16_and_bf16_tensors_are_kept_as_they_are(family_gguf, tmp_path, kind, dtype):
    """An F16 or BF16 file (matrices in that type, norms F32, as llama.cpp's --outtype writes them):
    the same types in model.safetensors, and the model in the matrices' dtype."""
    from safetensors.torch import load_file
    from transformers import AutoConfig

    source, f32 = family_gguf("qwen3")
    matrices = [t.name for t in gguf.GGUFReader(str(f32)).tensors if len(t.shape) == 2]
    out = convert_gguf(rewrite_gguf(f32, tmp_path / f"qwen3.{kind}.gguf", qtypes=dict.fromkeys(matrices, kind)),
                       tmp_path / "converted")
    want, got = load_file(str(source / "model.safetensors")), load_file(str(out / "model.safetensors"))
    for name, w in want.items():
        assert torch.equal(got[name], w.to(dtype) if w.dim() == 2 else w), name
    assert AutoConfig.from_pretrained(out).dtype == dtype


# --------------------------------------------------------------------------- quantized files

def _llama_cpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """convert_hf_to_gguf.py's q/k row permutation (conversion/llama.py)."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# per GGUF leaf: Q4_K needs 256 inputs a row, hence the wider model below
QUANT_TYPES = {"token_embd": "Q8_0", "attn_q": "Q4_K", "attn_k": "Q4_K", "attn_v": "Q5_0", "attn_output": "Q5_1",
               "ffn_gate": "Q4_K", "ffn_up": "TQ2_0", "ffn_down": "MXFP4"}
SERVED_AS_STORED = {"Q8_0", "Q4_K", "Q5_0", "Q5_1"}


@pytest.fixture(scope="module")
def quantized(smollm2_dir, tmp_path_factory, request):
    """A tied tiny Llama (as SmolLM2) 256 wide, its matrices requantized to QUANT_TYPES, converted;
    with the log records of the conversion."""
    root = tmp_path_factory.mktemp("quantized")
    source = build_family_model("llama", root / "hf", smollm2_dir, hidden_size=256, intermediate_size=256,
                                tie_word_embeddings=True)
    f32 = llama_cpp_gguf(source, root / "llama.F32.gguf")
    names = [t.name for t in gguf.GGUFReader(str(f32)).tensors]
    qtypes = {n: QUANT_TYPES[n.split(".")[-2]] for n in names if n.split(".")[-2] in QUANT_TYPES}
    quant = rewrite_gguf(f32, root / "llama.mixed.gguf", qtypes=qtypes)
    handler = _Records()
    logging.getLogger("kaiten.convert").addHandler(handler)
    try:
        out = convert_gguf(quant, root / "converted")
    finally:
        logging.getLogger("kaiten.convert").removeHandler(handler)
    return quant, out, handler.records


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record):
        self.records.append(record)


def _file_values(quant: Path) -> dict[str, tuple[str, np.ndarray]]:
    """GGUF name -> (type, gguf's dequantized values in Hugging Face's shape)."""
    out = {}
    for t in gguf.GGUFReader(str(quant)).tensors:
        shape = tuple(int(d) for d in reversed(t.shape))
        out[t.name] = (t.tensor_type.name, gguf.quants.dequantize(t.data, t.tensor_type).reshape(shape))
    return out


def _hf(name: str) -> str:
    return hf_name(family_for("llama"), name)


def test_quantized_sidecar_is_bit_identical_and_model_safetensors_holds_bf16(quantized):
    from safetensors.torch import load_file

    quant, out, _ = quantized
    values = _file_values(quant)
    packed = gguf_quant.load(out / QUANTIZED_FILE)
    weights = load_file(str(out / "model.safetensors"))
    heads = {"attn_q": 4, "attn_k": 2}
    served = {_hf(n).removesuffix(".weight") for n, (kind, _) in values.items() if kind in SERVED_AS_STORED}
    assert set(packed) == served and "model.embed_tokens" in served    # the tied embedding too
    for name, (kind, want) in values.items():
        if name == "rope_freqs.weight":
            continue
        leaf = name.split(".")[-2]
        hf = _hf(name)
        got = weights[hf]
        if kind == "F32":                                 # the norms: as they are
            assert got.dtype == torch.float32 and np.array_equal(got.numpy(), want), name
            continue
        if leaf in heads:                                 # the file's rows are llama.cpp's permutation
            got = torch.from_numpy(_llama_cpp_permute(got.float().numpy(), heads[leaf])).to(torch.bfloat16)
        assert got.dtype == torch.bfloat16 and torch.equal(got, torch.from_numpy(want).to(torch.bfloat16)), name
        if kind in SERVED_AS_STORED:
            mine = packed[hf.removesuffix(".weight")].dequantize()
            if leaf in heads:
                mine = _llama_cpp_permute(mine, heads[leaf])
            # + 0.0: -0.0 and 0.0 alike (Q5_0's d * (q - 16) is -0.0 where the repacked q * d is 0.0)
            np.testing.assert_array_equal((mine + 0.0).view(np.uint32), (want + 0.0).view(np.uint32), name)


def test_types_not_served_as_stored_are_dequantized_with_one_log_line(quantized):
    from transformers import AutoModelForCausalLM

    _, out, records = quantized
    lines = [r.getMessage() for r in records if "dequantized" in r.getMessage()]
    assert len(lines) == 1 and "TQ2_0" in lines[0] and "MXFP4" in lines[0], lines
    assert not any(t in lines[0].split("(")[0] for t in SERVED_AS_STORED), lines
    # a plain Hugging Face directory: the sidecar is no weight shard to other tools
    assert sorted(p.name for p in out.glob("*.safetensors")) == ["model.safetensors"]
    model, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not any(info.values()), info
    assert model.dtype == torch.bfloat16


def test_gemma3_q8_0_embedding_is_in_the_sidecar_tied(family_gguf, tmp_path):
    """Gemma 3's Q8_0 token embedding is also its output layer: served as stored, as SmolLM2's;
    its norms (F32, stored as w + 1) come back as weights w' with 1 + w' == 1 + w in fp32, the
    factor Gemma's norm multiplies by."""
    from safetensors.torch import load_file

    source, f32 = family_gguf("gemma3")
    quant = rewrite_gguf(f32, tmp_path / "gemma3.Q8_0.gguf", qtypes={"token_embd.weight": "Q8_0"})
    out = convert_gguf(quant, tmp_path / "converted")
    assert set(gguf_quant.load(out / QUANTIZED_FILE)) == {"model.embed_tokens"}
    want, got = load_file(str(source / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert "lm_head.weight" not in got
    for name in want:
        if "norm" in name:
            assert torch.equal(1 + got[name], 1 + want[name]), name


# --------------------------------------------------------------------------- config pieces

def _llama_cpp_rope_freqs(theta: float, dim: int, factor: float, low: float, high: float, context: int) -> np.ndarray:
    """conversion/llama.py's generate_extra_tensors, in float32 as it computes them."""
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < context / high:
            out.append(1)
        elif wavelen > context / low:
            out.append(factor)
        else:
            smooth = (context / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(out, dtype=torch.float32).numpy()


@pytest.mark.parametrize("theta,dim,factor,context", [(500000.0, 128, 8.0, 8192),    # Llama 3.1 8B
                                                      (500000.0, 64, 32.0, 8192),    # Llama 3.2 1B
                                                      (10000.0, 16, 8.0, 64)])
def test_llama3_rope_scaling_is_rebuilt_from_rope_freqs(theta, dim, factor, context):
    params = llama3_parameters(_llama_cpp_rope_freqs(theta, dim, factor, 1.0, 4.0, context), theta, dim)
    assert params == {"rope_type": "llama3", "rope_theta": theta, "factor": factor, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": context}


def test_llama3_with_other_frequency_factors_gives_the_same_factors():
    """Only context / low and context / high matter: (2, 8, 8192) is (1, 4, 4096)."""
    params = llama3_parameters(_llama_cpp_rope_freqs(500000.0, 128, 8.0, 2.0, 8.0, 8192), 500000.0, 128)
    assert (params["low_freq_factor"], params["high_freq_factor"], params["original_max_position_embeddings"]) \
        == (1.0, 4.0, 4096)
    with pytest.raises(ValueError, match="does not follow llama3"):
        llama3_parameters(np.linspace(1, 3, 64), 500000.0, 128)


class _Meta(dict):
    def require(self, key):
        return self[key]


@dataclass(slots=True)
class _Tensor:
    shape: tuple[int, ...]


def _gemma3_config(layers: int, **extra) -> dict:
    meta = _Meta({"gemma3.embedding_length": 5376, "gemma3.feed_forward_length": 21504, "gemma3.block_count": layers,
                  "gemma3.attention.head_count": 32, "gemma3.attention.head_count_kv": 16,
                  "gemma3.attention.key_length": 128, "gemma3.context_length": 131072,
                  "gemma3.attention.layer_norm_rms_epsilon": 1e-6, "gemma3.rope.freq_base": 1e6,
                  "gemma3.attention.sliding_window": 1024, **extra})
    return family_for("gemma3").config(Source(meta, {"token_embd.weight": _Tensor((5376, 262144))}, "gemma3"))


def test_gemma3_defaults_are_llama_cpps():
    """27B (62 layers) scales queries by hidden / heads (168), the others by the head dim; 5 sliding
    layers then 1 full, unless the file lists them."""
    cfg = _gemma3_config(62)
    assert cfg["query_pre_attn_scalar"] == 168 and cfg["vocab_size"] == 262144
    assert cfg["layer_types"][:6] == ["sliding_attention"] * 5 + ["full_attention"]
    assert cfg["rope_parameters"]["sliding_attention"] == {"rope_type": "default", "rope_theta": 10000.0}
    cfg = _gemma3_config(34, **{"gemma3.attention.sliding_window_pattern": [True, False] * 17})
    assert cfg["query_pre_attn_scalar"] == 128 and cfg["layer_types"][:2] == ["sliding_attention", "full_attention"]


def test_an_architecture_outside_the_table_is_one_line_naming_the_supported_ones():
    with pytest.raises(ValueError) as e:
        family_for("mamba")
    assert str(e.value) == f"unsupported GGUF architecture 'mamba'; supported: {', '.join(sorted(CONVERTED))}"
