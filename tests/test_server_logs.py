"""The gateway's logs as an operator reads them: a real `kaiten gateway` process at INFO, a real
Redis and the scripted fake engine; and the one traceback a 500 logs."""
from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import websockets
from starlette.routing import Route

from gateway.app import create_app
from gateway.server_logs import redact_query
from shared.config import GatewayConfig
from tests.engine_support import wait_until
from tests.redis_server import free_port
from tests.test_gateway_support import FakeEngine, ServerThread

pytestmark = pytest.mark.timeout(120)
ROOT = Path(__file__).resolve().parent.parent
KEY = "s3cret-key-123"


def test_redact_query():
    assert redact_query("/v1/chat/ws?api_key=abc&x=1") == "/v1/chat/ws?api_key=[redacted]&x=1"
    assert redact_query("/a?token=t&key=k&Api_Key=z") == "/a?token=[redacted]&key=[redacted]&Api_Key=[redacted]"
    assert redact_query("/v1/models") == "/v1/models" and redact_query("/a?flag") == "/a?flag"


async def _ws_ping(url: str) -> dict:
    async with websockets.connect(url) as ws:
        await ws.send(json.dumps({"type": "ping"}))
        return json.loads(await ws.recv())


def test_access_log_has_no_probe_lines_and_no_key(redis_url, tiny_model_dir):
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    env = dict(os.environ, PYTHONPATH=str(ROOT), KAITEN_API_KEYS=KEY, KAITEN_ENGINE_TIMEOUT="3")
    proc = subprocess.Popen([sys.executable, "-m", "shared.cli", "gateway", "--port", str(port), "--model",
                             str(tiny_model_dir), "--redis-url", redis_url, "--log-level", "INFO"],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    eng = None
    try:
        def answers():
            assert proc.poll() is None
            try:
                return httpx.get(base + "/health", timeout=1, trust_env=False).status_code == 200
            except httpx.HTTPError:
                return False
        wait_until(answers, 60, 0.2)
        assert httpx.get(base + "/ready", trust_env=False).status_code == 503     # no engine yet
        eng = FakeEngine(redis_url, model=tiny_model_dir.name).start()
        wait_until(lambda: httpx.get(base + "/ready", trust_env=False).status_code == 200, 30, 0.2)
        r = httpx.post(base + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, trust_env=False,
                       headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
        assert r.status_code == 200, r.text
        assert asyncio.run(_ws_ping(f"ws://127.0.0.1:{port}/v1/chat/ws?api_key={KEY}")) == {"type": "pong"}
    finally:
        proc.send_signal(signal.SIGTERM)
        out = proc.communicate(timeout=30)[0].decode(errors="replace")
        if eng is not None:
            eng.stop()
    assert KEY not in out, out
    assert "/v1/chat/ws?api_key=[redacted]" in out, out
    assert '"POST /v1/completions HTTP/1.1" 200' in out, out
    assert "/ready" not in out and "/health" not in out, out


def test_a_500_logs_one_traceback(redis_url, tiny_model_dir):
    async def boom(request):
        raise RuntimeError("a bug")

    app = create_app(GatewayConfig(redis_url=redis_url, model=str(tiny_model_dir)))
    app.router.routes.insert(0, Route("/boom", boom))
    seen: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = seen.append
    loggers = [logging.getLogger(n) for n in ("uvicorn.error", "uvicorn", "kaiten.gateway", "")]
    for lg in loggers:
        lg.addHandler(handler)
    try:
        with ServerThread(app) as srv:
            r = httpx.get(srv.url + "/boom?api_key=zzz", trust_env=False)
    finally:
        for lg in loggers:
            lg.removeHandler(handler)
    assert r.status_code == 500
    assert r.json()["error"]["code"] == "internal_error" and "RuntimeError" in r.json()["error"]["message"]
    tracebacks = {id(rec): rec for rec in seen if rec.exc_info}.values()
    assert len(tracebacks) == 1, [rec.getMessage() for rec in tracebacks]
    (rec,) = tracebacks
    assert "/boom?api_key=[redacted]" in rec.getMessage()
