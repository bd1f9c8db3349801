"""The limits of the sampling fields, declared once for every checker: the API's request models
(gateway/api/api_models.py), the engine's ``SamplingParams.validate`` and a model's
generation_config.json defaults (shared/generation_defaults.py).

Plain data and one check, no pydantic or torch: the slim gateway image and the engine both import
it. The API's error texts come from pydantic, fed with ``Limit.bounds()``; the engine's and the
defaults' from ``check`` and ``Limit.contains``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

MAX_LOGPROBS = 20                     # logprobs, top_logprobs, prompt_logprobs: the top N at most
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1
TOP_K_MAX = 2**31 - 1                 # the engine's tensors: a larger top_k overflowed them
MAX_STOP_STRINGS = 16                 # a request's stop strings ...
MAX_STOP_LEN = 1024                   # ... each this long at most (characters)
MAX_STOP_TOKEN_IDS = 1024
MAX_LOGIT_BIAS = 1024                 # logit_bias entries


@dataclass(frozen=True, slots=True)
class Limit:
    """A number's allowed range: [lo, hi], an open end where lo_open / hi_open, None unbounded;
    `integer`: an int (not a bool). The bounds keep their type (0.0 for a float field), so the
    API's messages and schema show them as before."""
    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    hi_open: bool = False
    integer: bool = False

    def bounds(self) -> dict[str, float]:
        """The bounds as keywords of pydantic's Field (and annotated_types): ge/gt, le/lt."""
        out = {}
        if self.lo is not None:
            out["gt" if self.lo_open else "ge"] = self.lo
        if self.hi is not None:
            out["lt" if self.hi_open else "le"] = self.hi
        return out

    def contains(self, v: float) -> bool:
        """`v` (a finite number) within the range; the type is not checked."""
        if self.lo is not None and (v <= self.lo if self.lo_open else v < self.lo):
            return False
        return self.hi is None or (v < self.hi if self.hi_open else v <= self.hi)

    def describe(self) -> str:
        """'an integer in [0, 20]', 'a number in (0, 1]', 'an integer >= 1', 'a number > 0'."""
        kind = "an integer" if self.integer else "a number"
        lo, hi = _plain(self.lo), _plain(self.hi)
        if self.lo is not None and self.hi is not None:
            return f"{kind} in {'(' if self.lo_open else '['}{lo}, {hi}{')' if self.hi_open else ']'}"
        if self.lo is not None:
            return f"{kind} {'>' if self.lo_open else '>='} {lo}"
        if self.hi is not None:
            return f"{kind} {'<' if self.hi_open else '<='} {hi}"
        return kind


def _plain(x: float | None) -> str:
    return str(int(x)) if isinstance(x, float) and x.is_integer() else str(x)


LOGPROBS = Limit(0, MAX_LOGPROBS, integer=True)
PENALTY = Limit(-2.0, 2.0)            # presence_penalty, frequency_penalty (OpenAI's range)

# Field name -> its limit. max_tokens is what the engine generates: the completions API also takes
# 0 with echo (the prompt alone), which the gateway sends as 1 (gateway/api/openai_api.py).
LIMITS: dict[str, Limit] = {
    "n": Limit(1, integer=True),
    "max_tokens": Limit(1, integer=True),
    "min_tokens": Limit(0, integer=True),
    "temperature": Limit(0.0, 2.0),
    "top_p": Limit(0.0, 1.0, lo_open=True),
    "top_k": Limit(-1, TOP_K_MAX, integer=True),          # -1 or 0: no top-k
    "min_p": Limit(0.0, 1.0),
    "presence_penalty": PENALTY,
    "frequency_penalty": PENALTY,
    "repetition_penalty": Limit(0.0, lo_open=True),       # 1: off
    "seed": Limit(SEED_MIN, SEED_MAX, integer=True),
    "logprobs": LOGPROBS,
    "top_logprobs": LOGPROBS,
    "prompt_logprobs": LOGPROBS,
    "logit_bias": Limit(-100.0, 100.0),                   # each token's bias
}


def check(name: str, value: Any) -> None:
    """Raise ValueError unless `value` is a finite number (an int where the limit says so; never
    a bool) within LIMITS[name]: "top_p must be a number in (0, 1], got 1.5"."""
    limit = LIMITS[name]
    ok = (isinstance(value, int) or (isinstance(value, float) and not limit.integer and math.isfinite(value)))
    if isinstance(value, bool) or not ok or not limit.contains(value):
        raise ValueError(f"{name} must be {limit.describe()}, got {value!r}")
