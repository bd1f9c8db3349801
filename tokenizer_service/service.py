"""The tokenizer service: a small Starlette app over ChatTokenizer.

    kaiten tokenizer [--host H] [--port P] [--model DIR]

For deployments that tokenize prompts in a separate process (gateway TOKENIZER_URL); the gateway
never calls it per generated token. No access log: at most the gateway's one line per request.

Endpoints (JSON in, JSON out; errors in the OpenAI shape {"error": {"message", "type", "param", "code"}}):

    GET  /health            {"status": "ok"}
    GET  /info              {"model", "eos_token_id", "bos_token_id", "vocab_size", "model_max_length",
                             "special_token_ids"}
    POST /tokenize          {"text"[, "add_special_tokens" (default false)]} -> {"token_ids"}
    POST /detokenize        {"token_ids"[, "skip_special_tokens" (default true)]} -> {"text"}  (whole sequence)
    POST /chat/template     {"messages"[, "add_generation_prompt" (default true), "continue_final_message",
                             "chat_template", "chat_template_kwargs", "tools"]} -> {"prompt", "token_ids"}
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from .tokenizer import ChatTemplateOptions, ChatTokenizer, validate_messages, validate_token_ids

log = logging.getLogger("kaiten.tokenizer")

MAX_BODY_BYTES = 64 * 2**20
# Work above this size runs on a worker thread so /health and small requests stay responsive.
OFFLOAD_CHARS = 8192
OFFLOAD_IDS = 8192


class BadRequest(Exception):
    def __init__(self, message: str, param: str | None = None, code: str | None = None, status: int = 400):
        super().__init__(message)
        self.message, self.param, self.code, self.status = message, param, code, status


def error_response(status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                   code: str | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": type_, "param": param, "code": code}},
                        status_code=status)


async def _json_object(request: Request) -> dict[str, Any]:
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > MAX_BODY_BYTES:
        raise BadRequest(f"request body is larger than {MAX_BODY_BYTES} bytes", code="body_too_large", status=413)
    body = b""
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_BODY_BYTES:
            raise BadRequest(f"request body is larger than {MAX_BODY_BYTES} bytes", code="body_too_large", status=413)
    try:
        data = json.loads(body)
    except ValueError as e:   # JSONDecodeError and UnicodeDecodeError
        raise BadRequest(f"the request body is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise BadRequest("the request body must be a JSON object", code="invalid_json")
    return data


_REQUIRED = object()


def _field(data: dict, name: str, types: type, type_name: str, default: Any = _REQUIRED) -> Any:
    """data[name] checked against `types` (bools are not integers); missing/null -> default or 400."""
    value = data.get(name)
    if value is None:
        if default is _REQUIRED:
            raise BadRequest(f"'{name}' is required", param=name, code="missing_field")
        return default
    if not isinstance(value, types) or (isinstance(value, bool) and types is not bool):
        raise BadRequest(f"'{name}' must be {type_name}, got {type(value).__name__}", param=name,
                         code="invalid_type")
    return value


def _ids(data: dict, name: str = "token_ids") -> list[int]:
    value = _field(data, name, list, "a list of integers")
    try:
        return validate_token_ids(value, name)
    except ValueError as e:
        raise BadRequest(str(e), param=name, code="invalid_type") from None


def create_app(tokenizer: ChatTokenizer, model_name: str | None = None) -> Starlette:
    """The service's ASGI app around an already-loaded tokenizer."""
    tok = tokenizer
    name = model_name or (Path(tok.model_dir).name if tok.model_dir else "model")

    async def health(request: Request) -> JSONResponse:
        return JSONResponse({"status": "ok"})

    async def info(request: Request) -> JSONResponse:
        return JSONResponse({
            "model": name, "eos_token_id": tok.eos_token_id, "bos_token_id": tok.bos_token_id,
            "vocab_size": tok.vocab_size, "model_max_length": tok.model_max_length,
            "special_token_ids": sorted(tok._skip_ids),
        })

    async def tokenize(request: Request) -> JSONResponse:
        data = await _json_object(request)
        text = _field(data, "text", str, "a string")
        specials = _field(data, "add_special_tokens", bool, "a boolean", default=False)
        if len(text) > OFFLOAD_CHARS:
            ids = await run_in_threadpool(tok.encode, text, specials)
        else:
            ids = tok.encode(text, specials)
        return JSONResponse({"token_ids": ids})

    async def detokenize(request: Request) -> JSONResponse:
        data = await _json_object(request)
        ids = _ids(data)
        skip = _field(data, "skip_special_tokens", bool, "a boolean", default=True)
        text = await run_in_threadpool(tok.decode, ids, skip) if len(ids) > OFFLOAD_IDS else tok.decode(ids, skip)
        return JSONResponse({"text": text})

    async def chat_template(request: Request) -> JSONResponse:
        data = await _json_object(request)
        if "messages" not in data:
            raise BadRequest("'messages' is required", param="messages", code="missing_field")
        agp = _field(data, "add_generation_prompt", bool, "a boolean", default=True)
        options = ChatTemplateOptions(_field(data, "continue_final_message", bool, "a boolean", default=False),
                                      _field(data, "chat_template", str, "a string", default=None),
                                      _field(data, "chat_template_kwargs", dict, "an object", default={}),
                                      _field(data, "tools", list, "a list of tool objects", default=None))
        try:
            msgs = validate_messages(data["messages"])
        except ValueError as e:
            raise BadRequest(str(e), param="messages") from None
        try:
            if sum(len(m["content"]) for m in msgs) > OFFLOAD_CHARS or options.tools:
                prompt, ids = await run_in_threadpool(tok.chat_prompt, msgs, agp, options)
            else:
                prompt, ids = tok.chat_prompt(msgs, agp, options)
        except ValueError as e:
            raise BadRequest(str(e), param="messages") from None
        return JSONResponse({"prompt": prompt, "token_ids": ids})

    async def on_bad_request(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, BadRequest)
        return error_response(exc.status, exc.message, param=exc.param, code=exc.code)

    async def on_value_error(request: Request, exc: Exception) -> JSONResponse:
        return error_response(400, str(exc))

    async def on_http_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, HTTPException)
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return error_response(exc.status_code, str(exc.detail), type_=kind)

    async def on_error(request: Request, exc: Exception) -> JSONResponse:
        return error_response(500, f"internal error: {type(exc).__name__}", type_="server_error")

    routes = [
        Route("/health", health, methods=["GET"]),
        Route("/info", info, methods=["GET"]),
        Route("/tokenize", tokenize, methods=["POST"]),
        Route("/detokenize", detokenize, methods=["POST"]),
        Route("/chat/template", chat_template, methods=["POST"]),
    ]
    return Starlette(routes=routes, exception_handlers={
        BadRequest: on_bad_request, ValueError: on_value_error, HTTPException: on_http_error, Exception: on_error,
    })


