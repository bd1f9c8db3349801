"""The WebSocket chat API at /v1/chat/ws (the chat page's transport, gateway/static/app.js).

Connecting
    The API key, where the gateway has one, comes as ``Authorization: Bearer KEY``, or (browsers
    cannot set headers on a WebSocket) as the subprotocols ``kaiten.v1`` and
    ``kaiten.bearer.<base64url of the key, unpadded>``, or as ``?api_key=KEY``. The server
    answers with the subprotocol ``kaiten.v1`` when it was offered. A wrong or missing key: an
    ``error`` frame with status 401 (code ``invalid_api_key``), then close code 1008. Without API
    keys, only the gateway's own page may connect, and the pages of ``--allowed-origins``:
    another Origin gets a 403 ``error`` frame (code ``origin_not_allowed``), then close 1008.

Frames are JSON objects, one per WebSocket message (text, or bytes holding UTF-8 text), at most
``--max-body-bytes`` and ``--max-json-depth`` deep. Several generations may run at once on one
socket (at most ``MAX_ACTIVE``); each is named by an ``id`` the client chooses.

Client to server
    {"type": "chat", "id": ID, "model": ..., "messages": [...], <sampling fields>}
        Start a generation: the body of /v1/chat/completions, always streamed, with the fields
        in ``CHAT_FIELDS`` (others are ignored with one warning in the log).
    {"type": "cancel", "id": ID}
        Stop that generation (an unknown id is ignored): it ends with a ``done`` frame whose
        finish_reason is "cancelled".
    {"type": "ping"}
        Answered with {"type": "pong"}.

Server to client, for a generation ID
    {"type": "start", "id": ID, "request_id": "chatcmpl-...", "model": NAME}
    {"type": "delta", "id": ID, "content": TEXT}                 (non-empty text, in order)
    {"type": "done", "id": ID, "finish_reason": "stop" | "length" | "cancelled" | ...,
     "usage": {"prompt_tokens", "completion_tokens", "total_tokens"},
     "metrics": {"ttft_s", "tokens_per_second", "e2e_s"}}
    {"type": "error", "id": ID, "status": HTTP STATUS, "error": {OpenAI's error object},
     "retry_after": SECONDS (where retrying later may work)}
A generation gets ``start`` then ``delta`` frames then one ``done``, or one ``error`` at any
point (a request refused, as the HTTP API would refuse it, before ``start``). An ``error`` frame
whose id is null belongs to no generation: a frame too large (413), not JSON or not an object
(400), a ``chat`` without a string id, or an unknown ``type``. A ``chat`` whose id is running
already, or one past MAX_ACTIVE (429, retry_after 1), gets an ``error`` with its id.

Closing the socket cancels its generations.
"""
from __future__ import annotations

import asyncio
import json
import logging
import uuid

from starlette.websockets import WebSocket, WebSocketDisconnect

from ..core import Gateway
from .errors import APIError, bad_request
from .http_common import authorized, gateway_of, token_from, ws_subprotocol
from .json_body import parse_json
from .openai_api import parse_chat
from .origins import origin_allowed

log = logging.getLogger("kaiten.gateway")

CHAT_FIELDS = frozenset({"model", "messages", "temperature", "top_p", "top_k", "min_p", "max_tokens", "min_tokens",
                         "seed", "stop", "presence_penalty", "frequency_penalty", "repetition_penalty",
                         "logit_bias", "stop_token_ids", "ignore_eos", "skip_special_tokens",
                         "include_stop_str_in_output", "chat_template_kwargs"})
MAX_ACTIVE = 16            # generations running at once on one socket


async def chat_ws(websocket: WebSocket) -> None:
    """The /v1/chat/ws endpoint: one ChatSocket per connection."""
    await ChatSocket(websocket, gateway_of(websocket)).serve()


