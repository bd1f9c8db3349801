"""A PEFT LoRA adapter directory (adapter_config.json + adapter_model.safetensors), read and
checked against the base model, laid out for the model's fused projections.

Each fused projection (qkv, o, gate_up, down) gets one pair: A [in, parts * max_rank] and B
[max_rank, out], where part i (q, k, v or gate, up) owns rank columns i*R..i*R+r of A and rows
0..r of its slice of B's columns (its slice of the fused output). An adapter of a module stored
fused (Phi-3's qkv_proj) gives every part the same A and its own rows of B. The scaling
(lora_alpha / r, or / sqrt(r) with rsLoRA) is folded into B. Modules the adapter leaves out stay
zero. Which modules an adapter may target is the model family's table (CausalLM.lora_targets).
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from engine_worker.model.config import ModelConfig
from engine_worker.model.lora_layers import projection_shapes
from engine_worker.model.registry import model_class

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"

_KEY = re.compile(r"(?:.*\.)?layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight")
# adapter_config.json options that change the math and are not implemented: refused by name
_UNSUPPORTED = {"use_dora": "DoRA", "lora_bias": "LoRA bias", "modules_to_save": "modules_to_save",
                "rank_pattern": "rank_pattern", "alpha_pattern": "alpha_pattern",
                "layer_replication": "layer_replication", "alora_invocation_tokens": "aLoRA",
                "trainable_token_indices": "trainable_token_indices", "target_parameters": "target_parameters",
                "use_qalora": "QALoRA", "use_bdlora": "BD-LoRA", "fan_in_fan_out": "fan_in_fan_out"}


@dataclass(slots=True)
class LoraWeights:
    name: str
    path: str
    rank: int
    # (layer, fused projection) -> (A [in, parts * max_rank], B [max_rank, out])
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]


def load_lora(name: str, path: str | Path, cfg: ModelConfig, max_rank: int, dtype: torch.dtype) -> LoraWeights:
    """Read and check an adapter directory; ValueError says what is wrong with it."""
    path = Path(path)
    targets = model_class(cfg.architecture).lora_targets()
    config = _read_config(path, targets)
    rank = config.get("r")
    if not isinstance(rank, int) or rank < 1:
        raise ValueError(f"LoRA adapter {name!r}: r must be a positive integer, got {rank!r}")
    if rank > max_rank:
        raise ValueError(f"LoRA adapter {name!r} has rank {rank}, above max_lora_rank {max_rank}")
    alpha = config.get("lora_alpha", 8)
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    pairs = _read_tensors(name, path, targets)
    shapes = projection_shapes(cfg)
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
    for (layer, module), (a, b) in sorted(pairs.items()):
        if layer >= cfg.num_layers:
            raise ValueError(f"LoRA adapter {name!r} has weights for layer {layer}; the model has {cfg.num_layers}")
        proj, part = targets[module]
        fan_in, outs = shapes[proj]
        parts = range(len(outs)) if part is None else [part]
        want_a, want_b = (rank, fan_in), (sum(outs[i] for i in parts), rank)
        if tuple(a.shape) != want_a or tuple(b.shape) != want_b:
            raise ValueError(f"LoRA adapter {name!r}: layer {layer} {module} has A {list(a.shape)} and B "
                             f"{list(b.shape)}; this model needs A {list(want_a)} and B {list(want_b)} "
                             "(an adapter for another base model?)")
        if (layer, proj) not in weights:
            weights[layer, proj] = (torch.zeros(fan_in, len(outs) * max_rank, dtype=dtype),
                                    torch.zeros(max_rank, sum(outs), dtype=dtype))
        big_a, big_b = weights[layer, proj]
        row = 0                                   # of b: a fused module's B stacks its parts' rows
        for i in parts:
            col, start = i * max_rank, sum(outs[:i])
            big_a[:, col:col + rank] = a.t().to(dtype)
            big_b[:rank, start:start + outs[i]] = (b[row:row + outs[i]].t().double() * scaling).to(dtype)
            row += outs[i]
    if not weights:
        raise ValueError(f"LoRA adapter {name!r}: {path / WEIGHTS_FILE} holds no LoRA weights")
    return LoraWeights(name, str(path), rank, weights)


def _read_config(path: Path, supported: dict) -> dict:
    file = path / CONFIG_FILE
    if not file.is_file():
        raise ValueError(f"{path} is not a LoRA adapter directory: no {CONFIG_FILE}")
    try:
        config = json.loads(file.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{file} is not valid JSON: {e}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{file} is not a JSON object")
    if config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{path}: peft_type {config['peft_type']!r} is not supported (only LORA)")
    if config.get("bias", "none") != "none":
        raise ValueError(f"{path}: bias {config['bias']!r} is not supported (only 'none')")
    used = [label for key, label in _UNSUPPORTED.items() if config.get(key)]
    if used:
        raise ValueError(f"{path}: {', '.join(used)} not supported")
    targets = config.get("target_modules")
    if isinstance(targets, list):
        bad = sorted(set(targets) - set(supported))
        if bad:
            raise ValueError(f"{path}: target modules {bad} are not supported; supported: {sorted(supported)}")
    return config


def _read_tensors(name: str, path: Path, supported: dict) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    """(layer, HF module) -> (lora_A [r, in], lora_B [out, r]); other keys are refused."""
    file = path / WEIGHTS_FILE
    if not file.is_file():
        raise ValueError(f"{path}: no {WEIGHTS_FILE} (adapters are read from safetensors only)")
    found: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    with safe_open(str(file), framework="pt") as f:
        for key in f.keys():
            m = _KEY.fullmatch(key)
            if m is None or m.group(2) not in supported:
                raise ValueError(f"LoRA adapter {name!r}: weight {key} targets a module that is not supported "
                                 f"(supported: {', '.join(sorted(supported))})")
            found.setdefault((int(m.group(1)), m.group(2)), {})[m.group(3)] = f.get_tensor(key)
    incomplete = [f"layer {layer} {module}" for (layer, module), ab in found.items() if len(ab) != 2]
    if incomplete:
        raise ValueError(f"LoRA adapter {name!r}: lora_A or lora_B missing for {', '.join(incomplete[:3])}")
    return {k: (ab["A"], ab["B"]) for k, ab in found.items()}
