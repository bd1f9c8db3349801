"""OpenAI request validation (completions and chat) and response shapes.

Everything a request can get wrong is checked here, before anything is XADDed: types, ranges,
unknown fields, the prompt and max_tokens against the context length. The engine's
``SamplingParams`` travel as a plain dict (no engine import: the gateway runs without torch).
"""
from __future__ import annotations

import math
import secrets
from dataclasses import dataclass, field
from typing import Any, Protocol

from shared.generation_defaults import GenerationDefaults

from .errors import APIError, bad_request

MAX_LOGPROBS = 20             # engine_worker.sampling_params.MAX_LOGPROBS
MAX_STOP_STRINGS = 16
MAX_STOP_LEN = 1024
MAX_PROMPTS = 64              # completions: a batch of prompts in one request
MAX_STOP_TOKEN_IDS = 1024
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1

COMPLETION_FIELDS = frozenset({
    "model", "prompt", "max_tokens", "temperature", "top_p", "top_k", "n", "stream", "stream_options",
    "stop", "stop_token_ids", "seed", "logprobs", "echo", "presence_penalty", "frequency_penalty",
    "ignore_eos", "user", "suffix", "best_of", "logit_bias", "repetition_penalty", "extra_body",
})
CHAT_FIELDS = frozenset({
    "model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "n",
    "stream", "stream_options", "stop", "stop_token_ids", "seed", "logprobs", "top_logprobs",
    "presence_penalty", "frequency_penalty", "ignore_eos", "user", "logit_bias", "response_format",
    "tools", "tool_choice", "parallel_tool_calls", "store", "metadata", "service_tier", "repetition_penalty",
    "extra_body",
})
ROLES = frozenset({"system", "user", "assistant", "developer", "tool"})
MESSAGE_FIELDS = frozenset({"role", "content", "name", "tool_calls", "tool_call_id", "refusal"})


class Tokenizer(Protocol):
    async def encode(self, text: str) -> list[int]: ...
    async def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]: ...


@dataclass(slots=True)
class ModelContext:
    """What validation needs to know about the served model."""
    names: list[str]                 # accepted model names; the first is the default
    max_model_len: int
    vocab_size: int
    max_n: int
    tokenizer: Any
    defaults: GenerationDefaults = field(default_factory=GenerationDefaults)   # for unset fields


@dataclass(slots=True)
class ParsedRequest:
    kind: str                                  # "completion" | "chat"
    model: str
    prompts: list[list[int]]
    prompt_texts: list[str | None]
    n: int
    params: dict[str, Any]                     # SamplingParams fields, seed excluded
    seeds: list[int | None]                    # one per choice (n)
    stop: list[str]
    stream: bool
    include_usage: bool
    logprobs: int | None                       # engine top-N; None: no logprobs
    echo: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def num_choices(self) -> int:
        return len(self.prompts) * self.n

    def sub_params(self, choice: int) -> dict[str, Any]:
        p = dict(self.params)
        p["seed"] = self.seeds[choice % self.n]
        return p


# ---------------------------------------------------------------------- field checks
def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return (isinstance(v, (int, float)) and not isinstance(v, bool)) and math.isfinite(v)


def _int(body: dict, name: str, default: Any, lo: int | None = None, hi: int | None = None) -> Any:
    v = body.get(name)
    if v is None:
        return default
    if not _is_int(v):
        raise bad_request(f"'{name}' must be an integer, got {type(v).__name__}", name, "invalid_type")
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        rng = f"[{lo if lo is not None else '-inf'}, {hi if hi is not None else 'inf'}]"
        raise bad_request(f"'{name}' must be in {rng}, got {v}", name)
    return v


def _num(body: dict, name: str, default: float, lo: float, hi: float, lo_open: bool = False) -> float:
    v = body.get(name)
    if v is None:
        return default
    if not _is_num(v):
        raise bad_request(f"'{name}' must be a number, got {type(v).__name__}", name, "invalid_type")
    if v > hi or v < lo or (lo_open and v == lo):
        raise bad_request(f"'{name}' must be in {'(' if lo_open else '['}{lo}, {hi}], got {v}", name)
    return float(v)


