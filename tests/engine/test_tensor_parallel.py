"""Tensor parallelism on the CPU (--tensor-parallel-size): an engine over 2 (or 4) rank processes
gives the greedy fp32 tokens of one process and of Hugging Face, for the tiny model of every
family, eager and compiled; bf16-stored weights too; quantized weights within a stated tolerance of
one process; the output layer split by vocabulary, its gathered logits the whole layer's bits; KV
heads replicated where there are fewer than ranks; the all-reduces and the gather through
torch.distributed's gloo instead of shared memory (the code NCCL runs on GPUs) give the same; and
what it cannot do yet is refused in one line."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from contextlib import contextmanager

import numpy as np
import pytest
import torch

from engine_worker import LLM, SamplingParams
from engine_worker.model.quant_layers import QuantLinear
from engine_worker.model.tensor_parallel import take_rows, vocab_split
from engine_worker.model.tp_ranks import EXIT_RANK_DIED
from kernels.cpu_ops_build import cpu_ops_available
from shared.gguf_quant import PackedWeight
from tests.support.engine_support import serve_flags
from tests.support.gguf_files import write_llama_gguf
from tests.support.llm_support import greedy, hf_greedy, make_llm, make_prompts
from tests.support.paths import ROOT
from tests.support.tiny_model import FAMILIES, build_tiny_family, build_tiny_model

pytestmark = pytest.mark.skipif(not cpu_ops_available(), reason="the C++ CPU extension does not build here")

NGRAM = json.dumps({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2})
PROMPTS = make_prompts(384)[:8]


@contextmanager
def ranks(llm: LLM):
    """The engine, its other ranks stopped (and checked gone) at the end."""
    procs = llm.engine.runner.ranks.procs
    try:
        yield llm
    finally:
        llm.engine.runner.close()
        assert all(p.poll() is not None for p in procs)


def hf_expected(model_dir, prompts, max_tokens=16):
    from transformers import AutoModelForCausalLM
    return hf_greedy(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval(), prompts, max_tokens)


def tokens(llm: LLM, prompts, params) -> list[list[int]]:
    return [c.token_ids for c in llm.generate(prompts, params)]


@pytest.mark.parametrize("family", FAMILIES)
def test_two_ranks_match_one_and_hf(family, tmp_path):
    model_dir = build_tiny_family(tmp_path, family)
    prompts = [p for p in PROMPTS if family != "phi3" or len(p) >= 65]     # LongRoPE: test_families.py
    expected = hf_expected(model_dir, prompts)
    one = tokens(make_llm(model_dir, "eager"), prompts, greedy(16))
    with ranks(make_llm(model_dir, "eager", tensor_parallel_size=2, max_num_batched_tokens=13)) as llm:
        assert llm.engine.runner.kv_caches[0][0].shape[2] == 1          # 2 KV heads: one a rank
        assert tokens(llm, prompts, greedy(16)) == one == expected


def test_idle_ranks_back_their_kv_pages_and_keep_cached_blocks(tiny_model_dir):
    """An idle engine backs its KV cache's pages on every rank (between_steps, a slice a call);
    blocks the prefix cache holds keep their contents: the same prompts after it give the same
    tokens, read from the cache."""
    with ranks(make_llm(tiny_model_dir, "eager", tensor_parallel_size=2, kv_cache_memory=32 * 2**20)) as llm:
        first = tokens(llm, PROMPTS, greedy(8))
        prefault = llm.engine.runner.kv_prefault
        assert prefault.tensors and not prefault.done
        slices = 1
        while llm.engine.runner.prefault_kv(0.0):      # a page a call, on both ranks
            slices += 1
        assert prefault.done and slices == len(prefault.tensors) * -(-prefault.size // (2 << 20))
        assert not llm.engine.between_steps()           # nothing left for an idle engine
        assert tokens(llm, PROMPTS, greedy(8)) == first
        assert llm.engine.stats().prefix_cache_hits > 0


def test_compiled_ranks_with_speculation_match_hf(tmp_path):
    model_dir = build_tiny_family(tmp_path, "qwen3")
    expected = hf_expected(model_dir, PROMPTS)
    with ranks(make_llm(model_dir, "compiled", tensor_parallel_size=2, speculative_config=NGRAM)) as llm:
        assert tokens(llm, PROMPTS, greedy(16)) == expected
        assert llm.engine.speculator.stats.num_draft_tokens > 0


def test_four_ranks_replicate_two_kv_heads(tmp_path):
    """4 q heads, 2 KV heads over 4 ranks: each rank one q head and a copy of its KV head."""
    model_dir = build_tiny_family(tmp_path, "llama3")
    expected = hf_expected(model_dir, PROMPTS)
    with ranks(make_llm(model_dir, "eager", tensor_parallel_size=4, cpu_binding="none")) as llm:
        attn = llm.engine.runner.model.layers[0].self_attn
        assert (attn.num_heads, attn.num_kv_heads) == (1, 1)
        assert tokens(llm, PROMPTS, greedy(16)) == expected


def test_bf16_stored_weights(tmp_path):
    model_dir = build_tiny_model(tmp_path, arch="qwen2", tie_word_embeddings=True, dtype="bfloat16")
    expected = hf_expected(model_dir, PROMPTS)
    with ranks(make_llm(model_dir, "eager", tensor_parallel_size=2)) as llm:
        assert llm.engine.runner.model.layers[0].self_attn.qkv_proj.weight.dtype == torch.bfloat16
        assert tokens(llm, PROMPTS, greedy(16)) == expected


# Two ranks against one on the same Q4_1 file (int8 activations, the default): the ranks' o and down
# projections take whole groups of 32 inputs each (a group keeps its scale), so the two differ only
# in the order of the sums (each rank's partial sum, then the all-reduce). Measured (Zen 3, this
# test): 207 prompt and decode logprobs max 5.1e-4 apart, mean 2.7e-6, every greedy token equal.
# On Zen 4 (AVX-512 VNNI/BF16 kernels) the prompt logprobs were up to 4.1e-3 apart, the decode ones
# 1.9e-6, before and after the output layer's split by vocabulary; quantization's own error is
# larger than either.
QUANT_MAX_LOGPROB_DIFF = 1e-2


def test_quantized_tiles_split_within_tolerance(tmp_path, monkeypatch):
    monkeypatch.setenv("KAITEN_MODELS_DIR", str(tmp_path / "models"))
    model_dir = build_tiny_model(tmp_path / "hf", tie_word_embeddings=True)
    gguf = write_llama_gguf(model_dir, tmp_path / "tiny-llama.Q4_1.gguf", qtype="Q4_1", embed_qtype="Q8_0")
    params = SamplingParams(temperature=0, max_tokens=12, prompt_logprobs=0, logprobs=0)
    one = LLM(str(gguf), dtype="float32", kv_cache_memory=8 * 2**20, enforce_eager=True).generate(PROMPTS, params)
    with ranks(LLM(str(gguf), dtype="float32", kv_cache_memory=8 * 2**20, enforce_eager=True,
                   tensor_parallel_size=2)) as llm:
        assert type(llm.engine.runner.model.layers[0].mlp.down_proj).__name__ == "QuantLinear"
        two = llm.generate(PROMPTS, params)
    diffs = [abs(x.logprob - y.logprob) for a, b in zip(one, two)
             for x, y in zip(a.prompt_logprobs[1:] + a.logprobs, b.prompt_logprobs[1:] + b.logprobs)]
    assert max(diffs) < QUANT_MAX_LOGPROB_DIFF, max(diffs)
    assert [c.token_ids for c in one] == [c.token_ids for c in two]


def record_logits(llm: LLM) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every compute_logits call of rank 0 from now on: (its hidden rows, the gathered logits)."""
    model, calls = llm.engine.runner.model, []
    gathered = model.compute_logits

    def record(hidden):
        logits = gathered(hidden)
        calls.append((hidden.clone(), logits.clone()))
        return logits
    model.compute_logits = record
    return calls


