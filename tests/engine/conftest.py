"""Fixtures of the engine tests: the tiny model in Hugging Face transformers, prompts for it, and
its greedy outputs."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from shared.gguf_convert import ensure_default_model
from tests.support.family_models import build_family_model, llama_cpp_gguf
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


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    return ensure_default_model()


@pytest.fixture(scope="session")
def family_gguf(smollm2_dir, tmp_path_factory):
    """family -> (its tiny Hugging Face model, the F32 GGUF llama.cpp writes of it), made once."""
    made = {}

    def get(family: str) -> tuple[Path, Path]:
        if family not in made:
            root = tmp_path_factory.mktemp(family)
            source = build_family_model(family, root / "hf", smollm2_dir)
            made[family] = source, llama_cpp_gguf(source, root / f"{family}.F32.gguf")
        return made[family]
    return get
