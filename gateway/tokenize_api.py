"""POST /tokenize and /detokenize in vLLM's shapes (behind the API key, like every /v1 route).

    /tokenize    {"prompt", "add_special_tokens" (default true), "return_token_strs"}
              or {"messages", "add_generation_prompt", "continue_final_message", "add_special_tokens"
                  (default false), "chat_template", "chat_template_kwargs", "return_token_strs"}
              -> {"count", "max_model_len", "tokens", "token_strs"}
    /detokenize  {"tokens"} -> {"prompt"}

A chat prompt is rendered exactly as /v1/chat/completions renders it (gateway.openai_api).
"""
from __future__ import annotations

import asyncio
import logging
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from .errors import APIError, bad_request
from .http_common import check_auth, gateway_of, read_json
from .openai_api import bool_field, check_model, normalize_messages, template_options, tokenizer_unavailable

log = logging.getLogger("kaiten.gateway")

TOKENIZE_FIELDS = frozenset({"model", "prompt", "messages", "add_special_tokens", "return_token_strs",
                             "add_generation_prompt", "continue_final_message", "chat_template",
                             "chat_template_kwargs"})
DETOKENIZE_FIELDS = frozenset({"model", "tokens"})
OFFLOAD = 8192          # characters or ids above which the work runs on a thread


async def tokenize(request: Request) -> Response:
    gw = gateway_of(request)
    try:
        check_auth(request)
        body = await _body(request, TOKENIZE_FIELDS)
        ctx = gw.model_context()
        check_model(body, ctx)
        ids = await (_chat_ids(body, ctx) if "messages" in body else _prompt_ids(body, gw))
        strs = None
        if bool_field(body, "return_token_strs", False):
            strs = gw.text_tokenizer.hf.convert_ids_to_tokens(ids)
    except APIError as e:
        return e.response()
    return JSONResponse({"count": len(ids), "max_model_len": ctx.max_model_len, "tokens": ids, "token_strs": strs})


async def detokenize(request: Request) -> Response:
    gw = gateway_of(request)
    try:
        check_auth(request)
        body = await _body(request, DETOKENIZE_FIELDS)
        ctx = gw.model_context()
        check_model(body, ctx)
        ids = body.get("tokens")
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise bad_request("'tokens' must be a list of token ids", "tokens", "invalid_type")
        bad = next((t for t in ids if not 0 <= t < ctx.vocab_size), None)
        if bad is not None:
            raise bad_request(f"token id {bad} is outside the vocabulary [0, {ctx.vocab_size})", "tokens")
        text = await _offload(len(ids), gw.text_tokenizer.decode, ids)
    except APIError as e:
        return e.response()
    return JSONResponse({"prompt": text})


async def _body(request: Request, allowed: frozenset[str]) -> dict[str, Any]:
    config = gateway_of(request).config
    body = await read_json(request, config.max_body_bytes, config.max_json_depth)
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object", None, "invalid_type")
    unknown = sorted(set(body) - allowed)
    if unknown:
        log.warning("ignoring unknown request fields: %s", ", ".join(unknown))
    return body


async def _prompt_ids(body: dict, gw) -> list[int]:
    prompt = body.get("prompt")
    if not isinstance(prompt, str):
        raise bad_request("give 'prompt' (a string) or 'messages'", "prompt", "invalid_type")
    special = bool_field(body, "add_special_tokens", True)
    try:
        return await _offload(len(prompt), gw.text_tokenizer.encode, prompt, special)
    except ValueError as e:
        raise bad_request(f"cannot tokenize the prompt: {e}", "prompt") from None


async def _chat_ids(body: dict, ctx) -> list[int]:
    messages = normalize_messages(body["messages"])
    agp, options = template_options(body, ctx, messages)
    if bool_field(body, "add_special_tokens", False):
        raise bad_request("'add_special_tokens' is not supported with 'messages' (the template adds them)",
                          "add_special_tokens", "unsupported_parameter")
    try:
        return list(await ctx.tokenizer.apply_chat_template(messages, agp, options))
    except ValueError as e:
        raise bad_request(f"invalid messages: {e}", "messages") from None
    except Exception as e:
        raise tokenizer_unavailable(e) from None


async def _offload(size: int, fn, *args):
    return await asyncio.to_thread(fn, *args) if size > OFFLOAD else fn(*args)
