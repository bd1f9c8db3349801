"""OpenAI requests (completions and chat) turned into what the engine runs.

The bodies (the JSON bytes of an HTTP request, or a decoded WebSocket message) are validated by
the pydantic models of gateway/api/api_models.py (types, ranges, unknown and unsupported fields). What needs the served model or joins fields is checked here, before
anything is XADDed: model name, n, vocabulary, the prompt and max_tokens against the context, n
against best_of, stream options, logprobs, min_tokens. The engine's ``SamplingParams`` travel as
a plain dict (no engine import: the gateway runs without torch).
"""
from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

from shared.generation_defaults import GenerationDefaults
from shared.sampling_limits import SEED_MAX
from tokenizer_service.tokenizer import RESERVED_TEMPLATE_KWARGS, ChatTemplateOptions

from ..backend.output import OutputOptions
from .api_models import (MAX_PROMPTS, ChatCompletionRequest, ChatTemplateFields, CompletionRequest, Message,
                         SamplingRequest, validate)
from .errors import APIError, bad_request
from .structured import structured_spec
from .tools import ToolCalling, parse_tools


class Tokenizer(Protocol):
    async def encode(self, text: str, add_special_tokens: bool = False) -> list[int]: ...
    async def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                                  options: ChatTemplateOptions | None = None) -> list[int]: ...


@dataclass(slots=True)
class ModelContext:
    """What validation needs to know about the model a request names."""
    name: str                        # the name the request used (its responses' "model")
    max_model_len: int
    vocab_size: int
    max_n: int
    tokenizer: Any
    chat_template: str | None = None          # the gateway's --chat-template (None: the tokenizer's)
    defaults: GenerationDefaults = field(default_factory=GenerationDefaults)   # for unset fields
    lora_name: str = ""                       # the adapter the name stands for ("" for a base model)
    served: Any = None                        # gateway.models.ServedModel


Resolve = Callable[[str | None], ModelContext]     # a request's "model" field -> its context (or 404)


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
    ctx: ModelContext | None = None            # the model it runs on

    @property
    def num_choices(self) -> int:
        return len(self.prompts) * self.n

    def sub_params(self, choice: int) -> dict[str, Any]:
        p = dict(self.params)
        p["seed"] = self.seeds[choice % self.n]
        return p


# ---------------------------------------------------------------------- rules beyond one field
def _n(req: SamplingRequest, ctx: ModelContext) -> int:
    if req.n > ctx.max_n:
        raise bad_request(f"'n' must be in [1, {ctx.max_n}], got {req.n}", "n")
    return req.n


def _stream(req: SamplingRequest) -> tuple[bool, bool, bool]:
    """(stream, include_usage, continuous_usage_stats)."""
    stream, opts = bool(req.stream), req.stream_options
    if opts is None:
        return stream, False, False
    if not stream:
        raise bad_request("'stream_options' is only allowed when 'stream' is true", "stream_options")
    return stream, bool(opts.include_usage), bool(opts.continuous_usage_stats and opts.include_usage)


def _stop(req: SamplingRequest) -> list[str]:
    stop = req.stop
    if stop is None:
        return []
    return [stop] if isinstance(stop, str) else list(dict.fromkeys(stop))


def _in_vocab(ids: list[int], ctx: ModelContext, param: str, what: str = "token id") -> None:
    if not ids or (min(ids) >= 0 and max(ids) < ctx.vocab_size):
        return
    bad = next(t for t in ids if not 0 <= t < ctx.vocab_size)
    raise bad_request(f"{what} {bad} is outside the vocabulary [0, {ctx.vocab_size})", param)


def _seeds(req: SamplingRequest, n: int) -> list[int | None]:
    seed = req.seed
    if seed is not None:
        if seed > SEED_MAX - n:
            raise bad_request(f"'seed' must be at most {SEED_MAX - n} with n={n}", "seed")
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


def _logit_bias(req: SamplingRequest, ctx: ModelContext) -> list[list[float]]:
    """OpenAI's {"token id": bias} as [[id, bias], ...] (msgpack maps want string keys)."""
    out = [[int(k), float(v)] for k, v in (req.logit_bias or {}).items()]
    _in_vocab([int(t) for t, _ in out], ctx, "logit_bias", "logit_bias token id")
    return out


