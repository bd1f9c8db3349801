"""Every supported model family against Hugging Face transformers: greedy tokens equal in fp32, on
the eager and compiled forwards, with chunked prefill, prefix-cache hits, preemption and
speculative decoding, for tiny random models whose configs make each family's differences
matter (tests/support/tiny_model.py: FAMILIES)."""
from __future__ import annotations

import json

import pytest
import torch

from tests.support.llm_support import (assert_all_blocks_released, greedy, hf_greedy, make_llm, make_prompts,
                                       run_staggered)
from tests.support.tiny_model import FAMILIES, build_tiny_family

NGRAM = json.dumps({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2})
# LongRoPE takes its long factors wherever the context (max_model_len, 512 here) exceeds the
# original one (64), as vLLM does; Hugging Face switches factors by the current length, so the
# two agree on prompts longer than 64 tokens (layers/rotary.py).
LONGROPE_MIN_PROMPT = 65


@pytest.fixture(scope="module", params=FAMILIES)
def family(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def family_dir(family, tmp_path_factory):
    return build_tiny_family(tmp_path_factory.mktemp(family), family)


@pytest.fixture(scope="module")
def family_prompts(family, family_dir):
    prompts = make_prompts(384)
    if family == "phi3":
        prompts = [p for p in prompts if len(p) >= LONGROPE_MIN_PROMPT]
    return prompts


@pytest.fixture(scope="module")
def family_expected(family_dir, family_prompts):
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(family_dir, dtype=torch.float32).eval()
    return hf_greedy(model, family_prompts)


def kv_bytes_per_block(llm) -> int:
    cfg = llm.engine.runner.model_config
    return 2 * cfg.num_layers * llm.engine.block_size * cfg.num_kv_heads * cfg.head_dim * 4


@pytest.mark.parametrize("forward", ["eager", "compiled"])
def test_greedy_matches_hf(family_dir, family_prompts, family_expected, forward):
    """Chunked prefill (13 tokens a step), a cache of 20 blocks (preemption), staggered arrivals;
    then the same prompts again, served from the prefix cache."""
    probe = make_llm(family_dir, "eager", kv_cache_memory=1 << 20)
    llm = make_llm(family_dir, forward, max_num_batched_tokens=13, kv_cache_memory=20 * kv_bytes_per_block(probe))
    assert run_staggered(llm, family_prompts, greedy()) == family_expected
    assert llm.engine.scheduler.num_preemptions > 0
    again = llm.generate(family_prompts, greedy())
    assert [c.token_ids for c in again] == family_expected
    assert sum(c.num_cached_tokens for c in again) > 0
    assert_all_blocks_released(llm)


def test_greedy_matches_hf_with_speculation(family_dir, family_prompts, family_expected):
    llm = make_llm(family_dir, "eager", speculative_config=NGRAM)
    assert [c.token_ids for c in llm.generate(family_prompts, greedy())] == family_expected
    assert llm.engine.speculator.stats.num_draft_tokens > 0
    assert_all_blocks_released(llm)


# LoRA through peft: the modules each family's adapters target (Phi-3's fused ones whole).
LORA_TARGETS = {"qwen3": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
                "gemma3": ["q_proj", "v_proj", "o_proj", "up_proj", "down_proj"],
                "phi3": ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]}


