"""The batch-invariance guarantee (docs/deterministic.md): with --deterministic, the default, a
request's greedy tokens and seeded samples, and the logprobs of both, are the same bit for bit
alone, in a batch of 32 random others, after a prefix-cache hit, in chunks, after preemption and
with ngram speculation. Tiny random Llamas in every weight format: dense fp32 and bf16, bf16-stored
weights computed in fp32 (Bf16Linear), and GGUF Q4_1, Q8_0 and Q5_0 (5-bit tiles) matrices served as stored; the
default model (SmolLM2 Q4_1) in a slow test. Two torch threads, so the attention kernel's split
decodes and the threads' share of the work vary with the batch."""
from __future__ import annotations

import json
import random

import pytest
import torch

from engine_worker import LLM, SamplingParams
from kernels.cpu_attention import cpp_attention_available
from tests.support.engine_support import serve_flags
from tests.support.gguf_files import write_llama_gguf
from tests.support.tiny_model import build_tiny_model

pytestmark = pytest.mark.skipif(not cpp_attention_available(), reason="the C++ CPU extension does not build here")

NGRAM = json.dumps({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2})
MAX_TOKENS = 20
VOCAB = 384
# (weights, --dtype, the model's stored dtype, the GGUF matrices' type or None)
FORMATS = {"fp32": ("float32", "float32", None), "bf16": ("bfloat16", "float32", None),
           "bf16-stored": ("float32", "bfloat16", None),
           "Q4_1": ("float32", "float32", "Q4_1"), "Q8_0": ("float32", "float32", "Q8_0"),
           "Q5_0": ("float32", "float32", "Q5_0")}


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, VOCAB) for _ in range(n)]


# Prompts across key tiles (16), blocks (16) and the kernel's key segments (128).
PROMPTS = [_tokens(random.Random(i), n) for i, n in enumerate((7, 40, 150))]
WATCHED = [SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=0),
           SamplingParams(temperature=0.9, seed=1234, max_tokens=MAX_TOKENS, logprobs=0)]


def others(n: int = 32, seed: int = 99) -> tuple[list[list[int]], list[SamplingParams]]:
    """n random prompts (1..120 tokens), greedy or sampled (seeded or not), of random lengths."""
    rng = random.Random(seed)
    prompts = [_tokens(rng, rng.randrange(1, 121)) for _ in range(n)]
    params = [SamplingParams(temperature=rng.choice([0.0, 0.7, 1.0]), seed=rng.choice([None, rng.randrange(99)]),
                             max_tokens=rng.randrange(4, MAX_TOKENS + 8), ignore_eos=True) for _ in range(n)]
    return prompts, params


def watched() -> tuple[list[list[int]], list[SamplingParams]]:
    """Every prompt with every watched request kind."""
    return [p for p in PROMPTS for _ in WATCHED], [sp for _ in PROMPTS for sp in WATCHED]


def outcome(c) -> tuple[list[int], list[float]]:
    """A completion's tokens and their logprobs (bit for bit)."""
    return c.token_ids, [lp.logprob for lp in c.logprobs]


def alone(llm: LLM) -> list[tuple]:
    prompts, params = watched()
    return [outcome(llm.generate([p], sp)[0]) for p, sp in zip(prompts, params)]


def in_batch(llm: LLM) -> list[tuple]:
    """The watched requests among 32 others, interleaved, in one run."""
    prompts, params = watched()
    extra_prompts, extra_params = others()
    mixed = list(zip(extra_prompts, extra_params))
    slots = sorted(random.Random(7).sample(range(len(mixed) + len(prompts)), len(prompts)))
    for slot, item in zip(slots, zip(prompts, params)):
        mixed.insert(slot, item)
    outs = llm.generate([p for p, _ in mixed], [sp for _, sp in mixed])
    return [outcome(outs[slot]) for slot in slots]


@pytest.fixture(scope="module", autouse=True)
def isolated(tmp_path_factory):
    """The engines' two threads are the process's: given back after. GGUF conversions in a
    folder of the module's own."""
    before = torch.get_num_threads()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KAITEN_MODELS_DIR", str(tmp_path_factory.mktemp("models")))
        yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module", params=list(FORMATS))
