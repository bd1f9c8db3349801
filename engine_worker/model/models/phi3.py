"""Phi-3, Phi-3.5 and Phi-4-mini: Llama's layers, stored with q/k/v and gate/up already fused
(qkv_proj, gate_up_proj: the projection table loads them whole and LoRA targets them whole),
partial rotary (Phi-4-mini) and LongRoPE (layers/rotary.py)."""
from __future__ import annotations

from engine_worker.model.models.llama import LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    """Phi-3's attention has no biases (its config has no attention_bias)."""
