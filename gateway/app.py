"""The gateway's ASGI app (Starlette): its routes, its Gateway, its error pages. `kaiten gateway`
(gateway/cli.py) serves it under uvicorn.

Routes: POST /v1/completions, POST /v1/chat/completions (streamed as SSE or not), GET /v1/models
(and /v1/models/{id}) (gateway/api/openai_routes.py); POST /v1/load_lora_adapter and
/v1/unload_lora_adapter (gateway/api/lora_api.py); POST /tokenize and /detokenize (vLLM's shapes;
gateway/api/tokenize_api.py); WebSocket /v1/chat/ws (its protocol: gateway/api/ws_chat.py); GET
/v1/status, GET /health and GET|POST /ping (liveness), GET /version, GET /ready (Redis reachable and
an engine alive), GET /metrics (Prometheus), GET /openapi.json (gateway/api/service_routes.py) and
/docs (gateway/api/openapi.py), and the chat page at / (gateway/static/index.html) with its files
under /static.
"""
from __future__ import annotations

import contextlib

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Mount, Route, WebSocketRoute
from starlette.staticfiles import StaticFiles

from shared.config import GatewayConfig

from .api import openapi
from .api.errors import APIError
from .api.lora_api import load_lora_adapter, unload_lora_adapter
from .api.openai_routes import chat_completions, completions, model_detail, models
from .api.service_routes import STATIC_DIR, health, index, metrics, openapi_json, ping, ready, status, version
from .api.tokenize_api import detokenize, tokenize
from .api.unhandled import CatchUnhandled
from .api.ws_chat import chat_ws
from .core import Gateway


def routes() -> list:
    return [
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/models/{model:path}", model_detail, methods=["GET"]),
        Route("/v1/load_lora_adapter", load_lora_adapter, methods=["POST"]),
        Route("/v1/unload_lora_adapter", unload_lora_adapter, methods=["POST"]),
        Route("/tokenize", tokenize, methods=["POST"]),
        Route("/detokenize", detokenize, methods=["POST"]),
        Route("/v1/status", status, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/ping", ping, methods=["GET", "POST"]),
        Route("/version", version, methods=["GET"]),
        Route("/ready", ready, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        WebSocketRoute("/v1/chat/ws", chat_ws),
        Route("/openapi.json", openapi_json, methods=["GET"]),
        Route("/docs", openapi.docs, methods=["GET"]),
        Route("/", index, methods=["GET"]),
        Mount("/static", app=StaticFiles(directory=STATIC_DIR, check_dir=False), name="static"),
    ]


async def _http_error(request: Request, exc: HTTPException) -> Response:
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
    msg = {404: f"no route {request.url.path}", 405: f"method {request.method} not allowed on {request.url.path}"}
    response = APIError(exc.status_code, msg.get(exc.status_code, str(exc.detail)), code=code).response()
    response.headers.update(exc.headers or {})
    return response


def create_app(config: GatewayConfig | None = None, *, gateway_id: str | None = None) -> Starlette:
    """The ASGI app. Each app has its own Gateway (Redis clients, router, metrics registry)."""
    config = config or GatewayConfig.from_env()
    gw = Gateway(config, gateway_id=gateway_id)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        await gw.start()
        try:
            yield
        finally:
            await gw.stop()

    app = Starlette(routes=routes(), lifespan=lifespan, middleware=[Middleware(CatchUnhandled)],
                    exception_handlers={HTTPException: _http_error})
    app.state.gw = gw
    return app