def fmt(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def model_path(fmt, tmp_path_factory) -> str:
    _, stored, qtype = FORMATS[fmt]
    model_dir = build_tiny_model(tmp_path_factory.mktemp(f"tiny-{fmt}"), dtype=stored,
                                 tie_word_embeddings=qtype is not None)
    if qtype is None:
        return str(model_dir)
    gguf = write_llama_gguf(model_dir, tmp_path_factory.mktemp("gguf") / f"tiny-llama.{qtype}.gguf",
                            qtype=qtype, embed_qtype="Q8_0")
    return str(gguf)


def make(model_path: str, fmt: str, **kw) -> LLM:
    dtype, _, qtype = FORMATS[fmt]
    kw.setdefault("kv_cache_memory", 8 * 2**20)
    return LLM(model_path, dtype=dtype, quantization="auto" if qtype else "none", enforce_eager=True,
               num_threads=2, **kw)


@pytest.fixture(scope="module")
def reference(model_path, fmt):
    """Each watched request alone, on an engine without a prefix cache."""
    llm = make(model_path, fmt, enable_prefix_caching=False)
    assert llm.engine.config.deterministic
    return alone(llm)


@pytest.fixture(scope="module")
def cached_llm(model_path, fmt):
    return make(model_path, fmt)


def test_after_a_prefix_cache_hit(cached_llm, reference):
    assert alone(cached_llm) == reference                         # misses: the blocks are cached after
    prompts, params = watched()
    hits = [cached_llm.generate([p], sp)[0] for p, sp in zip(prompts, params)]
    assert all(c.num_cached_tokens > 0 for c in hits if len(c.prompt_token_ids) > 16)
    assert [outcome(c) for c in hits] == reference


def test_in_a_batch_of_32_others(cached_llm, reference):
    assert in_batch(cached_llm) == reference
    cached_llm.engine.check_block_accounting()


def test_in_chunks(model_path, fmt, reference):
    llm = make(model_path, fmt, enable_prefix_caching=False, max_num_batched_tokens=13)
    assert alone(llm) == reference
    assert in_batch(llm) == reference


def test_after_preemption(model_path, fmt, reference):
    cfg_bytes_per_block = 2 * 2 * 16 * 2 * 16 * 4      # K+V * layers * block * kv_heads * head_dim * fp32
    llm = make(model_path, fmt, kv_cache_memory=30 * cfg_bytes_per_block, max_num_batched_tokens=64)
    assert in_batch(llm) == reference
    assert llm.engine.scheduler.num_preemptions > 0


def test_with_ngram_speculation(model_path, fmt, reference):
    llm = make(model_path, fmt, speculative_config=NGRAM)
    assert alone(llm) == reference
    assert in_batch(llm) == reference


def test_no_deterministic_turns_it_off(model_path, fmt):
    """--no-deterministic reaches the attention backend and the bf16-stored layers."""
    llm = make(model_path, fmt, deterministic=False)
    runner = llm.engine.runner
    assert runner.backend.deterministic is False
    from engine_worker.model.bf16_layers import MIN_DENSE_ROWS, Bf16Linear
    bf16 = [m for m in runner.model.modules() if isinstance(m, Bf16Linear)]
    assert all(m.min_dense_rows == MIN_DENSE_ROWS for m in bf16)
    assert bool(bf16) == (fmt == "bf16-stored")


def test_serve_flag_reaches_the_engine():
    """`kaiten serve --no-deterministic` is handed to the engine (not the gateway), whose config takes it."""
    engine_args, gateway_args, ecfg = serve_flags(["--no-deterministic"])
    assert "--no-deterministic" in engine_args
    assert "--no-deterministic" not in gateway_args
    assert "--no-deterministic" not in serve_flags([])[0]
    assert ecfg.deterministic is False


@pytest.mark.slow
def test_default_model_same_answer_alone_after_a_hit_and_in_a_batch():
    """SmolLM2-135M-Instruct's Q4_1 file served as stored (the serving default): issue 66's
    request, alone, again after its prefix-cache hit, and among others."""
    from shared.gguf_convert import ensure_default_model
    llm = LLM(str(ensure_default_model()), kv_cache_memory="256MiB", num_threads=2, enforce_eager=True)
    question = [{"role": "user", "content": "What is the capital of France?"}]
    ids = list(llm.tokenizer.apply_chat_template(question, add_generation_prompt=True, tokenize=True,
                                                 return_dict=False))
    params = SamplingParams(temperature=0, max_tokens=16, logprobs=0)
    first = outcome(llm.generate([ids], params)[0])
    hit = llm.generate([ids], params)[0]
    assert hit.num_cached_tokens > 0
    assert outcome(hit) == first
    extra_prompts, extra_params = others(8)
    outs = llm.generate([ids] + extra_prompts, [params] + extra_params)
    assert outcome(outs[0]) == first
