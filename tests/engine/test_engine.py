"""The engine against Hugging Face transformers: greedy tokens must be equal, in fp32."""
from __future__ import annotations

import pytest
import torch

from engine_worker import LLM, SamplingParams
from engine_worker.model.packed_linear import PackedLinear
from tests.support.engine_support import engine_config, serve_flags
from tests.support.llm_support import (assert_all_blocks_released, greedy, hf_greedy, make_llm, make_prompts,
                                       run_staggered)


@pytest.fixture(params=["eager", "compiled"])
def forward(request) -> str:
    """The HF-equality tests run on both forwards: the compiled model and the eager one."""
    return request.param


@pytest.mark.parametrize("packed", [True, False], ids=["packed-weights", "plain-linear"])
def test_greedy_matches_hf_all_at_once(tiny_model_dir, prompts, expected, packed, forward):
    """On the CPU the projections run on oneDNN-packed weights by default; the plain nn.Linear
    path (CUDA, or the CPU with --no-deterministic and --no-pack-cpu-weights: deterministic packs
    regardless) must match HF as well."""
    llm = make_llm(tiny_model_dir, forward, pack_cpu_weights=packed, deterministic=packed)
    assert any(isinstance(m, PackedLinear) for m in llm.engine.runner.model.modules()) == packed
    got = llm.generate(prompts, greedy())
    assert [c.token_ids for c in got] == expected
    assert_all_blocks_released(llm)