@pytest.mark.parametrize("lora_family", sorted(LORA_TARGETS))
def test_lora_matches_peft(lora_family, tmp_path):
    """A batch mixing the base model and an adapter: each prompt's tokens equal HF + peft's."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from engine_worker import LLM
    from tests.support.tiny_model import build_lora_adapter

    base_dir = build_tiny_family(tmp_path / "base", lora_family)
    adapter = build_lora_adapter(base_dir, tmp_path / "adapter", 8, LORA_TARGETS[lora_family], seed=3)
    prompts = [p for p in make_prompts(384, seed=5) if len(p) >= LONGROPE_MIN_PROMPT][:4]

    def hf(with_adapter: bool):
        model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()
        return hf_greedy(PeftModel.from_pretrained(model, adapter).eval() if with_adapter else model, prompts, 12)

    expected_base, expected_lora = hf(False), hf(True)
    assert expected_lora != expected_base
    llm = LLM(str(base_dir), dtype="float32", enforce_eager=True, kv_cache_memory=8 << 20,
              lora_modules=[f"a={adapter}"], max_loras=1)
    names = ["", "a"] * len(prompts)
    got = llm.generate([p for p in prompts for _ in (0, 1)], greedy(12), lora_names=names)
    assert [c.token_ids for c in got] == [t for pair in zip(expected_base, expected_lora) for t in pair]


def test_blocks_held_are_bounded_by_the_window(tmp_path):
    """Where every layer slides (Mistral), a sequence holds only the blocks its window can read:
    a 3,000-token prompt and 64 more tokens run in a cache of 16 blocks of 16 (256 tokens), with
    HF's output, and no step holds more than the window and a chunk need."""
    import random
    import transformers

    from engine_worker import LLM
    from engine_worker.engine.block_manager import NO_BLOCK
    from tests.support.tiny_model import build_tokenizer

    config = transformers.MistralConfig(
        vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=4096, sliding_window=64, initializer_range=0.2,
        bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    model = transformers.MistralForCausalLM(config).eval()
    model.save_pretrained(tmp_path)
    build_tokenizer().save_pretrained(tmp_path)
    rng = random.Random(1)
    prompt = [rng.randrange(3, 384) for _ in range(3000)]
    params = greedy(64)
    params.ignore_eos = True
    with torch.no_grad():
        want = model.generate(torch.tensor([prompt]), max_new_tokens=64, min_new_tokens=64, do_sample=False)
    bytes_per_block = 2 * 2 * 16 * 2 * 16 * 4
    llm = LLM(str(tmp_path), dtype="float32", enforce_eager=True, kv_cache_memory=16 * bytes_per_block,
              max_num_batched_tokens=64)
    bm = llm.engine.block_manager
    assert bm.num_blocks == 16 and bm.window == 64
    rid, got, most = llm.submit(prompt, params), [], 0
    while llm.engine.has_unfinished():
        for out in llm.step():
            got += out.new_token_ids
        seq = llm.engine.scheduler.find(rid)
        if seq is not None:
            most = max(most, sum(b != NO_BLOCK for b in seq.block_table))
    assert got == want[0, len(prompt):].tolist()
    assert most <= bm.most_blocks_held(len(prompt) + 64, 64) == 9
    assert_all_blocks_released(llm)


def test_compiled_layers_take_one_graph_per_layer_structure(tmp_path, monkeypatch):
    """Regional compilation: a region's graph is traced once per region structure and called for
    every region of it. With a layer a region, Gemma 3's sliding and full layers are two structures, the second traced
    on the first's output; the compiled forward's hidden states of a step with a prefill and a
    decode equal the eager model's."""
    from engine_worker.model import compiled_forward
    from kernels.interface import AttentionMetadata

    monkeypatch.setattr(compiled_forward, "REGION_LAYERS", 1)      # a region a layer
    llm = make_llm(build_tiny_family(tmp_path, "gemma3"))
    runner = llm.engine.runner
    fns = runner.compiled._fns[False]
    assert len(fns) == 2 and fns[0] is not fns[1]
    lens = [5, 1]
    meta = AttentionMetadata(torch.tensor([0, 5, 6], dtype=torch.int32), torch.tensor(lens, dtype=torch.int32),
                             torch.zeros((2, 1), dtype=torch.int32), torch.full((6,), -1, dtype=torch.int64),
                             5, 5, lens, lens)
    ids = torch.tensor([3, 17, 29, 41, 53, 7])
    pos = torch.tensor([0, 1, 2, 3, 4, 0])
    with torch.inference_mode():
        got = runner.compiled(ids, pos, meta)
        want = runner.model(ids, pos, runner.kv_caches, meta, runner.backend)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_models_build_without_random_init_and_the_init_comes_back():
    """without_random_init skips torch.nn.init's random fills while a model is built (its weights
    are all loaded next) and restores them after."""
    import torch
    from torch import nn

    from engine_worker.model.causal_lm import RANDOM_INITS, without_random_init
    before = {name: getattr(nn.init, name) for name in RANDOM_INITS}
    torch.manual_seed(0)
    state = torch.get_rng_state()
    with without_random_init():
        nn.Linear(64, 64)
        nn.Embedding(10, 8)
    assert torch.equal(torch.get_rng_state(), state), "a random init ran"
    assert {name: getattr(nn.init, name) for name in RANDOM_INITS} == before