def _bool(body: dict, name: str, default: bool) -> bool:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise bad_request(f"'{name}' must be a boolean, got {type(v).__name__}", name, "invalid_type")
    return v


def _flatten(body: dict, allowed: frozenset[str]) -> dict:
    """The body with an "extra_body" object's fields (as some clients send them) merged in."""
    extra = body.get("extra_body")
    if extra is None or "extra_body" not in allowed:
        return body
    if not isinstance(extra, dict):
        raise bad_request("'extra_body' must be an object", "extra_body", "invalid_type")
    clash = sorted(set(extra) & set(body))
    if clash or "extra_body" in extra:
        raise bad_request(f"'{(clash or ['extra_body'])[0]}' is given both in the body and in 'extra_body'",
                          "extra_body")
    merged = {k: v for k, v in body.items() if k != "extra_body"}
    merged.update(extra)
    return merged


def _check_unknown(body: dict, allowed: frozenset[str]) -> None:
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise bad_request(f"Unrecognized request argument supplied: {', '.join(unknown)}", unknown[0],
                          "unknown_parameter")


def _model(body: dict, ctx: ModelContext) -> str:
    model = body.get("model")
    if model is None:
        return ctx.names[0]
    if not isinstance(model, str):
        raise bad_request(f"'model' must be a string, got {type(model).__name__}", "model", "invalid_type")
    if model not in ctx.names:
        raise APIError(404, f"The model '{model}' does not exist. Available: {', '.join(ctx.names)}",
                       param="model", code="model_not_found")
    return model


def _stop(body: dict) -> list[str]:
    v = body.get("stop")
    if v is None:
        return []
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
        raise bad_request("'stop' must be a string or a list of strings", "stop", "invalid_type")
    if len(v) > MAX_STOP_STRINGS:
        raise bad_request(f"'stop' takes at most {MAX_STOP_STRINGS} strings", "stop")
    if any(s == "" or len(s) > MAX_STOP_LEN for s in v):
        raise bad_request(f"stop strings must be non-empty and at most {MAX_STOP_LEN} characters", "stop")
    return list(dict.fromkeys(v))


def _stop_token_ids(body: dict, vocab_size: int) -> list[int]:
    v = body.get("stop_token_ids")
    if v is None:
        return []
    if not isinstance(v, list) or not all(_is_int(t) for t in v):
        raise bad_request("'stop_token_ids' must be a list of integers", "stop_token_ids", "invalid_type")
    if len(v) > MAX_STOP_TOKEN_IDS:
        raise bad_request(f"'stop_token_ids' takes at most {MAX_STOP_TOKEN_IDS} ids", "stop_token_ids")
    if any(not 0 <= t < vocab_size for t in v):
        raise bad_request(f"stop_token_ids must be in [0, {vocab_size})", "stop_token_ids")
    return v


def _stream(body: dict) -> tuple[bool, bool]:
    stream = _bool(body, "stream", False)
    opts = body.get("stream_options")
    include_usage = False
    if opts is not None:
        if not isinstance(opts, dict):
            raise bad_request("'stream_options' must be an object", "stream_options", "invalid_type")
        if not stream:
            raise bad_request("'stream_options' is only allowed when 'stream' is true", "stream_options")
        unknown = set(opts) - {"include_usage", "continuous_usage_stats"}
        if unknown:
            raise bad_request(f"unknown stream_options: {sorted(unknown)}", "stream_options", "unknown_parameter")
        include_usage = _bool(opts, "include_usage", False)
        _bool(opts, "continuous_usage_stats", False)
    return stream, include_usage


def _seeds(body: dict, n: int, max_n: int) -> list[int | None]:
    seed = _int(body, "seed", None, SEED_MIN, SEED_MAX - max_n)
    if seed is not None:
        return [seed + i for i in range(n)]
    if n == 1:
        return [None]
    # Distinct seeds, so the n choices are n independent samples.
    seeds: list[int] = []
    while len(seeds) < n:
        s = secrets.randbits(62)
        if s not in seeds:
            seeds.append(s)
    return seeds