def _output_options(req: SamplingRequest) -> OutputOptions:
    """How the gateway turns tokens into text: the detokenizer's and stop strings' options."""
    return OutputOptions(skip_special_tokens=req.skip_special_tokens is not False,
                         spaces_between_special_tokens=req.spaces_between_special_tokens is not False,
                         include_stop_str_in_output=bool(req.include_stop_str_in_output),
                         tokens_as_ids=bool(req.return_tokens_as_token_ids))


def _min_tokens(params: dict, req: SamplingRequest) -> None:
    """min_tokens, checked against the request's final max_tokens."""
    v = req.min_tokens or 0
    if v and "structured_output" in params:    # the grammar may end first: no token would be allowed
        raise bad_request("'min_tokens' cannot be combined with structured output", "min_tokens")
    if v > params["max_tokens"]:
        raise bad_request(f"'min_tokens' ({v}) must not exceed max_tokens ({params['max_tokens']})", "min_tokens")
    params["min_tokens"] = v


def _or(value: Any, default: Any) -> Any:
    return default if value is None else value


def _common(req: SamplingRequest, ctx: ModelContext) -> dict[str, Any]:
    """The sampling fields both APIs share (SamplingParams minus max_tokens/logprobs/seed); an
    unset field takes the model's default (ctx.defaults)."""
    d = ctx.defaults
    stop_ids = req.stop_token_ids or []
    _in_vocab(stop_ids, ctx, "stop_token_ids", "stop_token_ids id")
    return {
        "temperature": float(_or(req.temperature, d.temperature)),
        "top_p": float(_or(req.top_p, d.top_p)),
        "top_k": _or(req.top_k, d.top_k),
        "min_p": float(_or(req.min_p, d.min_p)),
        "stop_token_ids": stop_ids,
        "ignore_eos": bool(req.ignore_eos),
        "presence_penalty": float(_or(req.presence_penalty, 0.0)),
        "frequency_penalty": float(_or(req.frequency_penalty, 0.0)),
        "repetition_penalty": float(_or(req.repetition_penalty, d.repetition_penalty)),
        "logit_bias": _logit_bias(req, ctx),
    }


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
    _in_vocab(ids, ctx, param)


def _prompt_logprobs(req: SamplingRequest, stream: bool) -> int | None:
    if req.prompt_logprobs is not None and stream:
        raise bad_request("'prompt_logprobs' are not available when 'stream' is true", "prompt_logprobs")
    return req.prompt_logprobs


def _engine_prompt_logprobs(*wanted: int | None) -> int | None:
    """The top-N the engine scores the prompt with: the most any use of them asks for."""
    asked = [w for w in wanted if w is not None]
    return max(asked) if asked else None


def _set_structured(params: dict[str, Any], spec: dict | None) -> None:
    if spec is not None:
        params["structured_output"] = spec


# ---------------------------------------------------------------------- completions
async def parse_completion(body: Any, resolve: Resolve) -> ParsedRequest:
    req: CompletionRequest = validate(CompletionRequest, body)
    ctx = resolve(req.model)
    n = _n(req, ctx)
    if req.best_of is not None and req.best_of != n:
        raise bad_request("'best_of' other than n is not supported", "best_of", "unsupported_parameter")
    if req.suffix:
        raise bad_request("'suffix' is not supported", "suffix", "unsupported_parameter")
    echo = bool(req.echo)
    stream, include_usage, continuous = _stream(req)
    prompt_logprobs = _prompt_logprobs(req, stream)
    if req.max_tokens == 0 and not echo:      # 0: score the prompt only, with echo
        raise bad_request("'max_tokens' must be at least 1 (0 only with 'echo')", "max_tokens")
    params = _common(req, ctx)
    stop = _stop(req)
    seeds = _seeds(req, n)
    prompts, texts = await _prompts(req.prompt, n, ctx, req.add_special_tokens)
    echo_only = echo and req.max_tokens == 0
    # The engine makes one token that nobody sees when only the prompt is wanted (as vLLM does).
    params["max_tokens"] = _max_tokens(1 if echo_only else req.max_tokens, "max_tokens", [len(p) for p in prompts],
                                       ctx, 16)
    _set_structured(params, structured_spec(req))
    _min_tokens(params, req)
    params["logprobs"] = req.logprobs
    params["prompt_logprobs"] = _engine_prompt_logprobs(prompt_logprobs, req.logprobs if echo else None)
    return ParsedRequest("completion", ctx.name, prompts, texts, n, params, seeds, stop, stream, include_usage,
                         req.logprobs, echo=echo, output=_output_options(req), continuous_usage=continuous,
                         prompt_logprobs=prompt_logprobs, echo_only=echo_only, ctx=ctx)