def test_greedy_matches_hf_staggered_with_prefix_cache_hits(tiny_model_dir, prompts, expected, forward):
    llm = make_llm(tiny_model_dir, forward)
    assert run_staggered(llm, prompts, greedy()) == expected
    assert llm.engine.block_manager.num_hit_tokens >= 2 * 16, "the shared 40-token prefix must hit the cache"
    # The same prompts again: every full block is cached now, and outputs do not change.
    again = llm.generate(prompts, greedy())
    assert [c.token_ids for c in again] == expected
    assert all(c.num_cached_tokens == (len(p) - 1) // 16 * 16 for c, p in zip(again, prompts))
    assert_all_blocks_released(llm)


@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_greedy_matches_hf_with_chunked_prefill(tiny_model_dir, prompts, expected, forward, backend):
    """auto is the C++ kernel wherever it builds; torch is its fallback and reference."""
    budget = 13     # well under most prompt lengths: prefills span several steps
    llm = make_llm(tiny_model_dir, forward, max_num_batched_tokens=budget, attention_backend=backend)
    assert run_staggered(llm, prompts, greedy()) == expected
    assert llm.engine.step_count > max(len(p) for p in prompts) // budget
    assert_all_blocks_released(llm)


def test_offline_llm_batches_more_tokens_per_step_than_a_server(tiny_model_dir):
    """The offline LLM defaults to OFFLINE_TOKEN_BUDGET (throughput); an engine built for a server
    keeps the CPU's latency budget; an explicit budget wins over both."""
    from engine_worker.engine.llm_engine import LLMEngine
    from shared.config import CPU_TOKEN_BUDGET, OFFLINE_TOKEN_BUDGET
    assert LLM(str(tiny_model_dir), enforce_eager=True).engine.config.max_num_batched_tokens == OFFLINE_TOKEN_BUDGET
    assert LLMEngine(engine_config(tiny_model_dir)).config.max_num_batched_tokens == CPU_TOKEN_BUDGET
    llm = LLM(str(tiny_model_dir), enforce_eager=True, max_num_batched_tokens=64)
    assert llm.engine.config.max_num_batched_tokens == 64


def test_greedy_matches_hf_under_preemption(tiny_model_dir, prompts, expected, forward):
    # Room for ~1.5 of the longest sequences: the batch must preempt and recompute.
    cfg_bytes_per_block = 2 * 2 * 16 * 2 * 16 * 4      # K+V * layers * block * kv_heads * head_dim * fp32
    llm = make_llm(tiny_model_dir, forward, kv_cache_memory=20 * cfg_bytes_per_block,
                   max_num_batched_tokens=64)
    assert run_staggered(llm, prompts, greedy()) == expected
    assert llm.engine.scheduler.num_preemptions > 0
    assert_all_blocks_released(llm)


def test_a_failed_compile_falls_back_to_the_eager_model(tiny_model_dir, prompts, expected, monkeypatch):
    """Where Inductor cannot compile (no C++ compiler in a slim image) the engine warns and runs
    eagerly instead of failing to start."""
    from engine_worker.model.compiled_forward import CompiledForward

    def no_compiler(self):
        raise RuntimeError("InvalidCxxCompiler: No working C++ compiler found")
    monkeypatch.setattr(CompiledForward, "warm_up", no_compiler)
    llm = LLM(str(tiny_model_dir), dtype="float32", kv_cache_memory=8 * 2**20)
    assert llm.engine.runner.compiled is None
    assert [c.token_ids for c in llm.generate(prompts, greedy())] == expected


def test_compiled_cpu_graph_calls_the_extension_ops(tiny_model_dir, prompts, expected):
    """With the C++ CPU kernel loaded, the compiled graph calls its dispatcher ops (kaiten_cpu::
    write_kv_attention, a layer's KV write and attention in one call, and packed_linear) and none
    of the Python-defined ones."""
    from kernels.cpu_ops_build import cpu_ops_available
    if not cpu_ops_available():
        pytest.skip("the C++ kernel is unavailable")
    llm = make_llm(tiny_model_dir, attention_backend="cpu")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        got = [c.token_ids for c in llm.generate(prompts[:2], greedy())]
    assert got == expected[:2]
    ops = {e.key for e in prof.key_averages() if e.key.startswith("kaiten")}
    assert {"kaiten_cpu::write_kv_attention", "kaiten_cpu::packed_linear"} <= ops
    assert not {op for op in ops if op.startswith("kaiten::")}


def test_models_of_one_structure_share_one_compiled_forward(tiny_model_dir, prompts, expected, monkeypatch):
    """The layers of a model, and the engines whose models have one structure, share a compiled
    layer (the weights are its inputs, and it checks no guards); a model with different weights, or another structure (a
    smaller KV block, the torch attention backend), gets the right tokens, the latter from a
    compiled forward of its own."""
    from engine_worker.model import compiled_forward
    monkeypatch.setattr(compiled_forward, "REGION_LAYERS", 1)      # a region a layer: the layers share one
    first, second = make_llm(tiny_model_dir), make_llm(tiny_model_dir)
    block, ops = make_llm(tiny_model_dir, block_size=8), make_llm(tiny_model_dir, attention_backend="torch")
    fns = [llm.engine.runner.compiled._fns[False] for llm in (first, second, block, ops)]
    assert all(len(set(f)) == 1 for f in fns), "every layer of one structure shares one compiled function"
    assert fns[0] == fns[1] and len({f[0] for f in fns[1:]}) == 3
    for llm in (first, block, ops):
        assert [c.token_ids for c in llm.generate(prompts[:4], greedy())] == expected[:4]
    with torch.no_grad():
        for p in second.engine.runner.model.parameters():
            p.mul_(-1.0)
    assert [c.token_ids for c in second.generate(prompts[:4], greedy())] != expected[:4]
    assert [c.token_ids for c in first.generate(prompts[:4], greedy())] == expected[:4]


def test_compiled_graph_takes_one_size_per_length(tiny_model_dir, prompts, expected, monkeypatch, tmp_path):
    """The compiled forward's dynamic sizes are one per length, not one per tensor: the token
    count (ids, positions, slots), the batch (cu_seqlens_q's B+1; seqlens_k and the block
    tables' B), the tables' width and the KV pool's blocks, every layer's K and V pool alike
    (each a size of its own was an int argument a step for every cache)."""
    import torch._inductor.compile_fx as compile_fx_module
    from engine_worker.model import compiled_forward

    inputs = []
    compile_fx = compile_fx_module.compile_fx

    def recording(gm, example_inputs, *args, **kwargs):
        inputs.append(example_inputs)
        return compile_fx(gm, example_inputs, *args, **kwargs)
    monkeypatch.setattr(compile_fx_module, "compile_fx", recording)
    monkeypatch.setattr(compiled_forward, "COMPILED_LAYER_CACHE", {})   # a fresh trace, not one
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))   # loaded from Dynamo's cache
    llm = make_llm(tiny_model_dir)
    assert len(llm.engine.runner.kv_caches) == 2 and inputs     # (cpp_wrapper compiles re-enter compile_fx)
    sizes = [x for x in inputs[0] if isinstance(x, (int, torch.SymInt))]
    assert len(sizes) == 5, sizes
    assert [c.token_ids for c in llm.generate(prompts[:4], greedy())] == expected[:4]