def _unsupported(body: dict) -> None:
    lb = body.get("logit_bias")
    if lb is not None and (not isinstance(lb, dict) or lb):
        raise bad_request("'logit_bias' is not supported", "logit_bias", "unsupported_parameter")
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise bad_request("'user' must be a string", "user", "invalid_type")


def _common(body: dict, ctx: ModelContext) -> dict[str, Any]:
    """The sampling fields both APIs share (SamplingParams minus max_tokens/logprobs/seed); an
    unset field takes the model's default (ctx.defaults)."""
    d = ctx.defaults
    return {
        "temperature": _num(body, "temperature", d.temperature, 0.0, 2.0),
        "top_p": _num(body, "top_p", d.top_p, 0.0, 1.0, lo_open=True),
        "top_k": _int(body, "top_k", d.top_k, -1, None),
        "stop_token_ids": _stop_token_ids(body, ctx.vocab_size),
        "ignore_eos": _bool(body, "ignore_eos", False),
        "presence_penalty": _num(body, "presence_penalty", 0.0, -2.0, 2.0),
        "frequency_penalty": _num(body, "frequency_penalty", 0.0, -2.0, 2.0),
        "repetition_penalty": _repetition_penalty(body, d.repetition_penalty),
    }


def _repetition_penalty(body: dict, default: float) -> float:
    """HF/vLLM semantics, applied by the engine: > 0; 1 is off, > 1 discourages repeats."""
    v = body.get("repetition_penalty")
    if v is None:
        return default
    if not _is_num(v):
        raise bad_request(f"'repetition_penalty' must be a number, got {type(v).__name__}", "repetition_penalty",
                          "invalid_type")
    if v <= 0:
        raise bad_request(f"'repetition_penalty' must be > 0, got {v}", "repetition_penalty")
    return float(v)


def _max_tokens(value: int | None, name: str, prompt_lens: list[int], ctx: ModelContext, default: int | None) -> int:
    """The request's max_tokens, checked against the context; unset: `default`, capped by the
    model's max_new_tokens (ctx.defaults.max_tokens) and by the room the prompt leaves."""
    longest = max(prompt_lens)
    if longest >= ctx.max_model_len:
        raise bad_request(
            f"This model's maximum context length is {ctx.max_model_len} tokens. However, your prompt has "
            f"{longest} tokens, which leaves no room for a completion.", "prompt" if name == "max_tokens" else "messages",
            "context_length_exceeded")
    room = ctx.max_model_len - longest
    if value is None:
        caps = [c for c in (default, ctx.defaults.max_tokens) if c is not None]
        return min([room, *caps])
    if longest + value > ctx.max_model_len:
        raise bad_request(
            f"This model's maximum context length is {ctx.max_model_len} tokens. However, you requested "
            f"{longest + value} tokens ({longest} in the prompt, {value} for the completion). Please reduce "
            f"the prompt or '{name}'.", name, "context_length_exceeded")
    return value


def _check_ids(ids: list[int], ctx: ModelContext, param: str) -> None:
    if not ids:
        raise bad_request("the prompt must not be empty", param, "empty_prompt")
    for t in ids:
        if not 0 <= t < ctx.vocab_size:
            raise bad_request(f"token id {t} is outside the vocabulary [0, {ctx.vocab_size})", param)


