"""The engine on a quantized GGUF file: --quantization auto (the matrices as stored, multiplied by
kaiten_cpu::quant_linear) against none (the same file dequantized to bf16 at conversion, computed
in fp32). A tiny random Llama with tied embeddings, as SmolLM2: Q4_1 projections (or Q8_0 ones),
a Q8_0 embedding that is also the output layer."""
from __future__ import annotations

import pytest
import torch

from engine_worker import LLM, SamplingParams
from engine_worker.model import quant_layers
from engine_worker.model.quant_layers import QuantEmbedding, QuantLinear
from kernels.cpu_ops_build import cpu_ops_available
from tests.support.gguf_files import write_llama_gguf
from tests.support.tiny_model import build_tiny_model

pytestmark = pytest.mark.skipif(not cpu_ops_available(), reason="the C++ CPU extension does not build here")

PROMPTS = ["The capital of France is", "Hello world! How are", "A paged KV cache stores keys", "0123456789"]
# Logprobs of the same tokens, quantized vs dequantized: the dequantized weights are rounded to
# bf16 at conversion (relative error up to 2^-9 a weight), the quantized ones are exact, and both
# keep exact activations. Measured with Q4_1: prompt tokens 0.038 max / 0.010 mean, decode
# 0.044 / 0.012, all 40 greedy tokens equal; with Q8_0 decode up to 0.053, and 25 of 48 greedy
# tokens equal in the batch: this random model's flat distributions let the bf16 rounding flip them.
# With int8 activations decode differs more: on a CPU with AVX512-VNNI, when only decode steps'
# few rows took them, Q4_1 up to 0.20 / 0.042 mean, 43 of 48 greedy tokens equal; Q8_0 0.19 /
# 0.040, 16 of 48 (2-core Xeon). In every row of fp32 x (prompts too; AVX2 Zen 3): prompt tokens
# Q4_1 0.149 / 0.030, 31 of 48 greedy tokens equal; Q8_0 0.160 / 0.040, 19 of 48.
# tokens: the share of greedy tokens equal in the batch; compared: decode tokens before a flip.
TOLERANCES = {("Q4_1", "exact"): dict(max=0.05, mean=0.02, tokens=0.9, compared=20),
              ("Q8_0", "exact"): dict(max=0.08, mean=0.02, tokens=0.4, compared=8),
              ("Q4_1", "int8"): dict(max=0.3, mean=0.08, tokens=0.55, compared=10),
              ("Q8_0", "int8"): dict(max=0.3, mean=0.08, tokens=0.25, compared=8)}


@pytest.fixture(scope="module", params=["Q4_1", "Q8_0"])
def fmt(request) -> str:
    """The projections' format."""
    return request.param


@pytest.fixture(scope="module", params=["exact", "int8"])
def activations(request) -> str:
    """How the projections multiply fp32 x: int8-rounded activations (the default, where the build
    can: every row) or exact ones (INT8_ROWS empty when the engines load the model: a compiled
    graph of their own)."""
    return request.param


@pytest.fixture(scope="module")
def quant_gguf(fmt, tmp_path_factory):
    model_dir = build_tiny_model(tmp_path_factory.mktemp("tied-llama"), tie_word_embeddings=True)
    return write_llama_gguf(model_dir, tmp_path_factory.mktemp("gguf") / f"tiny-llama.{fmt}.gguf",
                            qtype=fmt, embed_qtype="Q8_0")