def test_attention_ops_outside_a_step_match_the_backend():
    """The compiled forward's custom ops, called without a step context, find the backend by
    name and rebuild the metadata from its tensors; pad rows (slot -1) write no KV."""
    from engine_worker.model.compiled_forward import paged_attention, write_kv
    from kernels.interface import AttentionMetadata
    from kernels.registry import get_attention_backend
    torch.manual_seed(0)
    k_cache, v_cache = torch.zeros(2, 4, 16, 2, 16), torch.zeros(2, 4, 16, 2, 16)
    key, value, q = torch.randn(6, 2, 16), torch.randn(6, 2, 16), torch.randn(6, 4, 16)
    slots = torch.tensor([0, 1, 2, 16, 17, -1])          # seq 0: 3 tokens in block 0; seq 1: 2 in block 1
    write_kv(key, value, k_cache[0], v_cache[0], slots, "torch")
    written = k_cache[0].reshape(-1, 2, 16).abs().sum((1, 2)) > 0
    assert written.nonzero().squeeze(1).tolist() == [0, 1, 2, 16, 17]
    assert torch.equal(v_cache[0].reshape(-1, 2, 16)[16], value[3])
    cu, klens = torch.tensor([0, 3, 5], dtype=torch.int32), torch.tensor([3, 2], dtype=torch.int32)
    tables = torch.tensor([[0], [1]], dtype=torch.int32)
    got = paged_attention(q[:5], k_cache[0], v_cache[0], cu, klens, tables, 0.25, "torch")
    meta = AttentionMetadata(cu, klens, tables, slots[:5], 3, 3, [3, 2], [3, 2])
    want = get_attention_backend("torch").attention(q[:5], k_cache[0], v_cache[0], meta, 0.25)
    torch.testing.assert_close(got, want)


def test_seeded_sampling_is_batch_independent(tiny_model_dir, prompts):
    params = SamplingParams(temperature=0.9, top_p=0.9, top_k=50, seed=1234, max_tokens=16,
                            presence_penalty=0.5, frequency_penalty=0.3)
    alone = make_llm(tiny_model_dir).generate([prompts[5]], params)[0].token_ids
    others = [SamplingParams(temperature=1.0, seed=i, max_tokens=16) for i in range(6)]
    batch = make_llm(tiny_model_dir).generate(prompts[:6], others[:5] + [params])
    assert batch[5].token_ids == alone
    assert len(set(tuple(c.token_ids) for c in batch)) > 1


def test_a_continuation_draws_what_the_uninterrupted_request_would(tiny_model_dir, prompts):
    """Failover: the prompt plus the first k tokens, num_generated=k, max_tokens reduced by k gives
    the same remaining tokens as the uninterrupted request (seeded sampling with penalties; greedy)."""
    seeded = dict(temperature=0.9, top_p=0.9, top_k=50, seed=77, presence_penalty=0.5, frequency_penalty=0.3,
                  ignore_eos=True)
    for kw in (seeded, dict(temperature=0.0, repetition_penalty=1.3, ignore_eos=True)):
        llm = make_llm(tiny_model_dir)
        full = llm.generate([prompts[2]], SamplingParams(max_tokens=24, **kw))[0].token_ids
        k = 9
        engine = llm.engine
        engine.add_request("cont", prompts[2] + full[:k], SamplingParams(max_tokens=24 - k, **kw), num_generated=k)
        rest = []
        while engine.has_unfinished():
            rest += [t for o in engine.step() for t in o.new_token_ids]
        assert full[:k] + rest == full, kw
    with pytest.raises(ValueError, match="num_generated"):
        engine.add_request("bad", [1, 2], SamplingParams(max_tokens=2), num_generated=2)