# ---------------------------------------------------------------------- completions
async def parse_completion(body: Any, ctx: ModelContext) -> ParsedRequest:
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object", None, "invalid_type")
    body = _flatten(body, COMPLETION_FIELDS)
    _check_unknown(body, COMPLETION_FIELDS)
    model = _model(body, ctx)
    if "prompt" not in body or body["prompt"] is None:
        raise bad_request("'prompt' is required", "prompt", "missing_required_parameter")
    prompt = body["prompt"]
    n = _int(body, "n", 1, 1, ctx.max_n)
    best_of = _int(body, "best_of", None, 1, ctx.max_n)
    if best_of is not None and best_of != n:
        raise bad_request("'best_of' other than n is not supported", "best_of", "unsupported_parameter")
    suffix = body.get("suffix")
    if suffix is not None and (not isinstance(suffix, str) or suffix):
        raise bad_request("'suffix' is not supported", "suffix", "unsupported_parameter")
    _unsupported(body)
    echo = _bool(body, "echo", False)
    stream, include_usage = _stream(body)
    logprobs = _int(body, "logprobs", None, 0, MAX_LOGPROBS)
    if echo and logprobs is not None:
        raise bad_request("'echo' together with 'logprobs' is not supported", "echo", "unsupported_parameter")
    max_tokens = _int(body, "max_tokens", None, 1, None)
    params = _common(body, ctx)
    stop = _stop(body)
    seeds = _seeds(body, n, ctx.max_n)

    # The prompt: a string, a list of strings, a list of token ids, or a list of lists of ids.
    prompts: list[list[int]] = []
    texts: list[str | None] = []
    if isinstance(prompt, str):
        batch: list = [prompt]
    elif isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        batch = [prompt]
    elif isinstance(prompt, list) and prompt and (all(isinstance(p, str) for p in prompt) or all(
            isinstance(p, list) and all(_is_int(t) for t in p) for p in prompt)):
        batch = prompt
    elif isinstance(prompt, list) and not prompt:
        raise bad_request("the prompt must not be empty", "prompt", "empty_prompt")
    else:
        raise bad_request("'prompt' must be a string, a list of strings, a list of token ids or a list of "
                          "lists of token ids", "prompt", "invalid_type")
    if len(batch) * n > max(MAX_PROMPTS, ctx.max_n) or len(batch) > MAX_PROMPTS:
        raise bad_request(f"too many prompts: {len(batch)} prompts x n={n}", "prompt")
    for p in batch:
        if isinstance(p, str):
            if p == "":
                raise bad_request("the prompt must not be empty", "prompt", "empty_prompt")
            ids = await _encode(ctx, p)
            texts.append(p)
        else:
            ids = list(p)
            texts.append(None)
        _check_ids(ids, ctx, "prompt")
        prompts.append(ids)
    params["max_tokens"] = _max_tokens(max_tokens, "max_tokens", [len(p) for p in prompts], ctx, 16)
    params["logprobs"] = logprobs
    return ParsedRequest("completion", model, prompts, texts, n, params, seeds, stop, stream, include_usage,
                         logprobs, echo=echo)


async def _encode(ctx: ModelContext, text: str) -> list[int]:
    try:
        return list(await ctx.tokenizer.encode(text))
    except ValueError as e:
        raise bad_request(f"cannot tokenize the prompt: {e}", "prompt") from None
    except Exception as e:       # tokenizer_service.TokenizerUnavailable and the like
        raise tokenizer_unavailable(e) from None


def tokenizer_unavailable(e: Exception) -> APIError:
    return APIError(503, f"the tokenizer is unavailable: {e}", code="tokenizer_unavailable", retry_after=1.0)


# ---------------------------------------------------------------------- chat
def normalize_messages(messages: Any) -> list[dict[str, str]]:
    if not isinstance(messages, list):
        raise bad_request("'messages' must be a list", "messages", "invalid_type")
    if not messages:
        raise bad_request("'messages' must not be empty", "messages", "empty_messages")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad_request(f"{where} must be an object", where, "invalid_type")
        unknown = set(m) - MESSAGE_FIELDS
        if unknown:
            raise bad_request(f"{where}: unknown fields {sorted(unknown)}", where, "unknown_parameter")
        role = m.get("role")
        if not isinstance(role, str) or role not in ROLES:
            raise bad_request(f"{where}.role must be one of {sorted(ROLES)}, got {role!r}", f"{where}.role")
        if m.get("tool_calls"):
            raise bad_request("tool calls are not supported", f"{where}.tool_calls", "unsupported_parameter")
        content = m.get("content")
        if isinstance(content, list):
            parts = []
            for j, part in enumerate(content):
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise bad_request(f"{where}.content[{j}]: only text parts are supported",
                                      f"{where}.content", "unsupported_content")
                parts.append(part["text"])
            content = "".join(parts)
        elif content is None and role == "assistant":
            content = ""
        elif not isinstance(content, str):
            raise bad_request(f"{where}.content must be a string or a list of text parts",
                              f"{where}.content", "invalid_type")
        name = m.get("name")
        if name is not None and not isinstance(name, str):
            raise bad_request(f"{where}.name must be a string", f"{where}.name", "invalid_type")
        out.append({"role": "system" if role == "developer" else role, "content": content})
    return out


