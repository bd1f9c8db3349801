"""`kaiten gateway`: run one gateway (gateway/app.py's app) under uvicorn.

    kaiten gateway [--host H] [--port P] [--model DIR] [--redis-url URL] [--tokenizer-url URL] ...

A flag not given keeps its variable's value (GatewayConfig.from_env).
"""
from __future__ import annotations

import argparse
import logging
import signal
import sys

from shared.config import GatewayConfig
from shared.log_format import add_log_flags, setup_logging, uvicorn_log_config
from shared.model_source import ModelNotFoundError

from . import server_logs
from .app import create_app


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