def test_sampling_controls(tiny_model_dir, prompts):
    llm = make_llm(tiny_model_dir)
    out = llm.generate([prompts[3]], SamplingParams(temperature=0, max_tokens=4, logprobs=3))[0]
    assert len(out.logprobs) == 4 and len(out.logprobs[0].top) == 3
    first = out.logprobs[0]
    assert first.token_id == out.token_ids[0] and first.top[0][0] == first.token_id   # greedy = top-1
    assert first.logprob == pytest.approx(first.top[0][1])
    # top_k=1 is greedy whatever the temperature
    topk1 = llm.generate([prompts[3]], SamplingParams(temperature=1.5, top_k=1, max_tokens=8))[0]
    assert topk1.token_ids == llm.generate([prompts[3]], greedy(8))[0].token_ids
    # stop_token_ids ends generation at that token, with reason "stop"
    stop_at = out.token_ids[2]
    stopped = llm.generate([prompts[3]], SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[stop_at]))[0]
    assert stopped.token_ids[-1] == stop_at and stopped.finish_reason == "stop"
    assert len(stopped.token_ids) <= 3
    # ignore_eos with max_tokens gives exactly max_tokens tokens
    long = llm.generate([prompts[0]], SamplingParams(temperature=1.0, seed=3, max_tokens=40, ignore_eos=True))[0]
    assert len(long.token_ids) == 40 and long.finish_reason == "length"
    assert_all_blocks_released(llm)


@pytest.mark.parametrize("prompt, params, match", [
    ([], SamplingParams(), "empty"),
    ([5] * 600, SamplingParams(), "context"),
    ([5] * 10, SamplingParams(max_tokens=0), "max_tokens"),
    ([5] * 10, SamplingParams(temperature=-0.1), "temperature"),
    ([5] * 10, SamplingParams(top_p=0.0), "top_p"),
    ([5] * 10, SamplingParams(top_p=1.5), "top_p"),
    ([5, 10**6], SamplingParams(), "vocabulary"),
    ([5, -1], SamplingParams(), "vocabulary"),
    ([5] * 10, SamplingParams(max_tokens=600), "exceeds"),
])
def test_bad_input_is_rejected_and_engine_keeps_serving(tiny_model_dir, prompt, params, match):
    llm = make_llm(tiny_model_dir)
    with pytest.raises(ValueError, match=match):
        llm.engine.add_request("bad", prompt, params)
    # the offline API refuses it the same way, before anything is queued
    with pytest.raises(ValueError, match=match):
        llm.submit(prompt, params)
    assert llm.step() == []
    assert llm.generate([[5, 6, 7]], greedy(4))[0].finish_reason == "length"
    assert_all_blocks_released(llm)


def test_request_too_large_for_kv_pool_is_rejected(tiny_model_dir):
    llm = make_llm(tiny_model_dir, kv_cache_memory=4 * 2 * 2 * 16 * 2 * 16 * 4)   # 4 blocks = 64 tokens
    with pytest.raises(ValueError, match="never fit"):
        llm.engine.add_request("big", [5] * 60, SamplingParams(max_tokens=10))


def test_abort_frees_blocks_at_once(tiny_model_dir, prompts):
    llm = make_llm(tiny_model_dir)
    rid = llm.submit(prompts[12], SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
    for _ in range(3):
        llm.step()
    assert llm.engine.block_manager.usage > 0
    assert llm.engine.abort_request(rid)
    llm.engine.check_block_accounting()
    assert llm.engine.stats().num_running == 0
    outs = llm.step()
    assert [(o.request_id, o.finish_reason) for o in outs] == [(rid, "abort")]
    assert_all_blocks_released(llm)


def test_event_times_are_ordered(tiny_model_dir, prompts):
    out = make_llm(tiny_model_dir).generate([prompts[4]], greedy(4))[0]
    m = out.metrics
    assert 0 < m["queued"] <= m["scheduled"] <= m["first_token"] <= m["finished"]


def test_kv_cache_dtype_flag_reaches_the_engine():
    """`kaiten serve --kv-cache-dtype` is handed to the engine (not the gateway), whose config takes it."""
    engine_args, gateway_args, ecfg = serve_flags(["--kv-cache-dtype", "float16"])
    assert engine_args[-2:] == ["--kv-cache-dtype", "float16"]
    assert "--kv-cache-dtype" not in gateway_args
    assert ecfg.kv_cache_dtype == "float16"


def test_inductor_cache_keys_change_with_an_op_schema():
    """A changed op schema (an argument added with a default, as the attention ops' window was)
    changes every Inductor cache key, so compiled code for the old schema is never loaded."""
    from engine_worker.model.compiled_forward import configure_inductor, ops_schema_tag
    configure_inductor()
    before = torch.compiler.config.cache_key_tag
    assert before == ops_schema_tag()
    lib = torch.library.Library("kaiten", "FRAGMENT")
    try:
        lib.define("schema_tag_probe(Tensor x, int extra=0) -> Tensor")
        assert ops_schema_tag() != before
    finally:
        lib._destroy()
    assert ops_schema_tag() == before
