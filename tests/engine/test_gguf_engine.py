"""The engine on GGUF files of every family, as llama.cpp's own converter writes them from tiny random
Hugging Face models (tests/support/family_models.py): an F32 file gives the source model's greedy
tokens, and a quantized one (Q8_0, Q5_0 and Q4_K matrices, served as stored) gives what its
dequantized values give: with exact activations up to fp32 rounding, with int8 ones within a
stated tolerance."""
from __future__ import annotations

import gguf
import pytest
import torch

from engine_worker import LLM, SamplingParams
from engine_worker.model import quant_layers
from engine_worker.model.quant_layers import QuantLinear
from kernels.cpu_ops_build import cpu_ops_available, int8_x_levels
from shared.gguf_convert import convert_gguf
from tests.support.family_models import (FAMILIES, ORIGINAL_CONTEXT, SENTENCEPIECE_FAMILIES, WINDOW,
                                         build_family_model, convert_model_only, dequantized_gguf, llama_cpp_gguf,
                                         rewrite_gguf)
from tests.support.llm_support import greedy, hf_greedy

# Longer than every window (16) and original context (64): Phi-3 takes its long factors throughout.
PROMPT_LENGTHS = (70, 90, 120)
QUANTIZED_FAMILIES = ("llama", "qwen3", "gemma3")
# The matrices of a quantized file: a mix of the types Gemma 3 270M's file has.
QTYPES = {"attn_q": "Q8_0", "attn_k": "Q8_0", "attn_v": "Q5_0", "attn_output": "Q5_0",
          "ffn_gate": "Q4_K", "ffn_up": "Q4_K", "ffn_down": "Q8_0"}
# Prompt logprobs of the file served as stored against its dequantized values in an F32 file, both
# fp32 with an fp32 KV cache (the random models' logprobs average -16). Exact activations: equal
# (measured 0.0 apart). Int8 activations (x rounded per block of 32, as llama.cpp does): measured
# on a 2-core Zen 4 (AVX-512 VNNI build) up to 0.80 apart, mean 0.15 (llama), 0.28 / 0.07
# (gemma3), 0.12 / 0.03 (qwen3). Where the build rounds x to 7 bits against int8 weights (AVX2,
# no VNNI: 63 levels, twice the step), on a 2-core Zen 3: up to 2.83 apart, mean 0.31 (llama).
# A wrong block layout or scale moves the mean by whole units.
INT8_TOLERANCE = {127: (1.5, 0.25), 63: (3.5, 0.5)}      # by int8_x_levels(8): max, mean


def prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]


def converted_dir(family: str, gguf_file, out):
    if family == "mistral":      # llama.cpp writes no window for Mistral: a file that has one says so
        gguf_file = rewrite_gguf(gguf_file, out.parent / "mistral-window.F32.gguf",
                                 extra={"llama.attention.sliding_window": (WINDOW, gguf.GGUFValueType.UINT32)})
    return (convert_model_only if family in SENTENCEPIECE_FAMILIES else convert_gguf)(gguf_file, out)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_an_f32_file_gives_the_source_models_greedy_tokens(family, family_gguf, tmp_path):
    from transformers import AutoModelForCausalLM

    source, gguf_file = family_gguf(family)
    hf = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    ps = prompts(hf.config.vocab_size)
    want = hf_greedy(hf, ps, 12)
    llm = LLM(str(converted_dir(family, gguf_file, tmp_path / "converted")), dtype="float32", enforce_eager=True,
              kv_cache_memory=16 << 20, max_num_batched_tokens=48)     # chunked prefill
    assert [c.token_ids for c in llm.generate(ps, greedy(12))] == want
    assert ORIGINAL_CONTEXT < min(PROMPT_LENGTHS)


@pytest.mark.skipif(not cpu_ops_available(), reason="the C++ CPU extension does not build here")
@pytest.mark.parametrize("family", QUANTIZED_FAMILIES)
def test_a_quantized_file_is_served_as_stored_as_its_dequantized_values(family, smollm2_dir, tmp_path):
    """Q4_K needs inputs in blocks of 256: a model with a hidden size of 256."""
    source = build_family_model(family, tmp_path / "hf", smollm2_dir, hidden_size=256, intermediate_size=512)
    f32 = llama_cpp_gguf(source, tmp_path / "f32.gguf")
    names = [t.name for t in gguf.GGUFReader(str(f32)).tensors]
    qtypes = {n: QTYPES[n.split(".")[2]] for n in names if n.startswith("blk.") and n.split(".")[2] in QTYPES}
    qtypes["token_embd.weight"] = "Q8_0"
    mixed = rewrite_gguf(f32, tmp_path / "mixed.gguf", qtypes=qtypes)
    exact = LLM(str(convert_gguf(dequantized_gguf(mixed, tmp_path / "exact.gguf"), tmp_path / "exact")),
                dtype="float32", quantization="none", enforce_eager=True, kv_cache_memory=16 << 20)
    model = convert_gguf(mixed, tmp_path / "converted")
    kw = dict(dtype="float32", kv_cache_dtype="float32", enforce_eager=True, kv_cache_memory=16 << 20)
    engines = {"int8": LLM(str(model), **kw)}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(quant_layers, "INT8_ROWS", {})
        engines["exact"] = LLM(str(model), **kw)
    quantized = [m for m in engines["exact"].engine.runner.model.modules() if isinstance(m, QuantLinear)]
    assert {m.kind for m in quantized} == {"int4", "int5", "int8"} and len(quantized) > 4 * family_layers(engines["exact"])
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    ps = prompts(exact.engine.vocab_size)
    want = exact.generate(ps, params)
    for activations, llm in engines.items():
        diffs = [abs(x.logprob - y.logprob) for a, b in zip(llm.generate(ps, params), want)
                 for x, y in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:])]
        most, mean = (1e-4, 1e-5) if activations == "exact" else INT8_TOLERANCE[int8_x_levels(8)]
        assert max(diffs) < most and sum(diffs) / len(diffs) < mean, (activations, max(diffs), sum(diffs) / len(diffs))


def family_layers(llm) -> int:
    return len(llm.engine.runner.model.layers)