async def _prompts(prompt: Any, n: int, ctx: ModelContext, add_special_tokens: bool
                   ) -> tuple[list[list[int]], list[str | None]]:
    """The prompt (a string, a list of strings, a list of token ids, or a list of lists of ids) as
    token ids, with each one's text where it was given as text: a text with the tokenizer's special
    tokens (BOS) where `add_special_tokens` (vLLM's default for completions), ids as given."""
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        batch: list = [prompt]
    elif not prompt:
        raise bad_request("the prompt must not be empty", "prompt", "empty_prompt")
    else:
        batch = prompt
    if len(batch) * n > max(MAX_PROMPTS, ctx.max_n) or len(batch) > MAX_PROMPTS:
        raise bad_request(f"too many prompts: {len(batch)} prompts x n={n}", "prompt")
    prompts: list[list[int]] = []
    texts: list[str | None] = []
    for p in batch:
        if isinstance(p, str):
            if p == "":
                raise bad_request("the prompt must not be empty", "prompt", "empty_prompt")
            ids = await _encode(ctx, p, add_special_tokens)
            texts.append(p)
        else:
            ids = list(p)
            texts.append(None)
        _check_ids(ids, ctx, "prompt")
        prompts.append(ids)
    return prompts, texts


async def _encode(ctx: ModelContext, text: str, add_special_tokens: bool) -> list[int]:
    try:
        return list(await ctx.tokenizer.encode(text, add_special_tokens))
    except ValueError as e:
        raise bad_request(f"cannot tokenize the prompt: {e}", "prompt") from None
    except Exception as e:       # tokenizer_service.TokenizerUnavailable and the like
        raise tokenizer_unavailable(e) from None


def tokenizer_unavailable(e: Exception) -> APIError:
    return APIError(503, f"the tokenizer is unavailable: {e}", code="tokenizer_unavailable", retry_after=1.0)


# ---------------------------------------------------------------------- chat
def normalize_messages(messages: list[Message]) -> list[dict[str, Any]]:
    """OpenAI messages as the template takes them: text content, "developer" as "system", and
    the participant's "name" where given."""
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        content = m.content
        if isinstance(content, list):
            if any(p.type != "text" for p in content):
                raise bad_request(f"{where}.content: only text parts are supported", f"{where}.content",
                                  "unsupported_content")
            content = "".join(p.text for p in content)
        elif content is None:
            if m.role != "assistant":
                raise bad_request(f"{where}.content is required for a {m.role} message", f"{where}.content",
                                  "missing_required_parameter")
            content = ""
        msg: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": content}
        if m.tool_calls:
            msg["tool_calls"] = _message_tool_calls(m, where)
        if m.role == "tool":
            if m.tool_call_id is None:
                raise bad_request(f"{where}.tool_call_id (a string) is required for a tool message",
                                  f"{where}.tool_call_id", "missing_required_parameter")
            msg["tool_call_id"] = m.tool_call_id
        if m.name is not None:
            msg["name"] = m.name
        out.append(msg)
    return out


def _message_tool_calls(m: Message, where: str) -> list[dict]:
    """An assistant message's earlier tool calls, for the chat template: arguments as objects (as
    templates expect them)."""
    if m.role != "assistant":
        raise bad_request(f"{where}.tool_calls are only allowed on an assistant message", f"{where}.tool_calls")
    out = []
    for i, c in enumerate(m.tool_calls):
        try:
            args = json.loads(c.function.arguments)
        except ValueError:
            raise bad_request(f"{where}.tool_calls[{i}].function.arguments is not valid JSON",
                              f"{where}.tool_calls") from None
        out.append({"id": c.id, "type": "function", "function": {"name": c.function.name, "arguments": args}})
    return out


