"""POST /tokenize and /detokenize in vLLM's shapes (behind the API key, like every /v1 route).

    /tokenize    {"prompt", "add_special_tokens" (default true), "return_token_strs"}
              or {"messages", "add_generation_prompt", "continue_final_message", "add_special_tokens"
                  (default false), "chat_template", "chat_template_kwargs", "return_token_strs"}
              -> {"count", "max_model_len", "tokens", "token_strs"}
    /detokenize  {"tokens"} -> {"prompt"}

A chat prompt is rendered exactly as /v1/chat/completions renders it (gateway.api.openai_api).
As in vLLM, "add_special_tokens" adds the tokenizer's special tokens (BOS and the like, where its
post-processor has them) when the text is encoded: a prompt's by default; a chat prompt's only when
asked, on top of those its template writes.
"""
from __future__ import annotations

import asyncio
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from .api_models import DetokenizeRequest, TokenizeChatRequest, TokenizeCompletionRequest, validate
from .errors import APIError, bad_request
from .http_common import check_auth, gateway_of, json_response, read_json
from .openai_api import normalize_messages, template_options, tokenizer_unavailable
from .response_models import DetokenizeResponse, TokenizeResponse

OFFLOAD = 8192          # characters or ids above which the work runs on a thread


async def tokenize(request: Request) -> Response:
    gw = gateway_of(request)
    try:
        check_auth(request)
        body = await _body(request)
        chat = isinstance(body, dict) and "messages" in body
        req = validate(TokenizeChatRequest if chat else TokenizeCompletionRequest, body)
        ctx = gw.resolve(req.model)
        ids = await (_chat_ids(req, ctx) if chat else _prompt_ids(req, ctx))
        strs = ctx.served.text_tokenizer.hf.convert_ids_to_tokens(ids) if req.return_token_strs else None
    except APIError as e:
        return e.response()
    return json_response(TokenizeResponse, {"count": len(ids), "max_model_len": ctx.max_model_len, "tokens": ids,
                                            "token_strs": strs})


async def detokenize(request: Request) -> Response:
    gw = gateway_of(request)
    try:
        check_auth(request)
        req = validate(DetokenizeRequest, await _body(request))
        ctx = gw.resolve(req.model)
        bad = next((t for t in req.tokens if t >= ctx.vocab_size), None)
        if bad is not None:
            raise bad_request(f"token id {bad} is outside the vocabulary [0, {ctx.vocab_size})", "tokens")
        text = await _offload(len(req.tokens), ctx.served.text_tokenizer.decode, req.tokens)
    except APIError as e:
        return e.response()
    return json_response(DetokenizeResponse, {"prompt": text})


async def _body(request: Request) -> Any:
    config = gateway_of(request).config
    return await read_json(request, config.max_body_bytes, config.max_json_depth)


async def _prompt_ids(req: TokenizeCompletionRequest, ctx) -> list[int]:
    try:
        return await _offload(len(req.prompt), ctx.served.text_tokenizer.encode, req.prompt, req.add_special_tokens)
    except ValueError as e:
        raise bad_request(f"cannot tokenize the prompt: {e}", "prompt") from None


async def _chat_ids(req: TokenizeChatRequest, ctx) -> list[int]:
    messages = normalize_messages(req.messages)
    agp, options = template_options(req, ctx, messages)
    try:
        if not req.add_special_tokens:
            return list(await ctx.tokenizer.apply_chat_template(messages, agp, options))
        text = await ctx.tokenizer.render_chat(messages, agp, options)
    except ValueError as e:
        raise bad_request(f"invalid messages: {e}", "messages") from None
    except Exception as e:
        raise tokenizer_unavailable(e) from None
    return await _offload(len(text), ctx.served.text_tokenizer.encode, text, True)


async def _offload(size: int, fn, *args):
    return await asyncio.to_thread(fn, *args) if size > OFFLOAD else fn(*args)
