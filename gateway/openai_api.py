"""OpenAI request validation (completions and chat) and response shapes.

Everything a request can get wrong is checked here, before anything is XADDed: types, ranges,
the prompt and max_tokens against the context length. As in vLLM, a field nobody knows is ignored
with one warning naming it; a known field Kaiten does not implement is a 400 unless it has its
"off" value. The engine's ``SamplingParams`` travel as a plain dict (no engine import: the gateway
runs without torch).
"""
from __future__ import annotations

import json
import logging
import math
import secrets
from dataclasses import dataclass, field
from typing import Any, Protocol

from shared.generation_defaults import GenerationDefaults
from tokenizer_service.tokenizer import RESERVED_TEMPLATE_KWARGS, ChatTemplateOptions

from .errors import APIError, bad_request
from .output import OutputOptions
from .structured import structured_spec
from .tools import ToolCalling, parse_tools

log = logging.getLogger("kaiten.gateway")

MAX_LOGPROBS = 20             # engine_worker.sampling_params.MAX_LOGPROBS
MAX_STOP_STRINGS = 16
MAX_STOP_LEN = 1024
MAX_PROMPTS = 64              # completions: a batch of prompts in one request
MAX_STOP_TOKEN_IDS = 1024
MAX_LOGIT_BIAS = 1024
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1

# vLLM's fields that Kaiten does not implement, with their "off" value: anything else is a 400.
UNSUPPORTED_FIELDS: dict[str, Any] = {
    "use_beam_search": False, "length_penalty": 1.0, "allowed_token_ids": None, "bad_words": None,
    "truncate_prompt_tokens": None, "guided_json": None, "guided_regex": None,
    "guided_choice": None, "guided_grammar": None, "guided_decoding_backend": None,
    "guided_whitespace_pattern": None, "logits_processors": None, "priority": 0,
    "prompt_embeds": None, "documents": None, "mm_processor_kwargs": None, "kv_transfer_params": None,
    "vllm_xargs": None, "add_special_tokens": False,
}
SAMPLING_FIELDS = frozenset({
    "model", "max_tokens", "temperature", "top_p", "top_k", "min_p", "n", "stream", "stream_options", "stop",
    "stop_token_ids", "seed", "presence_penalty", "frequency_penalty", "repetition_penalty", "ignore_eos",
    "min_tokens", "logit_bias", "user", "skip_special_tokens", "spaces_between_special_tokens",
    "include_stop_str_in_output", "return_tokens_as_token_ids", "prompt_logprobs", "extra_body",
    "response_format", "structured_outputs",
}) | frozenset(UNSUPPORTED_FIELDS)
COMPLETION_FIELDS = SAMPLING_FIELDS | {"prompt", "logprobs", "echo", "suffix", "best_of"}
CHAT_FIELDS = SAMPLING_FIELDS | {
    "messages", "max_completion_tokens", "logprobs", "top_logprobs", "tools", "tool_choice",
    "parallel_tool_calls", "store", "metadata", "service_tier", "chat_template", "chat_template_kwargs",
    "add_generation_prompt", "continue_final_message",
}
ROLES = frozenset({"system", "user", "assistant", "developer", "tool"})
MESSAGE_FIELDS = frozenset({"role", "content", "name", "tool_calls", "tool_call_id", "refusal"})


class Tokenizer(Protocol):
    async def encode(self, text: str) -> list[int]: ...
    async def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                                  options: ChatTemplateOptions | None = None) -> list[int]: ...


@dataclass(slots=True)
class ModelContext:
    """What validation needs to know about the served model."""
    names: list[str]                 # accepted model names; the first is the default
    max_model_len: int
    vocab_size: int
    max_n: int
    tokenizer: Any
    chat_template: str | None = None          # the gateway's --chat-template (None: the tokenizer's)
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
    tools: ToolCalling | None = None           # chat with tools: how the output becomes tool_calls
    output: OutputOptions = field(default_factory=OutputOptions)
    continuous_usage: bool = False             # stream_options.continuous_usage_stats (with include_usage)
    prompt_logprobs: int | None = None         # vLLM's prompt_logprobs: top-N per prompt token
    echo_only: bool = False                    # echo with max_tokens 0: the prompt (and its logprobs) only

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