@pytest.fixture(scope="module")
def engines(quant_gguf, activations, tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KAITEN_MODELS_DIR", str(tmp_path_factory.mktemp("models")))
        if activations == "exact":
            mp.setattr(quant_layers, "INT8_ROWS", {})
        # auto compiled (its graph calls the dispatcher op), none eager
        return {q: LLM(str(quant_gguf), dtype="float32", quantization=q, kv_cache_memory=8 * 2**20,
                       enforce_eager=q == "none") for q in ("auto", "none")}


def test_auto_serves_every_matrix_quantized(engines, fmt):
    model = engines["auto"].engine.runner.model
    assert isinstance(model.embed_tokens, QuantEmbedding) and model.lm_head is model.embed_tokens.table
    int8 = fmt == "Q8_0"
    for layer in model.layers:
        for lin in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
            assert isinstance(lin, QuantLinear) and lin.kind == ("int8" if int8 else "int4")
    assert model.embed_tokens.table.kind == "int8"
    assert not any(isinstance(m, QuantLinear) for m in engines["none"].engine.runner.model.modules())


def test_auto_keeps_the_kv_cache_in_fp16_and_none_in_the_models_dtype(engines, quant_gguf, activations):
    """--kv-cache-dtype auto: fp16 for the quantized fp32 model (as llama.cpp keeps the file's KV),
    the model's dtype for the dequantized one and for a bf16 model (fp16 would save no bytes there).
    Against an fp32 cache the fp16 one moves logprobs by far less than the weights' quantization does."""
    assert {q: llm.engine.runner.kv_caches[0][0].dtype for q, llm in engines.items()} == \
        {"auto": torch.float16, "none": torch.float32}
    if activations == "int8":
        return          # one comparison per format, with exact activations: int8 rounding would add its own flips
    bf16 = LLM(str(quant_gguf), dtype="bfloat16", kv_cache_memory=8 * 2**20, enforce_eager=True)
    assert bf16.engine.runner.kv_caches[0][0].dtype == torch.bfloat16
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(quant_layers, "INT8_ROWS", {})
        fp32_kv = LLM(str(quant_gguf), dtype="float32", kv_cache_dtype="float32", kv_cache_memory=8 * 2**20,
                      enforce_eager=True)
    assert fp32_kv.engine.runner.kv_caches[0][0].dtype == torch.float32
    params = SamplingParams(temperature=0, max_tokens=12, prompt_logprobs=0, logprobs=0)
    got = [llm.generate(PROMPTS, params) for llm in (engines["auto"], fp32_kv)]
    diffs = [abs(x.logprob - y.logprob) for a, b in zip(*got) for x, y in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:])]
    assert max(diffs) < 0.01, diffs
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        LLM(str(quant_gguf), dtype="float32", kv_cache_dtype="int4", kv_cache_memory=8 * 2**20, enforce_eager=True)


def test_quantized_logprobs_and_greedy_tokens_match_dequantized(engines, fmt, activations):
    tol = TOLERANCES[fmt, activations]     # prompt and decode logprobs alike
    params = SamplingParams(temperature=0, max_tokens=12, prompt_logprobs=0)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        got = {q: llm.generate(PROMPTS, params) for q, llm in engines.items()}
    assert engines["auto"].engine.runner.compiled is not None
    assert "kaiten_cpu::quant_linear" in {e.key for e in prof.key_averages()}
    diffs = [abs(x.logprob - y.logprob) for a, b in zip(got["auto"], got["none"])
             for x, y in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:])]
    assert max(diffs) < tol["max"] and sum(diffs) / len(diffs) < tol["mean"], diffs
    tokens = [(x, y) for a, b in zip(got["auto"], got["none"]) for x, y in zip(a.token_ids, b.token_ids)]
    assert sum(x == y for x, y in tokens) >= tol["tokens"] * len(tokens)


def test_single_sequence_decode_logprobs_match_dequantized(engines, fmt, activations):
    """One sequence decodes one row a step; the sampled tokens' logprobs agree with the dequantized model's until the first different token."""
    tol = TOLERANCES[fmt, activations]
    params = SamplingParams(temperature=0, max_tokens=10, logprobs=0)
    diffs = []
    for prompt in PROMPTS:
        a, b = (engines[q].generate([prompt], params)[0] for q in ("auto", "none"))
        for x, y, lx, ly in zip(a.token_ids, b.token_ids, a.logprobs, b.logprobs):
            if x != y:
                break
            diffs.append(abs(lx.logprob - ly.logprob))
    assert len(diffs) >= tol["compared"]
    assert max(diffs) < tol["max"] and sum(diffs) / len(diffs) < tol["mean"], diffs
