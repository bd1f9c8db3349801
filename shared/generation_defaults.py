"""The default sampling parameters: the one place the API, the chat page and `kaiten up` read them.

Like vLLM's ``--generation-config auto``: the model directory's ``generation_config.json`` gives
temperature, top_p, top_k, repetition_penalty and max_new_tokens, and a request that leaves a field
unset gets the model's value. ``vllm`` ignores the file (the plain OpenAI defaults); any other
value names a directory whose ``generation_config.json`` is read instead.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from shared.sampling_limits import LIMITS, check

MODES = ("auto", "vllm")


@dataclass(slots=True, frozen=True)
class GenerationDefaults:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int | None = None      # None: up to the remaining context
    source: str = "vllm"               # where they came from (a file path, or "vllm")

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def describe(self) -> str:
        cap = self.max_tokens if self.max_tokens is not None else "remaining context"
        return (f"temperature={self.temperature} top_p={self.top_p} top_k={self.top_k} min_p={self.min_p} "
                f"repetition_penalty={self.repetition_penalty} max_tokens={cap} (from {self.source})")


def load_generation_defaults(model_dir: str | Path | None, mode: str = "auto") -> GenerationDefaults:
    """The defaults for `model_dir` under `mode` (auto | vllm | a directory). Raises ValueError for a
    generation_config.json whose sampling fields are out of range."""
    if mode == "vllm" or (mode == "auto" and not model_dir):
        return GenerationDefaults()
    path = Path(model_dir if mode == "auto" else mode) / "generation_config.json"
    if mode not in MODES and not path.parent.is_dir():
        raise ValueError(f"--generation-config: {mode!r} is neither 'auto', 'vllm' nor a directory")
    try:
        gen = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return GenerationDefaults(source="vllm (no generation_config.json)")
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read {path}: {e}") from None
    if not isinstance(gen, dict):
        raise ValueError(f"{path} must hold a JSON object")
    return _from_config(gen, str(path))


def _from_config(gen: dict, source: str) -> GenerationDefaults:
    base = GenerationDefaults()
    out = {name: _number(gen, name, getattr(base, name), source)
           for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")}
    max_new = gen.get("max_new_tokens")
    if max_new is not None:
        try:
            check("max_tokens", max_new)
        except ValueError:
            raise ValueError(f"{source}: max_new_tokens must be {LIMITS['max_tokens'].describe()}, "
                             f"got {max_new!r}") from None
    return GenerationDefaults(**out, max_tokens=max_new, source=source)


def _number(gen: dict, name: str, default: float, source: str) -> float:
    """The file's `name` within its limit (shared/sampling_limits.py); top_k may be written 40.0."""
    v = gen.get(name)
    if v is None:
        return default
    limit = LIMITS[name]
    if (isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not limit.contains(v)
            or (limit.integer and v != int(v))):
        raise ValueError(f"{source}: {name} has an invalid value {v!r}")
    return int(v) if limit.integer else float(v)
