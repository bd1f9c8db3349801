"""The model registry: a checkpoint's `architectures` name -> the class that runs it, one file per
family under engine_worker/model/models/, imported when first asked for (as vLLM's registry)."""
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


class UnsupportedModelError(ValueError):
    """A model Kaiten cannot serve; its message is one line that says why."""


def supported_architectures() -> list[str]:
    return sorted(ARCHITECTURES)


def check_architecture(architectures: list[str] | None, where: str) -> str:
    """The first of a config's `architectures` that Kaiten runs, else a one-line error."""
    for arch in architectures or []:
        if arch in ARCHITECTURES:
            return arch
    named = ", ".join(architectures or []) or "none"
    raise UnsupportedModelError(f"{where}: architecture {named} is not supported; "
                                f"supported: {', '.join(supported_architectures())}")


def model_class(architecture: str):
    module, name = ARCHITECTURES[architecture]
    return getattr(importlib.import_module(f"engine_worker.model.models.{module}"), name)
