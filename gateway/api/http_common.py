"""What every HTTP route of the gateway shares: the Gateway of the app, API-key auth, the JSON body
in and out.

A key comes as ``Authorization: Bearer KEY``. A browser cannot set that header on a WebSocket, so the
WebSocket also takes it as the subprotocol ``kaiten.bearer.<base64url of the key's UTF-8, unpadded>``
offered beside ``kaiten.v1``; the server selects ``kaiten.v1`` and never echoes the key. Base64url
makes every key a legal subprotocol token (a raw key may hold ``=``, ``/`` or spaces, which a
browser refuses). ``?api_key=KEY`` on the WebSocket URL still works, for older clients; the logs
redact it (gateway/server_logs.py).
"""
from __future__ import annotations

import base64
import binascii
import hmac
from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.websockets import WebSocket

from ..core import Gateway
from .errors import APIError, bad_request
from .json_body import check_json, parse_json
from .response_models import Reply, encode


def gateway_of(request: Request | WebSocket) -> Gateway:
    return request.app.state.gw


WS_SUBPROTOCOL = "kaiten.v1"
BEARER_SUBPROTOCOL = "kaiten.bearer."


def ws_subprotocol(offered: list[str]) -> str | None:
    """The subprotocol the server answers with: ``kaiten.v1`` when offered (a browser that offered
    subprotocols fails a handshake answered with none), else none."""
    return WS_SUBPROTOCOL if WS_SUBPROTOCOL in offered else None


def bearer_subprotocol(key: str) -> str:
    """The subprotocol that carries `key` (what the chat page offers)."""
    return BEARER_SUBPROTOCOL + base64.urlsafe_b64encode(key.encode()).decode().rstrip("=")


def _key_of_subprotocols(offered: list[str]) -> str:
    for proto in offered:
        if proto.startswith(BEARER_SUBPROTOCOL):
            b64 = proto[len(BEARER_SUBPROTOCOL):]
            try:
                return base64.urlsafe_b64decode(b64 + "=" * (-len(b64) % 4)).decode()
            except (binascii.Error, ValueError):      # not base64url, or not UTF-8: no key
                return ""
    return ""


def token_from(headers, query=None, subprotocols: list[str] | None = None) -> str:
    """The key a client sent: the Authorization header, else (WebSocket) the bearer subprotocol, else
    (WebSocket) ``?api_key=``."""
    auth = headers.get("authorization", "")
    if auth[:7].lower() == "bearer ":
        return auth[7:].strip()
    token = _key_of_subprotocols(subprotocols or [])
    if not token and query is not None:
        token = query.get("api_key", "")
    return token


def authorized(gw: Gateway, token: str) -> bool:
    keys = gw.config.api_keys
    if not keys:
        return True
    ok = False
    given = token.encode()
    for key in keys:                      # compare with every key: no early exit on a match
        ok |= hmac.compare_digest(given, key.encode())
    return ok and bool(token)


def check_auth(request: Request) -> None:
    if not authorized(gateway_of(request), token_from(request.headers)):
        raise APIError(401, "Invalid or missing API key (Authorization: Bearer <key>)", code="invalid_api_key")


async def read_json(request: Request, limit: int, max_depth: int) -> Any:
    """The body as JSON: at most `limit` bytes and `max_depth` levels of nesting, else a 413/400."""
    return parse_json(await _read(request, limit), max_depth)


async def read_body(request: Request, limit: int, max_depth: int) -> bytes:
    """The body's bytes for validation (gateway/api/api_models.py), with read_json's limits."""
    return check_json(await _read(request, limit), max_depth)


async def _read(request: Request, limit: int) -> bytes:
    """The body's bytes: at most `limit` (else a 413), not empty (else a 400)."""
    cl = request.headers.get("content-length")
    if cl is not None:
        try:
            if int(cl) > limit:
                raise APIError(413, f"request body too large (limit {limit} bytes)", code="request_too_large")
        except ValueError:
            raise bad_request("invalid Content-Length header", None, "invalid_header") from None
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise APIError(413, f"request body too large (limit {limit} bytes)", code="request_too_large")
        chunks.append(chunk)
    raw = b"".join(chunks)
    if not raw.strip():
        raise bad_request("the request body is empty; send a JSON object", None, "invalid_json")
    return raw


def json_response(model: type[Reply], body: dict) -> Response:
    """A 200 whose body is `body` written through `model` (gateway/api/response_models.py)."""
    return Response(encode(model, body), media_type="application/json")
