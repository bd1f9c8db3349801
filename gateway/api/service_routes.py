"""The routes around the API: GET /health and GET|POST /ping (liveness), GET /ready (Redis reachable
and an engine alive), GET /version, GET /v1/status (behind the API key), GET /metrics (Prometheus),
GET /openapi.json (gateway/api/openapi.py) and the chat page at / (gateway/static/index.html)."""
from __future__ import annotations

import asyncio
from pathlib import Path

from starlette.requests import Request
from starlette.responses import FileResponse, HTMLResponse, JSONResponse, Response

from shared.version import kaiten_version

from ..metrics import CONTENT_TYPE_LATEST
from . import openapi
from .errors import APIError
from .http_common import check_auth, gateway_of

STATIC_DIR = Path(__file__).resolve().parent.parent / "static"


async def health(request: Request) -> Response:
    return JSONResponse({"status": "ok", "gateway_id": gateway_of(request).gateway_id})


async def ping(request: Request) -> Response:
    return Response(status_code=200)


async def version(request: Request) -> Response:
    return JSONResponse({"version": kaiten_version()})


async def ready(request: Request) -> Response:
    gw = gateway_of(request)
    problems = []
    try:
        await asyncio.wait_for(gw.redis.ping(), 2.0)
    except Exception as e:
        problems.append(f"redis unreachable: {type(e).__name__}")
    if not gw.router.subscribed.is_set():
        problems.append("reply channel not subscribed")
    # An engine counts while its heartbeat changed within failover_timeout (1.5 s): the silence after
    # which its requests move elsewhere, so a killed engine leaves /ready within about 2 s.
    engines = len(gw.monitor.live_engines(timeout=gw.config.failover_timeout))
    if engines == 0:
        starting = [s.describe() for s in gw.monitor.starting if s.starting]
        problems.append(f"no live engine; {len(starting)} starting ({'; '.join(starting)})" if starting
                        else "no live engine")
    body = {"status": "ready" if not problems else "not ready", "engines": engines, "problems": problems}
    return JSONResponse(body, status_code=200 if not problems else 503)


async def status(request: Request) -> Response:
    try:
        check_auth(request)
    except APIError as e:
        return e.response()
    return JSONResponse(gateway_of(request).status())


async def metrics(request: Request) -> Response:
    return Response(gateway_of(request).metrics.render(), media_type=CONTENT_TYPE_LATEST)


async def openapi_json(request: Request) -> Response:
    return JSONResponse(openapi.spec(kaiten_version()))


async def index(request: Request) -> Response:
    page = STATIC_DIR / "index.html"
    if page.is_file():
        return FileResponse(page, media_type="text/html")
    return HTMLResponse("<!doctype html><title>Kaiten</title><p>Kaiten gateway. The chat page is not installed "
                        "(gateway/static/index.html). The API is at <code>/v1</code>.</p>")
