"""The gated MLP of every supported family: act(gate) * up, then down; one fused gate_up matmul."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine_worker.model.lora_layers import LoraBatch, project
from shared.model_families import UnsupportedModelError

ACTIVATIONS = {
    "silu": F.silu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


def activation(name: str):
    try:
        return ACTIVATIONS[name]
    except KeyError:
        raise UnsupportedModelError(f"activation {name!r} is not supported; supported: {', '.join(ACTIVATIONS)}") from None


class GatedMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, act: str = "silu", bias: bool = False):
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)
        self.act_name = act
        self.act = activation(act)
        self.lora: nn.ModuleDict | None = None       # "gate_up", "down": LoraStacks (enable_lora)

    def forward(self, x: torch.Tensor, lora: LoraBatch | None = None) -> torch.Tensor:
        gate, up = project(self.gate_up_proj, x, self, "gate_up", lora).chunk(2, dim=-1)
        return project(self.down_proj, self.act(gate) * up, self, "down", lora)