def bool_field(body: dict, name: str, default: bool) -> bool:
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


def _check_fields(body: dict, allowed: frozenset[str]) -> None:
    """Unknown fields: one warning naming them (vLLM's way). Known but unsupported ones: a 400
    unless off."""
    unknown = sorted(set(body) - allowed)
    if unknown:
        log.warning("ignoring unknown request fields: %s", ", ".join(unknown))
    for name, off in UNSUPPORTED_FIELDS.items():
        v = body.get(name)
        if name in allowed and v is not None and v != off and v not in ([], {}):
            raise bad_request(f"'{name}' is not supported", name, "unsupported_parameter")


def check_model(body: dict, ctx: ModelContext) -> str:
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


def _stream(body: dict) -> tuple[bool, bool, bool]:
    """(stream, include_usage, continuous_usage_stats)."""
    stream = bool_field(body, "stream", False)
    opts = body.get("stream_options")
    include_usage = continuous = False
    if opts is not None:
        if not isinstance(opts, dict):
            raise bad_request("'stream_options' must be an object", "stream_options", "invalid_type")
        if not stream:
            raise bad_request("'stream_options' is only allowed when 'stream' is true", "stream_options")
        unknown = set(opts) - {"include_usage", "continuous_usage_stats"}
        if unknown:
            raise bad_request(f"unknown stream_options: {sorted(unknown)}", "stream_options", "unknown_parameter")
        include_usage = bool_field(opts, "include_usage", False)
        continuous = bool_field(opts, "continuous_usage_stats", False) and include_usage
    return stream, include_usage, continuous


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


def _check_user(body: dict) -> None:
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise bad_request("'user' must be a string", "user", "invalid_type")


def _logit_bias(body: dict, vocab_size: int) -> list[list[float]]:
    """OpenAI's {"token id": bias in [-100, 100]} as [[id, bias], ...] (msgpack maps want string keys)."""
    v = body.get("logit_bias")
    if v is None:
        return []
    if not isinstance(v, dict):
        raise bad_request("'logit_bias' must be an object mapping token ids to biases", "logit_bias", "invalid_type")
    if len(v) > MAX_LOGIT_BIAS:
        raise bad_request(f"'logit_bias' takes at most {MAX_LOGIT_BIAS} tokens", "logit_bias")
    out = []
    for key, bias in v.items():
        try:
            tid = int(key)
        except (TypeError, ValueError):
            raise bad_request(f"logit_bias key {key!r} is not a token id", "logit_bias") from None
        if not 0 <= tid < vocab_size:
            raise bad_request(f"logit_bias token id {tid} is outside the vocabulary [0, {vocab_size})", "logit_bias")
        if not _is_num(bias) or not -100 <= bias <= 100:
            raise bad_request(f"logit_bias values must be numbers in [-100, 100], got {bias!r} for token {tid}",
                              "logit_bias")
        out.append([tid, float(bias)])
    return out


def _output_options(body: dict) -> OutputOptions:
    """How the gateway turns tokens into text: the detokenizer's and stop strings' options."""
    return OutputOptions(skip_special_tokens=bool_field(body, "skip_special_tokens", True),
                         spaces_between_special_tokens=bool_field(body, "spaces_between_special_tokens", True),
                         include_stop_str_in_output=bool_field(body, "include_stop_str_in_output", False),
                         tokens_as_ids=bool_field(body, "return_tokens_as_token_ids", False))


def _min_tokens(params: dict, body: dict) -> None:
    """min_tokens, checked against the request's final max_tokens."""
    v = _int(body, "min_tokens", 0, 0, None)
    if v > params["max_tokens"]:
        raise bad_request(f"'min_tokens' ({v}) must not exceed max_tokens ({params['max_tokens']})", "min_tokens")
    params["min_tokens"] = v


