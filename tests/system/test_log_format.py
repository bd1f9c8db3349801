"""--log-format json / KAITEN_LOG_FORMAT=json: one JSON object per line from every process kind (the
formatter; `kaiten tokenizer`; `kaiten up` with its engine and gateway children). The gateway's JSON
lines keep its redaction: tests/gateway/test_server_logs.py."""
from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
import urllib.request

import httpx
import pytest

from shared.log_format import JSONFormatter
from tests.support.engine_support import wait_until
from tests.support.paths import ROOT
from tests.support.redis_server import free_port

pytestmark = pytest.mark.timeout(180)
FIELDS = {"time", "level", "logger", "message"}


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT), **extra)
    env.pop("REDIS_URL", None)
    return env


def _records(text: str) -> list[dict]:
    """Every line of `text` as a JSON object (fails on the first line that is not one)."""
    out = []
    for line in text.splitlines():
        if line.strip():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                raise AssertionError(f"not a JSON line: {line!r}\n{text}") from None
            assert FIELDS <= set(rec), rec
            out.append(rec)
    return out


def test_a_record_with_a_traceback_is_one_json_line():
    try:
        raise ValueError("bad\nthing")
    except ValueError:
        rec = logging.LogRecord("kaiten.x", logging.ERROR, __file__, 1, "failed %s", ("here",), sys.exc_info())
    line = JSONFormatter().format(rec)
    assert "\n" not in line
    out = json.loads(line)
    assert (out["level"], out["logger"], out["message"]) == ("ERROR", "kaiten.x", "failed here")
    assert out["exception"].startswith("Traceback") and "ValueError: bad\nthing" in out["exception"]
    assert out["time"].endswith("+00:00") and "T" in out["time"]


def test_uvicorn_access_lines_carry_their_fields():
    rec = logging.LogRecord("uvicorn.access", logging.INFO, __file__, 1, '%s - "%s %s HTTP/%s" %d',
                            ("127.0.0.1:5", "GET", "/v1/models", "1.1", 200), None)
    out = json.loads(JSONFormatter().format(rec))
    assert out["message"] == '127.0.0.1:5 - "GET /v1/models HTTP/1.1" 200'
    assert (out["client"], out["method"], out["path"], out["status"]) == ("127.0.0.1:5", "GET", "/v1/models", 200)


def test_tokenizer_service_logs_json_from_the_environment(tiny_model_dir):
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "shared.cli", "tokenizer", "--port", str(port), "--model",
                             str(tiny_model_dir)], cwd=ROOT, env=_env(KAITEN_LOG_FORMAT="json"),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        def up() -> bool:
            assert proc.poll() is None
            try:
                return httpx.get(f"http://127.0.0.1:{port}/health", timeout=1, trust_env=False).status_code == 200
            except httpx.HTTPError:
                return False
        wait_until(up, 120, 0.2, "the tokenizer service")
    finally:
        proc.send_signal(signal.SIGTERM)
        out = proc.communicate(timeout=30)[0].decode(errors="replace")
    records = _records(out)
    loggers = {r["logger"] for r in records}
    assert "kaiten.tokenizer" in loggers and "uvicorn.error" in loggers, records


def test_up_passes_the_json_format_to_every_child(tiny_model_dir, redis_url, tmp_path):
    port = free_port()
    errlog = tmp_path / "up.stderr"
    with open(errlog, "w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "shared.cli", "up", "--model", str(tiny_model_dir), "--port",
                                 str(port), "--redis-url", redis_url, "--dtype", "float32", "--enforce-eager",
                                 "--kv-cache-memory", "8MiB", "--log-format", "json"],
                                cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=err)
    try:
        deadline = time.monotonic() + 150
        banner = ""
        while "Ctrl-C stops it." not in banner and time.monotonic() < deadline and proc.poll() is None:
            banner += proc.stdout.readline().decode(errors="replace")
        assert "Kaiten is up" in banner, banner + errlog.read_text()
        body = json.dumps({"model": tiny_model_dir.name, "messages": [{"role": "user", "content": "Hi"}],
                           "max_tokens": 2}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as resp:
            assert resp.status == 200
        proc.send_signal(signal.SIGINT)
        proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    records = _records(errlog.read_text())
    loggers = {r["logger"] for r in records}
    assert "kaiten.up" in loggers, loggers                                    # the launcher
    assert {"kaiten.worker", "kaiten.engine"} & loggers, loggers             # the engine child
    access = [r for r in records if r["logger"] == "uvicorn.access"]          # the gateway child
    assert [(r["method"], r["path"], r["status"]) for r in access] == [("POST", "/v1/chat/completions", 200)], access
    assert proc.returncode == 0
