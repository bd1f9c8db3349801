"""The model registry: a checkpoint's `architectures` name -> the class that runs it, one file per
family under engine_worker/model/models/, imported when first asked for (as vLLM's registry).
Which families Kaiten serves is shared/model_families.py's table; this maps them to code."""
from __future__ import annotations

import importlib

# architecture -> (module under engine_worker.model.models, class)
ARCHITECTURES: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("llama", "MistralForCausalLM"),
    "Qwen2ForCausalLM": ("qwen2", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("qwen3", "Qwen3ForCausalLM"),
    "Gemma3ForCausalLM": ("gemma3", "Gemma3ForCausalLM"),
    "Phi3ForCausalLM": ("phi3", "Phi3ForCausalLM"),
    "SmolLM3ForCausalLM": ("smollm3", "SmolLM3ForCausalLM"),
}


def model_class(architecture: str):
    module, name = ARCHITECTURES[architecture]
    return getattr(importlib.import_module(f"engine_worker.model.models.{module}"), name)