async def parse_chat(body: Any, resolve: Resolve, force_stream: bool | None = None,
                     allowed: frozenset[str] | None = None) -> ParsedRequest:
    req: ChatCompletionRequest = validate(ChatCompletionRequest, body, allowed)
    ctx = resolve(req.model)
    messages = normalize_messages(req.messages)
    n = _n(req, ctx)
    tools = parse_tools(req)
    spec = structured_spec(req)
    forced = tools.spec() if tools is not None else None
    if forced is not None and spec is not None:
        raise bad_request("a 'required' or named tool_choice cannot be combined with a response_format or "
                          "structured_outputs", "tool_choice")
    if force_stream is None:
        stream, include_usage, continuous = _stream(req)
    else:
        stream, include_usage, continuous = force_stream, False, False
    if req.top_logprobs is not None and not req.logprobs:
        raise bad_request("'top_logprobs' requires 'logprobs' to be true", "top_logprobs")
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    max_tokens, mct = req.max_tokens, req.max_completion_tokens
    if max_tokens == 0:
        raise bad_request("'max_tokens' must be at least 1", "max_tokens")
    if max_tokens is not None and mct is not None and max_tokens != mct:
        raise bad_request("give 'max_tokens' or 'max_completion_tokens', not both", "max_completion_tokens")
    max_tokens = mct if mct is not None else max_tokens
    params = _common(req, ctx)
    stop = _stop(req)
    seeds = _seeds(req, n)
    add_generation_prompt, options = template_options(req, ctx, messages)
    try:
        if tools is not None:
            options.tools = tools.tools
        if req.add_special_tokens:      # vLLM's: the template's text, encoded with the specials added
            text = await ctx.tokenizer.render_chat(messages, add_generation_prompt, options)
            ids = list(await ctx.tokenizer.encode(text, True))
        else:
            ids = list(await ctx.tokenizer.apply_chat_template(messages, add_generation_prompt, options))
    except ValueError as e:
        raise bad_request(f"invalid messages: {e}", "messages") from None
    except Exception as e:
        raise tokenizer_unavailable(e) from None
    _check_ids(ids, ctx, "messages")
    params["max_tokens"] = _max_tokens(max_tokens, "max_tokens" if mct is None else "max_completion_tokens",
                                       [len(ids)], ctx, None)
    _set_structured(params, forced or spec)
    _min_tokens(params, req)
    params["logprobs"] = logprobs
    prompt_logprobs = _prompt_logprobs(req, stream)
    params["prompt_logprobs"] = prompt_logprobs
    return ParsedRequest("chat", ctx.name, [ids], [None], n, params, seeds, stop, stream, include_usage, logprobs,
                         extra={"messages": messages}, tools=tools, output=_output_options(req),
                         continuous_usage=continuous, prompt_logprobs=prompt_logprobs, ctx=ctx)


def template_options(req: ChatTemplateFields, ctx: ModelContext,
                     messages: list[dict]) -> tuple[bool, ChatTemplateOptions]:
    """add_generation_prompt and the rest of vLLM's chat template fields, checked."""
    continue_final = bool(req.continue_final_message)
    agp = _or(req.add_generation_prompt, not continue_final)
    if continue_final and agp:
        raise bad_request("'continue_final_message' and 'add_generation_prompt' cannot both be true",
                          "continue_final_message")
    if continue_final and messages[-1]["role"] != "assistant":
        raise bad_request("'continue_final_message' needs an assistant message last", "continue_final_message")
    kwargs = req.chat_template_kwargs or {}
    reserved = sorted(set(kwargs) & RESERVED_TEMPLATE_KWARGS)
    if reserved:
        raise bad_request(f"'chat_template_kwargs' may not set {', '.join(reserved)}", "chat_template_kwargs")
    return agp, ChatTemplateOptions(continue_final, req.chat_template or ctx.chat_template, dict(kwargs))
