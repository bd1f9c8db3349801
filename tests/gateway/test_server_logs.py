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

import httpx
import pytest
import websockets
from starlette.routing import Route

from gateway.app import create_app
from gateway.api.http_common import WS_SUBPROTOCOL, bearer_subprotocol
from gateway.server_logs import RedactSecrets, redact_query, redact_text
from shared.config import GatewayConfig
from tests.support.engine_support import wait_until
from tests.support.gateway_support import FakeEngine, ServerThread
from tests.support.paths import ROOT
from tests.support.redis_server import free_port

pytestmark = pytest.mark.timeout(120)
KEY = "s3cret-key-123"


def test_redact_query():
    assert redact_query("/v1/chat/ws?api_key=abc&x=1") == "/v1/chat/ws?api_key=[redacted]&x=1"
    assert redact_query("/a?token=t&key=k&Api_Key=z") == "/a?token=[redacted]&key=[redacted]&Api_Key=[redacted]"
    assert redact_query("/v1/models") == "/v1/models" and redact_query("/a?flag") == "/a?flag"
    assert redact_query("/a?api%5Fkey=z&b=2") == "/a?api%5Fkey=[redacted]&b=2"


def test_redact_text_and_header_values():
    proto = bearer_subprotocol("s3cret")
    assert redact_text(f"kaiten.v1, {proto}") == "kaiten.v1, kaiten.bearer.[redacted]"
    assert redact_text("Bearer s3cret") == "Bearer [redacted]"
    assert redact_text("< GET /v1/chat/ws?x=1&api_key=s3cret HTTP/1.1") == "< GET /v1/chat/ws?x=1&api_key=[redacted] HTTP/1.1"
    rec = logging.LogRecord("uvicorn.error", logging.DEBUG, __file__, 1, "< %s: %s", ("Authorization", "s3cret"), None)
    RedactSecrets().filter(rec)
    assert rec.getMessage() == "< Authorization: [redacted]"
    rec = logging.LogRecord("uvicorn.error", logging.DEBUG, __file__, 1, f"offered {proto}", None, None)
    RedactSecrets().filter(rec)
    assert rec.getMessage() == "offered kaiten.bearer.[redacted]"


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


@pytest.mark.parametrize("fmt", ["text", "json"])
def test_no_key_in_debug_logs_however_it_was_sent(redis_url, tiny_model_dir, fmt):
    """At DEBUG uvicorn logs every WebSocket handshake header: the key as a subprotocol, in an
    Authorization header or in the URL, right or wrong, never reaches the log, as text or as JSON."""
    wrong = "wr0ng-secret-456"
    secrets = [KEY, wrong] + [bearer_subprotocol(k).rsplit(".", 1)[1] for k in (KEY, wrong)]
    port = free_port()
    env = dict(os.environ, PYTHONPATH=str(ROOT), KAITEN_API_KEYS=KEY)
    proc = subprocess.Popen([sys.executable, "-m", "shared.cli", "gateway", "--port", str(port), "--model",
                             str(tiny_model_dir), "--redis-url", redis_url, "--log-level", "DEBUG",
                             "--log-format", fmt], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    ws = f"ws://127.0.0.1:{port}/v1/chat/ws"
    try:
        wait_until(lambda: _answers(proc, f"http://127.0.0.1:{port}/health"), 60, 0.2)
        with FakeEngine(redis_url, model=tiny_model_dir.name):
            wait_until(lambda: _answers(proc, f"http://127.0.0.1:{port}/ready"), 30, 0.2)
            for key in (KEY, wrong):
                expected = ("pong",) if key == KEY else ("error", None)      # None: closed before the ping
                for url, kw in ((ws, {"subprotocols": [WS_SUBPROTOCOL, bearer_subprotocol(key)]}),
                                (ws, {"additional_headers": {"Authorization": f"Bearer {key}"}}),
                                (f"{ws}?api_key={key}", {})):
                    assert asyncio.run(_ws_first(url, **kw)).get("type") in expected
            r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json={"prompt": "hi", "max_tokens": 2},
                           headers={"Authorization": f"Bearer {KEY}"}, trust_env=False, timeout=30)
            assert r.status_code == 200, r.text
    finally:
        proc.send_signal(signal.SIGTERM)
        out = proc.communicate(timeout=30)[0].decode(errors="replace")
    for secret in secrets:
        assert secret not in out, (secret, out)
    assert "kaiten.bearer.[redacted]" in out and "authorization: [redacted]" in out, out   # the header lines
    assert "/v1/chat/ws?api_key=[redacted]" in out, out
    if fmt == "json":
        records = [json.loads(line) for line in out.splitlines() if line.strip()]
        assert all({"time", "level", "logger", "message"} <= set(r) for r in records)
        (post,) = [r for r in records if r["logger"] == "uvicorn.access" and r.get("path") == "/v1/completions"]
        assert post["method"] == "POST" and post["status"] == 200 and post["level"] == "INFO"


def _answers(proc, url: str) -> bool:
    assert proc.poll() is None
    try:
        return httpx.get(url, timeout=1, trust_env=False).status_code == 200
    except httpx.HTTPError:
        return False


async def _ws_first(url: str, **kw) -> dict:
    """Connect and return the first frame: the 401 error of a refused key, else the pong to a ping."""
    frames = []
    try:
        async with websockets.connect(url, **kw) as ws:
            await ws.send(json.dumps({"type": "ping"}))
            frames.append(json.loads(await ws.recv()))
    except websockets.ConnectionClosed:      # refused: the error frame, then 1008
        pass
    return frames[0] if frames else {}