def output_rows(model) -> int:
    return model.lm_head(torch.zeros(1, model.cfg.hidden_size)).shape[1]


@pytest.mark.parametrize("weights", ["fp32", "fp32-tied", "bf16-tied", "q4_1-tied"])
def test_output_layer_split_by_vocabulary(weights, tmp_path, monkeypatch):
    """Rank 0 holds half the output layer's rows, rank 1 the rest; rank 0's gathered logits
    (sampled rows, prompt-logprob rows, a chunked prefill's steps without either) are the bits of
    one process's whole output layer on the same hidden rows, and the tokens one process's."""
    monkeypatch.setenv("KAITEN_MODELS_DIR", str(tmp_path / "models"))
    model_dir = build_tiny_model(tmp_path / "hf", tie_word_embeddings=weights != "fp32",
                                 dtype="bfloat16" if weights == "bf16-tied" else "float32")
    if weights == "q4_1-tied":
        model_dir = write_llama_gguf(model_dir, tmp_path / "tiny-llama.Q4_1.gguf", qtype="Q4_1", embed_qtype="Q8_0")
    params = SamplingParams(temperature=0, max_tokens=8, prompt_logprobs=0, logprobs=0)
    prompts = [PROMPTS, [make_prompts(384)[13]]]         # then 150 tokens alone, in steps of 40
    kw = dict(dtype="float32", kv_cache_memory=8 * 2**20, enforce_eager=True, max_num_batched_tokens=40)
    one = LLM(str(model_dir), **kw)
    expected = [[c.token_ids for c in one.generate(p, params)] for p in prompts]
    whole = one.engine.runner.model
    with ranks(LLM(str(model_dir), tensor_parallel_size=2, **kw)) as llm:
        model = llm.engine.runner.model
        assert model.cfg.vocab_size % 2 == 0 and output_rows(model) == model.cfg.vocab_size // 2
        assert output_rows(whole) == model.cfg.vocab_size
        calls = record_logits(llm)
        assert [[c.token_ids for c in llm.generate(p, params)] for p in prompts] == expected
    assert any(h.shape[0] == 0 for h, _ in calls) and any(h.shape[0] > 1 for h, _ in calls)
    for hidden, logits in calls:
        assert torch.equal(logits, whole.compute_logits(hidden))


