"""The engine on bf16-stored weights computing in fp32 (a CPU without native bf16): the weights stay
bf16 (Bf16Linear, Bf16Embedding), and since widening is exact, greedy tokens must equal HF's fp32
generate on the same bf16 files, on every path."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from engine_worker.model.bf16_layers import MIN_DENSE_ROWS, Bf16Embedding, Bf16Linear
from kernels.cpu_ops_build import cpu_ops_available
from tests.support.llm_support import greedy, hf_greedy, make_llm, make_prompts, run_staggered
from tests.support.tiny_model import build_tiny_model

pytestmark = pytest.mark.skipif(not cpu_ops_available(), reason="the C++ CPU extension does not build here")


@pytest.fixture(scope="module", params=[("llama", False), ("llama", True), ("qwen2", True)],
                ids=["llama", "llama-tied", "qwen2-tied-bias"])
def bf16_model(request, tmp_path_factory):
    arch, tied = request.param
    path = build_tiny_model(tmp_path_factory.mktemp(f"bf16-{arch}"), arch=arch, tie_word_embeddings=tied,
                            dtype="bfloat16")
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = make_prompts(384)[:10]
    return path, prompts, hf_greedy(hf, prompts, 16)


def assert_bf16_layers(llm, tied: bool) -> None:
    model = llm.engine.runner.model
    assert isinstance(model.embed_tokens, Bf16Embedding) and isinstance(model.lm_head, Bf16Linear)
    assert (model.lm_head.weight is model.embed_tokens.weight) == tied
    assert not any(isinstance(m, (nn.Linear, nn.Embedding)) for m in model.modules())
    assert all(p.dtype == torch.bfloat16 for n, p in model.named_parameters() if p.dim() == 2)


@pytest.mark.parametrize("forward", ["eager", "compiled"])
def test_greedy_matches_hf_fp32_on_bf16_weights(bf16_model, forward):
    path, prompts, expected = bf16_model
    assert sum(map(len, prompts)) >= MIN_DENSE_ROWS        # the first step's prefill is dense
    llm = make_llm(path, forward)
    assert_bf16_layers(llm, tied=llm.engine.runner.model_config.tie_word_embeddings)
    assert [c.token_ids for c in llm.generate(prompts, greedy(16))] == expected


def test_chunked_prefill_and_staggered_batches(bf16_model):
    """Steps of at most 13 tokens run in registers (below MIN_DENSE_ROWS); the whole-prompt
    prefills above (up to 256 tokens a step) take the widened chunks into at::mm."""
    path, prompts, expected = bf16_model
    llm = make_llm(path, "compiled", max_num_batched_tokens=13)
    assert run_staggered(llm, prompts, greedy(16)) == expected


def test_fp32_files_and_bf16_compute_are_untouched(tiny_model_dir, bf16_model):
    """fp32-stored weights load as before (oneDNN-packed), and --dtype bfloat16 keeps bf16 params."""
    from engine_worker import LLM
    from engine_worker.model.packed_linear import PackedLinear
    model = make_llm(tiny_model_dir, "eager").engine.runner.model
    assert not any(isinstance(m, (Bf16Linear, Bf16Embedding)) for m in model.modules())
    assert isinstance(model.layers[0].mlp.down_proj, PackedLinear)
    llm = LLM(str(bf16_model[0]), dtype="bfloat16", enforce_eager=True, kv_cache_memory=8 * 2**20)
    assert not any(isinstance(m, (Bf16Linear, Bf16Embedding)) for m in llm.engine.runner.model.modules())
