"""Liveness end to end: a SIGKILLed gateway's requests are aborted by the engine, and one long
prompt neither stalls the streams beside it nor makes the engine look dead."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from tests.support.engine_support import WorkerThread, slow_steps, wait_engine_idle, wait_until
from tests.support.gateway_support import start_gateway
from tests.support.paths import ROOT
from tests.support.redis_server import RedisServer, free_port
from tests.support.tiny_model import build_tiny_model

pytestmark = pytest.mark.timeout(180)


def _gateway_process(url: str, model_dir, port: int) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    return subprocess.Popen(
        [sys.executable, "-m", "shared.cli", "gateway", "--model", str(model_dir), "--redis-url", url,
         "--port", str(port), "--log-level", "WARNING"],
        cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _stream(url: str, body: dict, out: dict, key, first: threading.Event | None = None) -> None:
    """POST a streamed completion; out[key] = the data lines, or the exception that ended it."""
    lines = []
    try:
        with httpx.Client(base_url=url, trust_env=False, timeout=120) as c:
            with c.stream("POST", "/v1/completions", json={**body, "stream": True}) as resp:
                for line in resp.iter_lines():
                    if line.startswith("data:"):
                        lines.append(line[5:].strip())
                        if first is not None:
                            first.set()
        out[key] = lines
    except httpx.HTTPError as e:
        out[key] = e


def test_sigkill_of_a_gateway_aborts_its_requests_within_2s(tiny_model_dir):
    server = RedisServer().start()
    w = WorkerThread(server.url, tiny_model_dir, "e-gw-kill").start()
    slow_steps(w.engine, 0.01)                      # 400 tokens take > 4 s
    port = free_port()
    proc = _gateway_process(server.url, tiny_model_dir, port)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: _ready(url), 60, 0.2, "the gateway's /ready")
        out, firsts = {}, [threading.Event() for _ in range(10)]
        threads = [threading.Thread(target=_stream, daemon=True, args=(
            url, {"prompt": f"Hello {i}", "max_tokens": 400, "ignore_eos": True}, out, i, firsts[i]))
            for i in range(10)]
        for t in threads:
            t.start()
        for e in firsts:
            assert e.wait(60)
        assert w.engine.stats().num_running == 10
        proc.send_signal(signal.SIGKILL)
        t_kill = time.monotonic()
        proc.wait(10)
        wait_engine_idle(w.engine, timeout=10)
        since_kill = time.monotonic() - t_kill
        print(f"\nengine running count 0 {since_kill:.2f} s after the gateway's SIGKILL")
        assert since_kill < 2.0
        assert w.counters["stopped_gateway_gone"] == 10
        w.engine.check_block_accounting()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        w.stop()
        server.stop()


def _ready(url: str) -> bool:
    try:
        return httpx.get(url + "/ready", timeout=2, trust_env=False).status_code == 200
    except httpx.HTTPError:
        return False


def test_long_prompt_beside_8_streams_keeps_everything_live(tmp_path):
    """One 8,000-token prompt, chunked by the token budget, beside 8 streams on an engine whose
    steps are slowed: every stream completes, the long request too, and /ready never fails."""
    model = build_tiny_model(tmp_path / "long", max_position_embeddings=8448)
    server = RedisServer().start()
    # 8 MiB of KV (1,024 blocks of 16 tokens): room for the long prompt and the 8 streams at once,
    # so a preemption would mean the scheduler misbehaved (4 MiB holds 8,192 tokens: not enough).
    w = WorkerThread(server.url, model, "e-long", engine_kw={"max_num_batched_tokens": 256, "kv_cache_memory": "8MiB"},
                     heartbeat_interval=0.2, heartbeat_ttl=1.0).start()
    slow_steps(w.engine, 0.05)                      # 32 prefill chunks take > 1.5 s: > heartbeat TTL
    srv = start_gateway(server.url, model, engine_timeout=1.0)
    try:
        wait_until(lambda: srv.gw.monitor.live_engines(), 10)
        ready_codes, stop_polling = [], threading.Event()

        def poll_ready():
            with httpx.Client(base_url=srv.url, trust_env=False, timeout=5) as c:
                while not stop_polling.wait(0.1):
                    ready_codes.append(c.get("/ready").status_code)
        poller = threading.Thread(target=poll_ready, daemon=True)
        poller.start()
        out = {}
        long_prompt = [1] + [3 + i % 300 for i in range(7999)]
        threads = [threading.Thread(target=_stream, daemon=True, args=(
            srv.url, {"prompt": long_prompt, "max_tokens": 8, "ignore_eos": True}, out, "long"))]
        threads += [threading.Thread(target=_stream, daemon=True, args=(
            srv.url, {"prompt": f"stream {i}", "max_tokens": 40, "ignore_eos": True}, out, i)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        stop_polling.set()
        poller.join(5)
        for key in ["long", *range(8)]:
            lines = out[key]
            assert isinstance(lines, list) and lines[-1] == "[DONE]", (key, lines if not isinstance(lines, list) else lines[-3:])
            assert not any('"error"' in line for line in lines), (key, lines[-3:])
        assert ready_codes and set(ready_codes) == {200}, ready_codes
        assert w.engine.stats().num_preemptions == 0
    finally:
        srv.stop()
        w.stop()
        server.stop()
