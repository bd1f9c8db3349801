"""SmolLM3: Llama's layers, with no rotary embedding at all in the layers its config's
no_rope_layers marks 0 (NoPE)."""
from __future__ import annotations

from engine_worker.model.models.llama import LlamaForCausalLM


class SmolLM3ForCausalLM(LlamaForCausalLM):
    def uses_rope(self, index: int) -> bool:
        flags = getattr(self.cfg.hf, "no_rope_layers", None)
        return bool(flags[index]) if flags else True