class ChatSocket:
    """One client connection: its frames in, its generations' frames out (the module docstring)."""

    def __init__(self, websocket: WebSocket, gw: Gateway):
        self.ws = websocket
        self.gw = gw
        self.send_lock = asyncio.Lock()
        self.closed = False
        self.active: dict[str, asyncio.Task] = {}

    async def serve(self) -> None:
        offered = list(self.ws.scope.get("subprotocols") or [])
        await self.ws.accept(subprotocol=ws_subprotocol(offered))
        refusal = self._refusal(offered)
        if refusal is not None:
            await self.send_error(None, refusal)
            await self.ws.close(code=1008)
            return
        try:
            while True:
                msg = await self.ws.receive()
                if msg["type"] == "websocket.disconnect":
                    break
                await self._on_message(msg)
        except WebSocketDisconnect:
            pass
        finally:
            self.closed = True
            tasks = list(self.active.values())
            for t in tasks:
                t.cancel()
            if tasks:
                await asyncio.gather(*tasks, return_exceptions=True)

    def _refusal(self, offered: list[str]) -> APIError | None:
        """Why this connection may not chat (a bad key, another page's origin), or None."""
        headers, config = self.ws.headers, self.gw.config
        if not authorized(self.gw, token_from(headers, self.ws.query_params, offered)):
            return APIError(401, "Invalid or missing API key (Authorization: Bearer <key>, or the subprotocols "
                                 "kaiten.v1 and kaiten.bearer.<base64url of the key>)", code="invalid_api_key")
        if not config.api_keys and not origin_allowed(headers.get("origin"), headers.get("host", ""),
                                                      config.allowed_origins):
            return APIError(403, "this page's origin may not use the WebSocket (same-origin only; "
                                 "see --allowed-origins)", code="origin_not_allowed")
        return None

    # ------------------------------------------------------------------ frames out
    async def send(self, obj: dict) -> None:
        if self.closed:
            return
        try:
            async with self.send_lock:
                await self.ws.send_text(json.dumps(obj, ensure_ascii=False))
        except Exception:
            self.closed = True

    async def send_error(self, cid: str | None, err: APIError) -> None:
        msg = {"type": "error", "id": cid, "status": err.status, "error": err.body()["error"]}
        if err.retry_after is not None:
            msg["retry_after"] = max(1, int(round(err.retry_after)))
        await self.send(msg)

    # ------------------------------------------------------------------ frames in
    async def _on_message(self, msg: dict) -> None:
        limit = self.gw.config.max_body_bytes
        text = msg.get("text")
        if text is None and msg.get("bytes") is not None:
            try:
                text = msg["bytes"].decode("utf-8")
            except UnicodeDecodeError:
                text = None
        size = len(text) if text is not None else len(msg.get("bytes") or b"")
        if size > limit:
            await self.send_error(None, APIError(413, f"message too large (limit {limit} bytes)",
                                                 code="request_too_large"))
            return
        try:
            data = parse_json(text, self.gw.config.max_json_depth, "the message") if text is not None else None
        except APIError as e:
            await self.send_error(None, e)
            return
        if not isinstance(data, dict):
            await self.send_error(None, bad_request("each frame must be a JSON object", None, "invalid_json"))
            return
        kind, cid = data.get("type"), data.get("id")
        if kind == "ping":
            await self.send({"type": "pong"})
        elif kind == "cancel":
            task = self.active.get(cid) if isinstance(cid, str) else None
            if task is not None:
                task.cancel()
        elif kind == "chat":
            await self._start(cid, data)
        else:
            await self.send_error(cid if isinstance(cid, str) else None,
                                  bad_request(f"unknown message type {kind!r}", "type", "unknown_type"))

    async def _start(self, cid, data: dict) -> None:
        if not isinstance(cid, str) or not cid:
            await self.send_error(None, bad_request("'id' must be a non-empty string", "id"))
        elif cid in self.active:
            await self.send_error(cid, bad_request(f"a generation with id {cid!r} is already running", "id",
                                                   "duplicate_id"))
        elif len(self.active) >= MAX_ACTIVE:
            await self.send_error(cid, APIError(429, f"at most {MAX_ACTIVE} generations per connection",
                                                code="too_many_generations", retry_after=1.0))
        else:
            self.active[cid] = asyncio.create_task(self._chat(cid, data))

    # ------------------------------------------------------------------ one generation
    async def _chat(self, cid: str, data: dict) -> None:
        gw = self.gw
        gens = parsed = None
        finished = False
        try:
            body = {k: v for k, v in data.items() if k not in ("type", "id")}
            parsed = await parse_chat(body, gw.resolve, force_stream=True, allowed=CHAT_FIELDS)
            gw.admit(parsed)
            rid = f"chatcmpl-{uuid.uuid4().hex}"
            gens = await gw.submit(parsed, rid)
            g = gens[0]
            await self.send({"type": "start", "id": cid, "request_id": rid, "model": parsed.model})
            async for p in g.pieces():
                if p.text:
                    await self.send({"type": "delta", "id": cid, "content": p.text})
            finished = True
            gw.record(gens)
            await self.send({"type": "done", "id": cid, "finish_reason": g.finish_reason,
                             "usage": _usage(g), "metrics": g.metrics_summary()})
        except APIError as e:
            if gens is None:
                gw.metrics_of(parsed).rejected(e.status)
            else:
                gw.record(gens, e)
            await self.send_error(cid, e)
        except asyncio.CancelledError:
            if gens is not None and not finished:
                gw.metrics_of(parsed).error("cancelled")
                g = gens[0]
                await self.send({"type": "done", "id": cid, "finish_reason": "cancelled", "usage": _usage(g),
                                 "metrics": g.metrics_summary()})
        except Exception as e:
            log.exception("websocket chat %s", cid)
            await self.send_error(cid, APIError(500, f"internal error: {type(e).__name__}", code="internal_error"))
        finally:
            if gens is not None:
                gw.close(gens)
            if self.active.get(cid) is asyncio.current_task():
                del self.active[cid]


def _usage(g) -> dict[str, int]:
    return {"prompt_tokens": g.num_prompt_tokens, "completion_tokens": g.completion_tokens,
            "total_tokens": g.num_prompt_tokens + g.completion_tokens}
