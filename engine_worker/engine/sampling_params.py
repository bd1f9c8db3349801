"""Per-request sampling parameters, validated once at admission."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields

from shared.sampling_limits import LIMITS, check
from shared.structured_spec import validate_spec


@dataclass(slots=True)
class SamplingParams:
    temperature: float = 1.0          # 0 means greedy
    top_p: float = 1.0
    top_k: int = -1                   # -1 or 0: no top-k
    min_p: float = 0.0                # drop tokens below min_p x the top token's probability
    seed: int | None = None           # per-request generator: same tokens whatever the batch
    max_tokens: int = 16
    min_tokens: int = 0               # EOS and stop_token_ids are held back until this many are out
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    presence_penalty: float = 0.0     # as in the OpenAI API
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0   # 1 is off (HF/vLLM: prompt and output tokens' logits)
    logprobs: int | None = None       # None: none; N: the sampled token's logprob plus the top N
    structured_output: dict | None = None   # {"kind", "value"}: see engine_worker/engine/structured_output.py
    prompt_logprobs: int | None = None  # None: none; N: each prompt token's logprob (and rank) plus the top N
    # [token id, bias] pairs (a list: msgpack maps take string keys only), added to the logits.
    logit_bias: list[list[float]] = field(default_factory=list)

    def validate(self) -> None:
        """Raise ValueError with a clear message for any out-of-range value (the limits:
        shared/sampling_limits.py)."""
        for name in ("max_tokens", "min_tokens", "temperature", "top_p", "min_p", "top_k", "presence_penalty",
                     "frequency_penalty", "repetition_penalty"):
            check(name, getattr(self, name))
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must not exceed max_tokens ({self.max_tokens}), got {self.min_tokens}")
        for name in ("seed", "logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                check(name, getattr(self, name))
        self._validate_logit_bias()
        if not all(isinstance(t, int) for t in self.stop_token_ids):
            raise ValueError("stop_token_ids must be a list of integers")
        if self.structured_output is not None:
            validate_spec(self.structured_output)

    def _validate_logit_bias(self) -> None:
        bias = LIMITS["logit_bias"]
        for pair in self.logit_bias:
            ok = (isinstance(pair, (list, tuple)) and len(pair) == 2 and isinstance(pair[0], int)
                  and not isinstance(pair[0], bool) and pair[0] >= 0
                  and isinstance(pair[1], (int, float)) and bias.contains(pair[1]))
            if not ok:
                raise ValueError(f"logit_bias must be [token id, bias ({bias.describe()})] pairs, got {pair!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "SamplingParams":
        """Build from a wire map; unknown keys are an error, not silently dropped."""
        known = {f.name for f in fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown sampling parameters: {sorted(unknown)}")
        params = cls(**d)
        params.validate()
        return params
