"""What the engine needs to know of a model, read from its Hugging Face config.json.

The config is parsed by transformers (AutoConfig), which fills each family's defaults and puts
rope parameters in one form (`rope_parameters`); family classes read their own fields from
`hf`, the rest of the engine only the fields here.
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

from shared.model_families import UnsupportedModelError, check_architecture

FULL, SLIDING = "full_attention", "sliding_attention"


@dataclass(slots=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    eos_token_ids: list[int]
    layer_types: list[str]             # FULL or SLIDING, per layer
    sliding_window: int                # the keys a SLIDING layer's query sees (0: none slide)
    hf: object = field(default=None, repr=False, compare=False)    # transformers' config (text part)

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> "ModelConfig":
        model_dir = Path(model_dir)
        raw = json.loads((model_dir / "config.json").read_text())
        arch = check_architecture(raw.get("architectures") or ["LlamaForCausalLM"], str(model_dir))
        hf = _hf_config(model_dir)
        num_heads = hf.num_attention_heads
        types, window = _layer_types(hf)
        return cls(
            architecture=arch,
            vocab_size=hf.vocab_size,
            hidden_size=hf.hidden_size,
            intermediate_size=hf.intermediate_size,
            num_layers=hf.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(hf, "num_key_value_heads", None) or num_heads,
            head_dim=getattr(hf, "head_dim", None) or hf.hidden_size // num_heads,
            rms_norm_eps=float(getattr(hf, "rms_norm_eps", 1e-6)),
            max_position_embeddings=getattr(hf, "max_position_embeddings", 2048),
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
            eos_token_ids=_eos_ids(model_dir, raw),
            layer_types=types,
            sliding_window=window,
            hf=hf,
        )

    @property
    def window_of_every_layer(self) -> int:
        """The window every layer slides with (the widest), or 0 where some layer attends to all:
        the keys a sequence's KV blocks must still hold."""
        return self.sliding_window if self.sliding_window and all(t == SLIDING for t in self.layer_types) else 0


def _hf_config(model_dir: Path):
    from transformers import AutoConfig
    logging.getLogger("transformers").setLevel(logging.ERROR)
    try:
        hf = AutoConfig.from_pretrained(model_dir)
    except (ValueError, KeyError, OSError) as e:
        raise UnsupportedModelError(f"{model_dir}: transformers cannot read its config.json: "
                                    f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
    return hf.get_text_config()


def _layer_types(hf) -> tuple[list[str], int]:
    """Each layer's attention and the sliding window: the config's `layer_types` where it has them
    (Gemma 3, Qwen2/3, SmolLM3), else one window for every layer (Mistral, Phi-3)."""
    window = int(getattr(hf, "sliding_window", None) or 0)
    types = getattr(hf, "layer_types", None)
    if types:
        types = [SLIDING if t == SLIDING and window else FULL for t in types]
    else:
        types = [SLIDING if window else FULL] * hf.num_hidden_layers
    return types, window if SLIDING in types else 0


def _eos_ids(model_dir: Path, cfg: dict) -> list[int]:
    eos = cfg.get("eos_token_id")
    gen = model_dir / "generation_config.json"
    if gen.exists():
        eos = json.loads(gen.read_text()).get("eos_token_id", eos)
    if eos is None:
        return []
    return list(eos) if isinstance(eos, list) else [eos]
