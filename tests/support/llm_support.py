"""The offline engine in tests (no tests here): prompts of mixed lengths, Hugging Face's greedy
reference, an LLM on either forward, a staggered run, and the block accounting check."""
from __future__ import annotations

import random

import torch

from engine_worker import LLM, SamplingParams

MAX_TOKENS = 24


def make_prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    """20 prompts of mixed lengths (1..150), four of which share a 40-token prefix."""
    rng = random.Random(seed)
    tokens = lambda n: [rng.randrange(3, vocab) for _ in range(n)]   # noqa: E731 (skip special ids)
    lengths = [1, 2, 5, 15, 16, 17, 31, 32, 33, 47, 64, 90, 120, 150, 7, 70]
    prompts = [tokens(n) for n in lengths]
    prefix = tokens(40)
    prompts += [prefix + tokens(n) for n in (1, 9, 25, 60)]
    return prompts


def hf_greedy(hf_model, prompts, max_tokens: int = MAX_TOKENS) -> list[list[int]]:
    """HF greedy generate, one prompt at a time (no padding), stopping at eos like the engine."""
    out = []
    with torch.no_grad():
        for p in prompts:
            ids = hf_model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                    max_new_tokens=max_tokens, do_sample=False)
            out.append(ids[0, len(p):].tolist())
    return out


def greedy(max_tokens: int = MAX_TOKENS) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens)


def make_llm(model_dir, forward: str = "compiled", **kw) -> LLM:
    """forward: "compiled" (torch.compile, the CPU default) or "eager" (enforce_eager)."""
    kw.setdefault("kv_cache_memory", 8 * 2**20)
    llm = LLM(str(model_dir), dtype="float32", enforce_eager=forward == "eager", **kw)
    assert (llm.engine.runner.compiled is not None) == (forward == "compiled")
    return llm


def assert_all_blocks_released(llm: LLM) -> None:
    llm.engine.check_block_accounting()
    bm = llm.engine.block_manager
    assert all(b.ref_count == 0 for b in bm.blocks)
    assert bm.num_free_blocks == bm.num_blocks


def run_staggered(llm: LLM, prompts, params) -> dict[str, list[int]]:
    """Submit a few prompts per step while the batch runs; return tokens per request id."""
    pending = list(enumerate(prompts))
    ids, tokens, done = {}, {}, set()
    while pending or len(done) < len(prompts):
        for _ in range(3):
            if pending:
                i, p = pending.pop(0)
                rid = llm.submit(p, params)
                ids[i], tokens[rid] = rid, []
        for out in llm.step():
            tokens[out.request_id].extend(out.new_token_ids)
            if out.finished:
                assert out.finish_reason in ("stop", "length"), out.error
                done.add(out.request_id)
        llm.engine.check_block_accounting()
    return [tokens[ids[i]] for i in range(len(prompts))]
