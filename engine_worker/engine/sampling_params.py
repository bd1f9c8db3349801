"""Per-request sampling parameters, validated once at admission."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields

from shared.structured_spec import validate_spec

MAX_LOGPROBS = 20


@dataclass(slots=True)
class SamplingParams:
    temperature: float = 1.0          # 0 means greedy
    top_p: float = 1.0                # in (0, 1]
    top_k: int = -1                   # -1 or 0: no top-k
    min_p: float = 0.0                # in [0, 1]: drop tokens below min_p x the top token's probability
    seed: int | None = None           # per-request generator: same tokens whatever the batch
    max_tokens: int = 16
    min_tokens: int = 0               # EOS and stop_token_ids are held back until this many are out
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    presence_penalty: float = 0.0     # in [-2, 2], as in the OpenAI API
    frequency_penalty: float = 0.0    # in [-2, 2]
    repetition_penalty: float = 1.0   # > 0; 1 is off (HF/vLLM: prompt and output tokens' logits)
    logprobs: int | None = None       # None: none; N: the sampled token's logprob plus the top N
    structured_output: dict | None = None   # {"kind", "value"}: see engine_worker/engine/structured_output.py
    prompt_logprobs: int | None = None  # None: none; N: each prompt token's logprob (and rank) plus the top N
    # [token id, bias] pairs (a list: msgpack maps take string keys only), added to the logits.
    logit_bias: list[list[float]] = field(default_factory=list)

    def validate(self) -> None:
        """Raise ValueError with a clear message for any out-of-range value."""
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not isinstance(self.temperature, (int, float)) or self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if isinstance(self.min_p, bool) or not isinstance(self.min_p, (int, float)) or not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        mt = self.min_tokens
        if not isinstance(mt, int) or isinstance(mt, bool) or not 0 <= mt <= self.max_tokens:
            raise ValueError(f"min_tokens must be an integer in [0, max_tokens={self.max_tokens}], got {mt!r}")
        self._validate_logit_bias()
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise ValueError(f"top_k must be -1, 0 (disabled) or a positive integer, got {self.top_k!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or not -2 <= v <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {v!r}")
        rp = self.repetition_penalty
        if isinstance(rp, bool) or not isinstance(rp, (int, float)) or not (0 < rp < float("inf")):
            raise ValueError(f"repetition_penalty must be a number > 0, got {rp!r}")
        if self.seed is not None and not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise ValueError(f"logprobs must be an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")
        pl = self.prompt_logprobs
        if pl is not None and (not isinstance(pl, int) or isinstance(pl, bool) or not 0 <= pl <= MAX_LOGPROBS):
            raise ValueError(f"prompt_logprobs must be an integer in [0, {MAX_LOGPROBS}], got {pl!r}")
        if not all(isinstance(t, int) for t in self.stop_token_ids):
            raise ValueError("stop_token_ids must be a list of integers")
        if self.structured_output is not None:
            validate_spec(self.structured_output)

    def _validate_logit_bias(self) -> None:
        for pair in self.logit_bias:
            ok = (isinstance(pair, (list, tuple)) and len(pair) == 2 and isinstance(pair[0], int)
                  and not isinstance(pair[0], bool) and pair[0] >= 0
                  and isinstance(pair[1], (int, float)) and -100 <= pair[1] <= 100)
            if not ok:
                raise ValueError(f"logit_bias must be [token id, bias in [-100, 100]] pairs, got {pair!r}")

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