def test_vocabulary_slices_of_a_quantized_layer_on_whole_tiles():
    """10 rows over 2 ranks: rows 0-3 (one tile) and 4-9 (a tile, then the last one's 2 rows and
    its padding); each slice's outputs are the whole layer's columns, bit for bit."""
    rng = np.random.default_rng(0)
    packed = PackedWeight(rng.integers(-127, 128, (10, 64), dtype=np.int8), rng.random((10, 2), np.float32), None)
    x = torch.randn(3, 64)
    whole = QuantLinear(packed)(x)
    edges = vocab_split(10, 2)
    assert edges == [0, 4, 10]
    for first, end in zip(edges, edges[1:]):
        part = take_rows(QuantLinear(packed), np.arange(first, end))
        assert part.fmt.n == end - first and torch.equal(part(x), whole[:, first:end])
    with pytest.raises(ValueError, match="whole tiles"):
        take_rows(QuantLinear(packed), np.arange(2, 10))


@pytest.mark.parametrize("overrides, message", [
    (dict(tensor_parallel_size=3), "2 KV heads are fewer than the ranks and do not replicate"),
    (dict(tensor_parallel_size=8, cpu_binding="none"), "4 attention heads are fewer than the ranks"),
    (dict(tensor_parallel_size=2, kv_store_url="redis://127.0.0.1:1/0"), "does not support a shared KV store"),
    (dict(tensor_parallel_size=2, cpu_binding="0|0|1"), "names 3 ranks' cores"),
    (dict(tensor_parallel_size=2, tensor_parallel_backend="nccl"), "backend nccl needs --device cuda"),
    (dict(tensor_parallel_size=2, tensor_parallel_backend="mpi"), "unknown tensor_parallel_backend 'mpi'"),
    (dict(tensor_parallel_backend="shm", device="cuda"), "backend shm runs on the CPU"),
    (dict(tensor_parallel_size=2, tensor_parallel_backend="gloo", device="cuda"), "backend gloo runs on the CPU"),
    # no NCCL in this torch, or too few GPUs
    (dict(tensor_parallel_size=64, device="cuda"), "--tensor-parallel-size 64 over nccl"),
])
def test_what_it_cannot_do_is_refused_in_one_line(tiny_model_dir, overrides, message):
    with pytest.raises(ValueError, match=message) as e:
        LLM(str(tiny_model_dir), dtype="float32", kv_cache_memory=8 * 2**20, enforce_eager=True, **overrides)
    assert "\n" not in str(e.value)


# Adapters' B split as their base layers' outputs (q/k/v, gate/up), A as their inputs (o, down);
# Phi-3's adapters target its fused modules whole.
LORA_TARGETS = {"qwen3": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
                "phi3": ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]}