def load_app(model_dir: str = "") -> Starlette:
    """Load the tokenizer of the model `model_dir` names (shared.model_source; "": the default
    model) and build the app."""
    from shared.model_source import resolve_model
    return create_app(ChatTokenizer.from_pretrained(str(resolve_model(model_dir))))


def main(argv: list[str] | None = None) -> int:
    from shared.config import TokenizerServiceConfig
    from shared.log_format import add_log_flags, setup_logging, uvicorn_log_config

    p = argparse.ArgumentParser(prog="kaiten tokenizer", description="Run the tokenizer service.")
    p.add_argument("--host", default=None, help="bind address (env KAITEN_HOST; default 127.0.0.1)")
    p.add_argument("--port", type=int, default=None, help="port (env KAITEN_PORT; default 8001)")
    p.add_argument("--model", default=None, help="a model directory, a GGUF file or a Hugging Face repo id in "
                   "the local cache (env KAITEN_MODEL; default: the default SmolLM2)")
    add_log_flags(p)
    args = p.parse_args(argv)
    cfg = TokenizerServiceConfig.from_env().with_overrides(host=args.host, port=args.port, model=args.model)
    setup_logging(args.log_level, args.log_format)

    import uvicorn

    from shared.model_source import MODEL_ERRORS
    try:
        app = load_app(cfg.model)
    except MODEL_ERRORS as e:
        print(f"kaiten tokenizer: {e}", file=sys.stderr)
        return 2
    log.info("tokenizer service on http://%s:%d", cfg.host, cfg.port)
    uvicorn.run(app, host=cfg.host, port=cfg.port, log_level=args.log_level.lower(), access_log=False,
                log_config=uvicorn_log_config(args.log_format))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
