"""What every HTTP route of the gateway shares: the Gateway of the app, API-key auth, the JSON body."""
from __future__ import annotations

import hmac
from typing import Any

from starlette.requests import Request
from starlette.websockets import WebSocket

from .core import Gateway
from .errors import APIError, bad_request
from .json_body import parse_json


def gateway_of(request: Request | WebSocket) -> Gateway:
    return request.app.state.gw


def token_from(headers, query=None) -> str:
    auth = headers.get("authorization", "")
    if auth[:7].lower() == "bearer ":
        return auth[7:].strip()
    if query is not None:
        return query.get("api_key", "")
    return ""


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
    return parse_json(raw, max_depth)