def _common(body: dict, ctx: ModelContext) -> dict[str, Any]:
    """The sampling fields both APIs share (SamplingParams minus max_tokens/logprobs/seed); an
    unset field takes the model's default (ctx.defaults)."""
    d = ctx.defaults
    return {
        "temperature": _num(body, "temperature", d.temperature, 0.0, 2.0),
        "top_p": _num(body, "top_p", d.top_p, 0.0, 1.0, lo_open=True),
        "top_k": _int(body, "top_k", d.top_k, -1, None),
        "min_p": _num(body, "min_p", d.min_p, 0.0, 1.0),
        "stop_token_ids": _stop_token_ids(body, ctx.vocab_size),
        "ignore_eos": bool_field(body, "ignore_eos", False),
        "presence_penalty": _num(body, "presence_penalty", 0.0, -2.0, 2.0),
        "frequency_penalty": _num(body, "frequency_penalty", 0.0, -2.0, 2.0),
        "repetition_penalty": _repetition_penalty(body, d.repetition_penalty),
        "logit_bias": _logit_bias(body, ctx.vocab_size),
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
    _check_fields(body, COMPLETION_FIELDS)
    model = check_model(body, ctx)
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
    _check_user(body)
    echo = bool_field(body, "echo", False)
    stream, include_usage, continuous = _stream(body)
    logprobs = _int(body, "logprobs", None, 0, MAX_LOGPROBS)
    prompt_logprobs = _prompt_logprobs(body, stream)
    max_tokens = _int(body, "max_tokens", None, 0 if echo else 1, None)   # 0: score the prompt only
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
    echo_only = echo and max_tokens == 0
    # The engine makes one token that nobody sees when only the prompt is wanted (as vLLM does).
    params["max_tokens"] = _max_tokens(1 if echo_only else max_tokens, "max_tokens", [len(p) for p in prompts],
                                       ctx, 16)
    _min_tokens(params, body)
    params["logprobs"] = logprobs
    _set_structured(params, structured_spec(body))
    params["prompt_logprobs"] = _engine_prompt_logprobs(prompt_logprobs, logprobs if echo else None)
    return ParsedRequest("completion", model, prompts, texts, n, params, seeds, stop, stream, include_usage,
                         logprobs, echo=echo, output=_output_options(body), continuous_usage=continuous,
                         prompt_logprobs=prompt_logprobs, echo_only=echo_only)


def _prompt_logprobs(body: dict, stream: bool) -> int | None:
    v = _int(body, "prompt_logprobs", None, 0, MAX_LOGPROBS)
    if v is not None and stream:
        raise bad_request("'prompt_logprobs' are not available when 'stream' is true", "prompt_logprobs")
    return v


def _engine_prompt_logprobs(*wanted: int | None) -> int | None:
    """The top-N the engine scores the prompt with: the most any use of them asks for."""
    asked = [w for w in wanted if w is not None]
    return max(asked) if asked else None


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
    """OpenAI messages as the template takes them: text content, "developer" as "system", and
    the participant's "name" where given."""
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
        msg = {"role": "system" if role == "developer" else role, "content": content}
        if m.get("tool_calls"):
            msg["tool_calls"] = _message_tool_calls(m["tool_calls"], role, where)
        if role == "tool":
            if not isinstance(m.get("tool_call_id"), str):
                raise bad_request(f"{where}.tool_call_id (a string) is required for a tool message",
                                  f"{where}.tool_call_id", "missing_required_parameter")
            msg["tool_call_id"] = m["tool_call_id"]
        if name is not None:
            msg["name"] = name
        out.append(msg)
    return out


def _message_tool_calls(calls: Any, role: str, where: str) -> list[dict]:
    """An assistant message's earlier tool calls, for the chat template: arguments as objects (as
    templates expect them)."""
    if role != "assistant" or not isinstance(calls, list):
        raise bad_request(f"{where}.tool_calls must be a list, on an assistant message", f"{where}.tool_calls")
    out = []
    for i, c in enumerate(calls):
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not isinstance(fn.get("arguments"), str):
            raise bad_request(f"{where}.tool_calls[{i}] must be {{'id', 'type': 'function', 'function': "
                              "{'name', 'arguments' (JSON text)}}", f"{where}.tool_calls", "invalid_type")
        try:
            args = json.loads(fn["arguments"])
        except ValueError:
            raise bad_request(f"{where}.tool_calls[{i}].function.arguments is not valid JSON",
                              f"{where}.tool_calls") from None
        out.append({"id": c.get("id"), "type": "function", "function": {"name": fn["name"], "arguments": args}})
    return out


def _set_structured(params: dict[str, Any], spec: dict | None) -> None:
    if spec is not None:
        params["structured_output"] = spec


async def parse_chat(body: Any, ctx: ModelContext, force_stream: bool | None = None,
                     allowed: frozenset[str] | None = None) -> ParsedRequest:
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object", None, "invalid_type")
    allowed = CHAT_FIELDS if allowed is None else allowed
    body = _flatten(body, allowed)
    _check_fields(body, allowed)
    model = check_model(body, ctx)
    if "messages" not in body:
        raise bad_request("'messages' is required", "messages", "missing_required_parameter")
    messages = normalize_messages(body["messages"])
    n = _int(body, "n", 1, 1, ctx.max_n)
    _check_user(body)
    tools = parse_tools(body)
    spec = structured_spec(body)
    forced = tools.spec() if tools is not None else None
    if forced is not None and spec is not None:
        raise bad_request("a 'required' or named tool_choice cannot be combined with a response_format or "
                          "structured_outputs", "tool_choice")
    bool_field(body, "store", False)
    if body.get("metadata") is not None and not isinstance(body["metadata"], dict):
        raise bad_request("'metadata' must be an object", "metadata", "invalid_type")
    if body.get("service_tier") is not None and not isinstance(body["service_tier"], str):
        raise bad_request("'service_tier' must be a string", "service_tier", "invalid_type")
    if force_stream is None:
        stream, include_usage, continuous = _stream(body)
    else:
        stream, include_usage, continuous = force_stream, False, False
    want_lp = bool_field(body, "logprobs", False)
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
    add_generation_prompt, options = template_options(body, ctx, messages)
    try:
        if tools is not None:
            options.tools = tools.tools
        ids = list(await ctx.tokenizer.apply_chat_template(messages, add_generation_prompt, options))
    except ValueError as e:
        raise bad_request(f"invalid messages: {e}", "messages") from None
    except Exception as e:
        raise tokenizer_unavailable(e) from None
    _check_ids(ids, ctx, "messages")
    params["max_tokens"] = _max_tokens(max_tokens, "max_tokens" if mct is None else "max_completion_tokens",
                                       [len(ids)], ctx, None)
    _min_tokens(params, body)
    params["logprobs"] = logprobs
    prompt_logprobs = _prompt_logprobs(body, stream)
    params["prompt_logprobs"] = prompt_logprobs
    _set_structured(params, forced or spec)
    return ParsedRequest("chat", model, [ids], [None], n, params, seeds, stop, stream, include_usage, logprobs,
                         extra={"messages": messages}, tools=tools, output=_output_options(body),
                         continuous_usage=continuous, prompt_logprobs=prompt_logprobs)


def template_options(body: dict, ctx: ModelContext, messages: list[dict]) -> tuple[bool, ChatTemplateOptions]:
    """add_generation_prompt and the rest of vLLM's chat template fields, checked."""
    continue_final = bool_field(body, "continue_final_message", False)
    agp = bool_field(body, "add_generation_prompt", not continue_final)
    if continue_final and agp:
        raise bad_request("'continue_final_message' and 'add_generation_prompt' cannot both be true",
                          "continue_final_message")
    if continue_final and messages[-1]["role"] != "assistant":
        raise bad_request("'continue_final_message' needs an assistant message last", "continue_final_message")
    template = body.get("chat_template")
    if template is not None and not isinstance(template, str):
        raise bad_request("'chat_template' must be a string", "chat_template", "invalid_type")
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise bad_request("'chat_template_kwargs' must be an object", "chat_template_kwargs", "invalid_type")
    reserved = sorted(set(kwargs or {}) & RESERVED_TEMPLATE_KWARGS)
    if reserved:
        raise bad_request(f"'chat_template_kwargs' may not set {', '.join(reserved)}", "chat_template_kwargs")
    return agp, ChatTemplateOptions(continue_final, template or ctx.chat_template, dict(kwargs or {}))
