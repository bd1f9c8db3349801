"""`kaiten gateway`: the OpenAI-compatible HTTP/WebSocket front end (Starlette + uvicorn).

    kaiten gateway [--host H] [--port P] [--model DIR] [--redis-url URL] [--tokenizer-url URL]

Routes: POST /v1/completions, POST /v1/chat/completions (streamed as SSE or not), GET /v1/models
(and /v1/models/{id}), POST /tokenize and /detokenize (vLLM's shapes; gateway/api/tokenize_api.py),
WebSocket /v1/chat/ws (see .helpers/WS_PROTOCOL.md), GET /v1/status, GET /health and GET|POST
/ping (liveness), GET /version, GET /ready (Redis reachable and an engine alive), GET /metrics
(Prometheus), GET /openapi.json and /docs (gateway/api/openapi.py), and the chat page at / (gateway/static/index.html) with its files under /static.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import signal
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import FileResponse, HTMLResponse, JSONResponse, Response
from starlette.routing import Mount, Route, WebSocketRoute
from starlette.staticfiles import StaticFiles
from starlette.websockets import WebSocket, WebSocketDisconnect

from shared.config import GatewayConfig
from shared.log_format import add_log_flags, setup_logging, uvicorn_log_config
from shared.model_source import ModelNotFoundError

from . import server_logs
from .api import openapi
from .api.errors import APIError, bad_request
from .api.http_common import authorized, check_auth, gateway_of, json_response, read_body, token_from, ws_subprotocol
from .api.json_body import parse_json
from .api.lora_api import load_lora_adapter, unload_lora_adapter
from .api.openai_api import parse_chat, parse_completion
from .api.origins import origin_allowed
from .api.response_models import ModelCard, ModelList
from .api.responses import SSEResponse, chat_response, chat_sse, collect, completion_response, completion_sse
from .api.tokenize_api import detokenize, tokenize
from .api.unhandled import CatchUnhandled
from .core import Gateway
from .api.lora_api import load_lora_adapter, unload_lora_adapter
from .metrics import CONTENT_TYPE_LATEST

log = logging.getLogger("kaiten.gateway")

STATIC_DIR = Path(__file__).resolve().parent / "static"
WS_CHAT_FIELDS = frozenset({"model", "messages", "temperature", "top_p", "top_k", "min_p", "max_tokens", "min_tokens",
                            "seed", "stop", "presence_penalty", "frequency_penalty", "repetition_penalty",
                            "logit_bias", "stop_token_ids", "ignore_eos", "skip_special_tokens",
                            "include_stop_str_in_output", "chat_template_kwargs"})
WS_MAX_ACTIVE = 16


# ---------------------------------------------------------------------- helpers
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


# ---------------------------------------------------------------------- OpenAI endpoints
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


# ---------------------------------------------------------------------- operations
async def health(request: Request) -> Response:
    return JSONResponse({"status": "ok", "gateway_id": gateway_of(request).gateway_id})


async def ping(request: Request) -> Response:
    return Response(status_code=200)


async def version(request: Request) -> Response:
    return JSONResponse({"version": kaiten_version()})


def kaiten_version() -> str:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as package_version
    try:
        return package_version("kaiten")
    except PackageNotFoundError:
        return "0.0.0+unknown"


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
        problems.append("no live engine")
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


# ---------------------------------------------------------------------- WebSocket chat
async def chat_ws(websocket: WebSocket) -> None:
    gw = gateway_of(websocket)
    offered = list(websocket.scope.get("subprotocols") or [])
    await websocket.accept(subprotocol=ws_subprotocol(offered))
    send_lock = asyncio.Lock()
    closed = False

    async def send(obj: dict) -> None:
        nonlocal closed
        if closed:
            return
        try:
            async with send_lock:
                await websocket.send_text(json.dumps(obj, ensure_ascii=False))
        except Exception:
            closed = True

    async def send_error(cid, err: APIError) -> None:
        msg = {"type": "error", "id": cid, "status": err.status, "error": err.body()["error"]}
        if err.retry_after is not None:
            msg["retry_after"] = max(1, int(round(err.retry_after)))
        await send(msg)

    if not authorized(gw, token_from(websocket.headers, websocket.query_params, offered)):
        await send_error(None, APIError(401, "Invalid or missing API key (Authorization: Bearer <key>, or the "
                                             "subprotocols kaiten.v1 and kaiten.bearer.<base64url of the key>)",
                                        code="invalid_api_key"))
        await websocket.close(code=1008)
        return
    if not gw.config.api_keys and not origin_allowed(websocket.headers.get("origin"), websocket.headers.get("host", ""),
                                                     gw.config.allowed_origins):
        await send_error(None, APIError(403, "this page's origin may not use the WebSocket (same-origin only; "
                                             "see --allowed-origins)", code="origin_not_allowed"))
        await websocket.close(code=1008)
        return

    active: dict[str, asyncio.Task] = {}

    async def run_chat(cid: str, data: dict) -> None:
        gens = parsed = None
        finished = False
        try:
            body = {k: v for k, v in data.items() if k not in ("type", "id")}
            parsed = await parse_chat(body, gw.resolve, force_stream=True, allowed=WS_CHAT_FIELDS)
            gw.admit(parsed)
            rid = f"chatcmpl-{uuid.uuid4().hex}"
            gens = await gw.submit(parsed, rid)
            g = gens[0]
            await send({"type": "start", "id": cid, "request_id": rid, "model": parsed.model})
            async for p in g.pieces():
                if p.text:
                    await send({"type": "delta", "id": cid, "content": p.text})
            finished = True
            gw.record(gens)
            await send({"type": "done", "id": cid, "finish_reason": g.finish_reason,
                        "usage": _ws_usage(g), "metrics": g.metrics_summary()})
        except APIError as e:
            if gens is None:
                gw.metrics_of(parsed).rejected(e.status)
            else:
                gw.record(gens, e)
            await send_error(cid, e)
        except asyncio.CancelledError:
            if gens is not None and not finished:
                gw.metrics_of(parsed).error("cancelled")
                g = gens[0]
                await send({"type": "done", "id": cid, "finish_reason": "cancelled", "usage": _ws_usage(g),
                            "metrics": g.metrics_summary()})
        except Exception as e:
            log.exception("websocket chat %s", cid)
            await send_error(cid, APIError(500, f"internal error: {type(e).__name__}", code="internal_error"))
        finally:
            if gens is not None:
                gw.close(gens)
            if active.get(cid) is asyncio.current_task():
                del active[cid]

    try:
        while True:
            msg = await websocket.receive()
            if msg["type"] == "websocket.disconnect":
                break
            text = msg.get("text")
            if text is None and msg.get("bytes") is not None:
                try:
                    text = msg["bytes"].decode("utf-8")
                except UnicodeDecodeError:
                    text = None
            size = len(text) if text is not None else len(msg.get("bytes") or b"")
            if size > gw.config.max_body_bytes:
                await send_error(None, APIError(413, f"message too large (limit {gw.config.max_body_bytes} bytes)",
                                                code="request_too_large"))
                continue
            try:
                data = parse_json(text, gw.config.max_json_depth, "the message") if text is not None else None
            except APIError as e:
                await send_error(None, e)
                continue
            if not isinstance(data, dict):
                await send_error(None, bad_request("each frame must be a JSON object", None, "invalid_json"))
                continue
            kind = data.get("type")
            cid = data.get("id")
            if kind == "ping":
                await send({"type": "pong"})
            elif kind == "cancel":
                task = active.get(cid) if isinstance(cid, str) else None
                if task is not None:
                    task.cancel()
            elif kind == "chat":
                if not isinstance(cid, str) or not cid:
                    await send_error(None, bad_request("'id' must be a non-empty string", "id"))
                elif cid in active:
                    await send_error(cid, bad_request(f"a generation with id {cid!r} is already running", "id",
                                                      "duplicate_id"))
                elif len(active) >= WS_MAX_ACTIVE:
                    await send_error(cid, APIError(429, f"at most {WS_MAX_ACTIVE} generations per connection",
                                                   code="too_many_generations", retry_after=1.0))
                else:
                    active[cid] = asyncio.create_task(run_chat(cid, data))
            else:
                await send_error(cid if isinstance(cid, str) else None,
                                 bad_request(f"unknown message type {kind!r}", "type", "unknown_type"))
    except WebSocketDisconnect:
        pass
    finally:
        closed = True
        tasks = list(active.values())
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)


def _ws_usage(g) -> dict[str, int]:
    return {"prompt_tokens": g.num_prompt_tokens, "completion_tokens": g.completion_tokens,
            "total_tokens": g.num_prompt_tokens + g.completion_tokens}


# ---------------------------------------------------------------------- the app
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

    routes = [
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
    app = Starlette(routes=routes, lifespan=lifespan, middleware=[Middleware(CatchUnhandled)],
                    exception_handlers={HTTPException: _http_error})
    app.state.gw = gw
    return app


# ---------------------------------------------------------------------- CLI
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kaiten gateway", description="Run one OpenAI-compatible gateway.")
    p.add_argument("--host", default=None, help="bind address (env KAITEN_HOST, default 127.0.0.1)")
    p.add_argument("--port", type=int, default=None, help="port (env KAITEN_PORT, default 8000)")
    p.add_argument("--model", action="append", default=None,
                   help="a model directory, a GGUF file or a Hugging Face repo id in the local cache: its tokenizer "
                        "and served name (env KAITEN_MODEL; default: the default SmolLM2); repeat to serve several "
                        "(--served-model-name and --chat-template apply to the first)")
    p.add_argument("--models-file", dest="models_file", default=None,
                   help="a JSON file of more models to serve, shared/models_file.py (env KAITEN_MODELS_FILE). "
                        "Models whose engines announce a directory this gateway can read are served too")
    p.add_argument("--redis-url", dest="redis_url", default=None, help="Redis URL (env REDIS_URL)")
    p.add_argument("--tokenizer-url", dest="tokenizer_url", default=None,
                   help="tokenizer service URL (env TOKENIZER_URL; empty: tokenize in-process)")
    p.add_argument("--served-model-name", dest="served_model_name", default=None,
                   help="the model's name in the API (env KAITEN_SERVED_MODEL_NAME; default: the directory's name)")
    p.add_argument("--chat-template", dest="chat_template", default=None,
                   help="a Jinja chat template file (or the template itself) instead of the tokenizer's "
                        "(env KAITEN_CHAT_TEMPLATE)")
    p.add_argument("--api-key", dest="api_keys", action="append", default=None,
                   help="require this key (Authorization: Bearer KEY); repeat for more "
                        "(env KAITEN_API_KEYS, comma-separated)")
    p.add_argument("--max-queued-requests", dest="max_queued_requests", type=int, default=None)
    p.add_argument("--max-queued-tokens", dest="max_queued_tokens", type=int, default=None)
    p.add_argument("--request-timeout", dest="request_timeout", type=float, default=None)
    p.add_argument("--engine-timeout", dest="engine_timeout", type=float, default=None)
    p.add_argument("--failover-timeout", dest="failover_timeout", type=float, default=None,
                   help="move a request whose engine is silent this long, in seconds (env KAITEN_FAILOVER_TIMEOUT, "
                        "default 2)")
    p.add_argument("--max-failovers", dest="max_failovers", type=int, default=None,
                   help="moves per request before the client gets engine_lost (env KAITEN_MAX_FAILOVERS, default 2)")
    p.add_argument("--redis-grace", dest="redis_grace", type=float, default=None,
                   help="continue in-flight requests after a Redis restart this short, in seconds "
                        "(env KAITEN_REDIS_GRACE, default 10)")
    p.add_argument("--redis-max-connections", dest="redis_max_connections", type=int, default=None,
                   help="the gateway's Redis command pool size (env KAITEN_REDIS_MAX_CONNECTIONS, default 16)")
    p.add_argument("--generation-config", dest="generation_config", default=None,
                   help="default sampling for unset request fields: auto (the model's generation_config.json), "
                        "vllm (the OpenAI defaults) or a directory (env KAITEN_GENERATION_CONFIG, default auto)")
    p.add_argument("--allowed-origins", dest="allowed_origins", default=None,
                   help="without an API key, web pages of these origins may use the WebSocket besides the "
                        "gateway's own page; comma-separated, * for any (env KAITEN_ALLOWED_ORIGINS)")
    p.add_argument("--sse-keepalive", dest="sse_keepalive", type=float, default=None,
                   help="seconds without a token before an SSE ': keep-alive' comment; 0: never, as vLLM "
                        "(env KAITEN_SSE_KEEPALIVE, default 0: clients that strip each read, such as vllm bench "
                        "serve, lose every event after a comment that arrives alone)")
    r = p.add_argument_group("routing (gateway/backend/placement.py)")
    r.add_argument("--routing", choices=("prefix", "queue"), default=None,
                   help="prefix: send each request to the engine holding most of its prompt's KV blocks, "
                        "load permitting; queue: the shared stream, any engine (env KAITEN_ROUTING, default prefix)")
    r.add_argument("--routing-cache-threshold", dest="routing_cache_threshold", type=float, default=None,
                   help="least share of the prompt an engine must hold to be chosen for it (default 0.5)")
    r.add_argument("--routing-balance-abs-threshold", dest="routing_balance_abs_threshold", type=int, default=None,
                   help="spill to the least loaded engine when the best is busier by more requests than this "
                        "(default 8) ...")
    r.add_argument("--routing-balance-rel-threshold", dest="routing_balance_rel_threshold", type=float, default=None,
                   help="... and by more than this factor (default 1.5)")
    r.add_argument("--routing-spill-timeout", dest="routing_spill_timeout", type=float, default=None,
                   help="seconds a routed request may wait for its engine before it moves to the shared "
                        "stream (default 5)")
    add_log_flags(p)
    return p


def config_from_args(args: argparse.Namespace) -> GatewayConfig:
    cfg = GatewayConfig.from_env()
    kw = {k: getattr(args, k) for k in ("host", "port", "redis_url", "tokenizer_url", "served_model_name", "models_file",
                                         "chat_template",
                                         "max_queued_requests", "max_queued_tokens", "request_timeout",
                                         "engine_timeout", "failover_timeout", "max_failovers", "redis_grace",
                                         "redis_max_connections", "generation_config", "routing",
                                         "routing_cache_threshold", "routing_balance_abs_threshold",
                                         "routing_balance_rel_threshold", "routing_spill_timeout")}
    if args.model:
        kw["model"], kw["extra_models"] = args.model[0], tuple(args.model[1:])
    kw["api_keys"] = tuple(args.api_keys) if args.api_keys else None
    kw["sse_keepalive"] = args.sse_keepalive
    kw["allowed_origins"] = tuple(o for o in args.allowed_origins.split(",") if o) if args.allowed_origins else None
    return cfg.with_overrides(**kw)


def main(argv: list[str] | None = None) -> int:
    import uvicorn
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    setup_logging(args.log_level, args.log_format)
    # httpx logs every call to the tokenizer service at INFO: keep to uvicorn's one line per request.
    logging.getLogger("httpx").setLevel(max(logging.WARNING, logging.getLogger().level))
    config = config_from_args(args)
    try:
        app = create_app(config)
    except (ModelNotFoundError, ValueError) as e:
        print(f"kaiten gateway: {e}", file=sys.stderr)
        return 2
    # uvicorn handles SIGTERM/SIGINT while it serves (graceful shutdown), then restores these
    # handlers and re-raises the signal: a no-op here, so a clean stop exits 0.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: None)
    server = uvicorn.Server(uvicorn.Config(app, host=config.host, port=config.port, log_level=args.log_level.lower(),
                                           log_config=uvicorn_log_config(args.log_format), lifespan="on",
                                           timeout_graceful_shutdown=10, ws_max_size=config.max_body_bytes))
    server_logs.install(logging.getLevelName(args.log_level))     # after uvicorn configured its loggers
    server.run()
    return 0 if server.started else 3          # 3: did not start (uvicorn.run's exit code)


if __name__ == "__main__":
    sys.exit(main())