async def parse_chat(body: Any, ctx: ModelContext, force_stream: bool | None = None,
                     allowed: frozenset[str] | None = None) -> ParsedRequest:
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object", None, "invalid_type")
    allowed = CHAT_FIELDS if allowed is None else allowed
    body = _flatten(body, allowed)
    _check_unknown(body, allowed)
    model = _model(body, ctx)
    if "messages" not in body:
        raise bad_request("'messages' is required", "messages", "missing_required_parameter")
    messages = normalize_messages(body["messages"])
    n = _int(body, "n", 1, 1, ctx.max_n)
    _unsupported(body)
    tools = body.get("tools")
    if tools is not None and (not isinstance(tools, list) or tools):
        raise bad_request("tools are not supported", "tools", "unsupported_parameter")
    tool_choice = body.get("tool_choice")
    if tool_choice not in (None, "none", "auto"):
        raise bad_request("'tool_choice' is not supported", "tool_choice", "unsupported_parameter")
    rf = body.get("response_format")
    if rf is not None and (not isinstance(rf, dict) or rf.get("type") != "text"):
        raise bad_request("only response_format {'type': 'text'} is supported", "response_format",
                          "unsupported_parameter")
    for flag in ("parallel_tool_calls", "store"):
        _bool(body, flag, False)
    if body.get("metadata") is not None and not isinstance(body["metadata"], dict):
        raise bad_request("'metadata' must be an object", "metadata", "invalid_type")
    if body.get("service_tier") is not None and not isinstance(body["service_tier"], str):
        raise bad_request("'service_tier' must be a string", "service_tier", "invalid_type")
    if force_stream is None:
        stream, include_usage = _stream(body)
    else:
        stream, include_usage = force_stream, False
    want_lp = _bool(body, "logprobs", False)
    top_lp = _int(body, "top_logprobs", None, 0, MAX_LOGPROBS)
    if top_lp is not None and not want_lp:
        raise bad_request("'top_logprobs' requires 'logprobs' to be true", "top_logprobs")
    logprobs = (top_lp or 0) if want_lp else None
    max_tokens = _int(body, "max_tokens", None, 1, None)
    mct = _int(body, "max_completion_tokens", None, 1, None)
    if max_tokens is not None and mct is not None and max_tokens != mct:
        raise bad_request("give 'max_tokens' or 'max_completion_tokens', not both", "max_completion_tokens")
    max_tokens = mct if mct is not None else max_tokens
    params = _common(body, ctx)
    stop = _stop(body)
    seeds = _seeds(body, n, ctx.max_n)
    try:
        ids = list(await ctx.tokenizer.apply_chat_template(messages, add_generation_prompt=True))
    except ValueError as e:
        raise bad_request(f"invalid messages: {e}", "messages") from None
    except Exception as e:
        raise tokenizer_unavailable(e) from None
    _check_ids(ids, ctx, "messages")
    params["max_tokens"] = _max_tokens(max_tokens, "max_tokens" if mct is None else "max_completion_tokens",
                                       [len(ids)], ctx, None)
    params["logprobs"] = logprobs
    return ParsedRequest("chat", model, [ids], [None], n, params, seeds, stop, stream, include_usage, logprobs,
                         extra={"messages": messages})
