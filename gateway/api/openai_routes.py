"""The OpenAI routes: POST /v1/completions and /v1/chat/completions (streamed as SSE or not), GET
/v1/models and /v1/models/{id}.

A generation request goes through one flow (``_generate``): the API key, the JSON body, its
parsing (gateway/api/openai_api.py), admission and submission (gateway/core.py), then its answer:
an SSE stream, or the whole JSON once every choice is done (a client that goes away meanwhile
aborts them, status 499).
"""
from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from ..core import Gateway
from .errors import APIError
from .http_common import check_auth, gateway_of, json_response, read_body
from .openai_api import parse_chat, parse_completion
from .response_models import ModelCard, ModelList
from .responses import SSEResponse, chat_response, chat_sse, collect, completion_response, completion_sse


# ---------------------------------------------------------------------- generation
async def _wait_disconnect(request: Request) -> None:
    while True:
        msg = await request.receive()
        if msg["type"] == "http.disconnect":
            return


async def _run_unstreamed(request: Request, gw: Gateway, gens, build) -> Response:
    """Collect every choice; a client that goes away aborts them."""
    work = asyncio.create_task(collect(gens))
    watcher = asyncio.create_task(_wait_disconnect(request))
    try:
        done, _ = await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if work not in done:
            work.cancel()
            await asyncio.gather(work, return_exceptions=True)
            gens[0].state.model.metrics.error("client_disconnected")
            return Response(status_code=499)
        try:
            pieces = work.result()
        except APIError as e:
            gw.record(gens, e)
            return e.response()
        gw.record(gens)
        return Response(await build(pieces), media_type="application/json")
    finally:
        watcher.cancel()
        gw.close(gens)


async def _generate(request: Request, parse, id_prefix: str, stream, respond) -> Response:
    """The flow both generation endpoints share: auth, JSON body, `parse`, admission, submission,
    then `stream(gw, parsed, gens, rid, created)` as SSE or, unstreamed, the JSON bytes that
    `await respond(gw, parsed, gens, pieces, rid, created)` builds."""
    gw = gateway_of(request)
    parsed = None
    try:
        check_auth(request)
        body = await read_body(request, gw.config.max_body_bytes, gw.config.max_json_depth)
        parsed = await parse(body, gw.resolve)
        gw.admit(parsed)
        rid = f"{id_prefix}-{uuid.uuid4().hex}"
        gens = await gw.submit(parsed, rid)
    except APIError as e:
        gw.metrics_of(parsed).rejected(e.status)
        return e.response()
    created = int(time.time())
    if parsed.stream:
        return SSEResponse(stream(gw, parsed, gens, rid, created), lambda: gw.close(gens), gw.config.sse_keepalive)
    return await _run_unstreamed(request, gw, gens, lambda pieces: respond(gw, parsed, gens, pieces, rid, created))


async def _completion_body(gw: Gateway, parsed, gens, pieces, rid: str, created: int) -> bytes:
    texts = {}
    if parsed.echo:
        for g in gens:
            texts[g.sub.index] = (g.sub.prompt_text if g.sub.prompt_text is not None
                                  else await parsed.ctx.tokenizer.decode(g.sub.prompt_ids))
    return completion_response(gw, parsed, gens, pieces, rid, created, texts)


async def _chat_body(gw: Gateway, parsed, gens, pieces, rid: str, created: int) -> bytes:
    return chat_response(gw, parsed, gens, pieces, rid, created)


async def completions(request: Request) -> Response:
    return await _generate(request, parse_completion, "cmpl", completion_sse, _completion_body)


async def chat_completions(request: Request) -> Response:
    return await _generate(request, parse_chat, "chatcmpl", chat_sse, _chat_body)


# ---------------------------------------------------------------------- models
def _model_cards(gw: Gateway) -> list[dict[str, Any]]:
    """Every model, also while its engines load or restart (`engines` says how many are up now),
    then every adapter its engines announce (vLLM's cards: `parent` is the base model)."""
    cards = [_base_card(m) for m in gw.models.models.values()]
    for name, (model, path) in gw.models.adapters().items():
        cards.append(_adapter_card(name, model, path))
    return cards


def _base_card(m) -> dict[str, Any]:
    return {"id": m.name, "object": "model", "created": m.created, "owned_by": "kaiten", "root": m.model_dir or m.name,
            "parent": None, "max_model_len": m.max_model_len(), "engines": len(m.view.live)}


def _adapter_card(name: str, m, path: str) -> dict[str, Any]:
    engines = sum(1 for e in m.view.live if name in (e.heartbeat.get("adapters") or {}))
    return {"id": name, "object": "model", "created": m.created, "owned_by": "kaiten", "root": path,
            "parent": m.name, "max_model_len": m.max_model_len(), "engines": engines}


async def models(request: Request) -> Response:
    gw = gateway_of(request)
    try:
        check_auth(request)
    except APIError as e:
        return e.response()
    return json_response(ModelList, {"object": "list", "data": _model_cards(gw)})


async def model_detail(request: Request) -> Response:
    gw = gateway_of(request)
    try:
        check_auth(request)
        model, lora_name = gw.models.resolve(request.path_params["model"])
    except APIError as e:
        return e.response()
    if lora_name:
        return json_response(ModelCard, _adapter_card(lora_name, model, gw.models.adapters()[lora_name][1]))
    return json_response(ModelCard, _base_card(model))
