"""The model families Kaiten serves: one record each, the source of the supported-models table
(docs) and of the check every command makes before it serves a model. Plain data, no torch: the
engine's registry (engine_worker/model/registry.py) maps each architecture to the class that runs
it, and a test holds the two together."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class Family:
    name: str
    architectures: tuple[str, ...]     # config.json's `architectures`
    gguf_architectures: tuple[str, ...]  # GGUF's general.architecture
    examples: tuple[str, ...]          # Hugging Face checkpoints of the family
    sliding_window: str                # which layers slide, where a config says so
    notes: str = ""


FAMILIES = (
    Family("Llama", ("LlamaForCausalLM",), ("llama",),
           ("meta-llama/Llama-3.2-1B-Instruct", "meta-llama/Llama-3.1-8B-Instruct",
            "HuggingFaceTB/SmolLM2-135M-Instruct"),
           "no", "rope scaling: linear, llama3, yarn"),
    Family("Mistral", ("MistralForCausalLM",), ("llama",),
           ("mistralai/Mistral-7B-Instruct-v0.3",), "every layer", "KV blocks bounded by the window"),
    Family("Qwen2", ("Qwen2ForCausalLM",), ("qwen2",),
           ("Qwen/Qwen2.5-0.5B-Instruct", "Qwen/Qwen2.5-7B-Instruct"), "layers its config names",
           "q/k/v biases"),
    Family("Qwen3", ("Qwen3ForCausalLM",), ("qwen3",), ("Qwen/Qwen3-0.6B", "Qwen/Qwen3-8B"),
           "layers its config names", "q/k norms"),
    Family("Gemma 3", ("Gemma3ForCausalLM",), ("gemma3",), ("google/gemma-3-270m", "google/gemma-3-1b-it"),
           "5 of every 6 layers", "text only"),
    Family("Phi-3", ("Phi3ForCausalLM",), ("phi3",),
           ("microsoft/Phi-3.5-mini-instruct", "microsoft/Phi-4-mini-instruct"), "every layer, where set",
           "LongRoPE, partial rotary"),
    Family("SmolLM3", ("SmolLM3ForCausalLM",), ("smollm3",), ("HuggingFaceTB/SmolLM3-3B",), "no", "NoPE layers"),
)


class UnsupportedModelError(ValueError):
    """A model Kaiten cannot serve; its message is one line that says why."""


def supported_architectures() -> list[str]:
    return sorted({a for f in FAMILIES for a in f.architectures})


def check_architecture(architectures: list[str] | None, where: str) -> str:
    """The first of a config's `architectures` that Kaiten serves, else a one-line error."""
    supported = supported_architectures()
    for arch in architectures or []:
        if arch in supported:
            return arch
    named = ", ".join(architectures or []) or "none"
    raise UnsupportedModelError(f"{where}: architecture {named} is not supported; supported: {', '.join(supported)}")


def check_model_dir(model_dir: str | Path) -> str:
    """The architecture of the model directory's config.json, if Kaiten serves it."""
    path = Path(model_dir) / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise UnsupportedModelError(f"{path}: not a readable model config ({e})") from None
    if not isinstance(config, dict):
        raise UnsupportedModelError(f"{path}: not a JSON object")
    return check_architecture(config.get("architectures") or ["LlamaForCausalLM"], str(model_dir))
