"""The last resort for a bug: an exception no handler took is logged once, with its traceback, and
answered with a 500 in the OpenAI error shape. (Starlette's own handler re-raises after answering,
so uvicorn logged the same traceback a second time.)"""
from __future__ import annotations

import logging

from ..server_logs import redact_query
from .errors import APIError

log = logging.getLogger("kaiten.gateway")


class CatchUnhandled:
    """ASGI middleware for HTTP requests; it sits inside Starlette's ServerErrorMiddleware."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def watch_start(message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, watch_start)
        except Exception as exc:
            target = scope.get("path", "") + ("?" + scope["query_string"].decode("latin-1")
                                               if scope.get("query_string") else "")
            log.exception("unhandled error on %s %s", scope.get("method"), redact_query(target))
            if not started:      # else the client sees the connection end mid-response
                response = APIError(500, f"internal error: {type(exc).__name__}", code="internal_error").response()
                await response(scope, receive, send)
