"""RMSNorm in its two conventions: the weight itself (Llama) or one plus it (Gemma)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """Normalises in fp32. `offset` False (Llama, Qwen, Phi): scaled by the weight in the model's
    dtype, as Hugging Face's LlamaRMSNorm does. `offset` True (Gemma): scaled by 1 + weight in
    fp32, then cast, as Gemma3RMSNorm does (its weights are stored as offsets from 1)."""

    def __init__(self, size: int, eps: float, offset: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(size) if offset else torch.ones(size))
        self.eps = eps
        self.offset = offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        if self.offset:
            return (normed * (1.0 + self.weight.float())).to(x.dtype)
        return self.weight * normed.to(x.dtype)