@pytest.mark.parametrize("family, forward", [("qwen3", "compiled"), ("phi3", "eager")])
def test_lora_matches_peft(family, forward, tmp_path):
    """A batch mixing the base model and an adapter (loaded at start, a second one added while
    serving): each prompt's tokens equal HF + peft's."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from tests.support.tiny_model import build_lora_adapter

    base_dir = build_tiny_family(tmp_path / "base", family)
    adapters = [build_lora_adapter(base_dir, tmp_path / f"adapter{seed}", 8, LORA_TARGETS[family], seed=seed)
                for seed in (3, 4)]
    prompts = [p for p in make_prompts(384, seed=5) if len(p) >= 65][:3]

    def hf(adapter):
        model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()
        return hf_greedy(PeftModel.from_pretrained(model, adapter).eval() if adapter else model, prompts, 12)

    expected = [hf(None), hf(adapters[0]), hf(adapters[1])]
    with ranks(make_llm(base_dir, forward, tensor_parallel_size=2, lora_modules=[f"a={adapters[0]}"],
                        max_loras=2)) as llm:
        llm.engine.add_lora("b", str(adapters[1]))
        names = ["", "a", "b"] * len(prompts)
        got = llm.generate([p for p in prompts for _ in range(3)], greedy(12), lora_names=names)
        assert [c.token_ids for c in got] == [t for triple in zip(*expected) for t in triple]


@pytest.mark.parametrize("weights, forward", [("fp32", "eager"), ("fp32", "compiled"), ("q4_1-tied", "eager")])
def test_gloo_ranks_match_one_process_and_shm(weights, forward, tmp_path, monkeypatch):
    """--tensor-parallel-backend gloo: the all-reduces (traced into the compiled layers as
    functional collectives) and the logits' gather through torch.distributed, as NCCL runs them
    on GPUs. Two ranks give one process's greedy tokens and the shm backend's logprobs bit for
    bit (two partial sums add to the same bits either way); rank 0's gathered logits are one
    process's whole output layer's bits on the same hidden rows."""
    from engine_worker.model.tensor_parallel import DistParallelAttention, ParallelAttention
    monkeypatch.setenv("KAITEN_MODELS_DIR", str(tmp_path / "models"))
    model_dir = build_tiny_model(tmp_path / "hf", tie_word_embeddings=weights != "fp32")
    if weights == "q4_1-tied":
        model_dir = write_llama_gguf(model_dir, tmp_path / "tiny-llama.Q4_1.gguf", qtype="Q4_1", embed_qtype="Q8_0")
    params = SamplingParams(temperature=0, max_tokens=8, prompt_logprobs=0, logprobs=0)
    kw = dict(dtype="float32", kv_cache_memory=8 * 2**20, enforce_eager=forward == "eager")
    one = LLM(str(model_dir), **kw)
    expected = one.generate(PROMPTS, params)
    got = {}
    for backend, layer in (("shm", ParallelAttention), ("gloo", DistParallelAttention)):
        with ranks(LLM(str(model_dir), tensor_parallel_size=2, tensor_parallel_backend=backend, **kw)) as llm:
            assert type(llm.engine.runner.model.layers[0].self_attn) is layer
            assert (llm.engine.runner.compiled is not None) == (forward == "compiled")
            calls = record_logits(llm)
            got[backend] = llm.generate(PROMPTS, params)
    for hidden, logits in calls:          # gloo's
        assert torch.equal(logits, one.engine.runner.model.compute_logits(hidden))
    assert [c.token_ids for c in got["gloo"]] == [c.token_ids for c in expected]
    assert logprobs(got["gloo"]) == logprobs(got["shm"])


def logprobs(completions) -> list[float]:
    return [x.logprob for c in completions for x in c.prompt_logprobs[1:] + c.logprobs]


def test_backend_flag_reaches_the_engine(monkeypatch):
    """`kaiten serve --tensor-parallel-backend` is handed to the engine, whose config takes it (or
    KAITEN_TENSOR_PARALLEL_BACKEND)."""
    from shared.config import EngineConfig
    engine_args, gateway_args, ecfg = serve_flags(["--tensor-parallel-backend", "gloo"])
    assert engine_args[-2:] == ["--tensor-parallel-backend", "gloo"]
    assert "--tensor-parallel-backend" not in gateway_args
    assert ecfg.tensor_parallel_backend == "gloo"
    monkeypatch.setenv("KAITEN_TENSOR_PARALLEL_BACKEND", "gloo")
    assert EngineConfig.from_env().tensor_parallel_backend == "gloo"


def test_a_gloo_rank_that_dies_ends_the_engine(tiny_model_dir):
    """Rank 1 SIGKILLed while rank 0 runs steps over gloo: rank 0's process exits at once
    (EXIT_RANK_DIED), not left waiting in a collective."""
    script = textwrap.dedent(f"""
        import os, signal, threading
        from engine_worker import LLM, SamplingParams
        llm = LLM({str(tiny_model_dir)!r}, dtype="float32", kv_cache_memory=8 * 2**20, enforce_eager=True,
                  tensor_parallel_size=2, tensor_parallel_backend="gloo", cpu_binding="none")
        threading.Timer(1.0, os.kill, (llm.engine.runner.ranks.procs[0].pid, signal.SIGKILL)).start()
        while True:
            llm.generate([[5, 6, 7]] * 8, SamplingParams(temperature=0, max_tokens=16))
    """)
    run = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == EXIT_RANK_DIED, run.stderr[-3000:]
    assert "tensor-parallel rank 1" in run.stderr
