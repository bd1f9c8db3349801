"""Fixtures of the engine tests: the tiny model in Hugging Face transformers, prompts for it, and
its greedy outputs."""
from __future__ import annotations

import pytest
import torch

from tests.support.llm_support import hf_greedy, make_prompts


@pytest.fixture(scope="module")
def hf_model(tiny_model_dir):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def prompts(hf_model):
    return make_prompts(hf_model.config.vocab_size)


@pytest.fixture(scope="module")
def expected(hf_model, prompts):
    return hf_greedy(hf_model, prompts)
