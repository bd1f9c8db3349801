"""GET /ready follows the engines: a real `kaiten engine` process, SIGKILLed, leaves /ready within 3 s
(the gateway counts an engine while its heartbeat changed within failover_timeout, 1.5 s)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from tests.support.engine_support import wait_until
from tests.support.gateway_support import start_gateway
from tests.support.paths import ROOT

pytestmark = pytest.mark.timeout(180)
DEADLINE_S = 3.0


def _ready_status(url: str) -> int:
    return httpx.get(url + "/ready", timeout=2, trust_env=False).status_code


def test_ready_goes_503_within_3s_of_a_sigkilled_engine(redis_url, tiny_model_dir, tmp_path):
    log = open(tmp_path / "engine.log", "w")
    engine = subprocess.Popen(
        [sys.executable, "-m", "shared.cli", "engine", "--model", str(tiny_model_dir), "--redis-url", redis_url,
         "--dtype", "float32", "--kv-cache-memory", "64MiB", "--engine-id", "ready-test"],
        cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)), stdout=log, stderr=subprocess.STDOUT)
    gw = start_gateway(redis_url, tiny_model_dir, engine_timeout=10.0)       # the shipped engine_timeout
    try:
        wait_until(lambda: engine.poll() is None and _ready_status(gw.url) == 200, 120, 0.2, "/ready 200")
        time.sleep(1.0)                  # a few heartbeats in steady state
        assert _ready_status(gw.url) == 200
        engine.send_signal(signal.SIGKILL)
        killed = time.monotonic()
        engine.wait(10)
        while _ready_status(gw.url) == 200:
            assert time.monotonic() - killed < DEADLINE_S + 2, "/ready still 200"
            time.sleep(0.05)
        took = time.monotonic() - killed
        body = httpx.get(gw.url + "/ready", timeout=2, trust_env=False).json()
        print(f"/ready went 503 {took:.2f} s after the SIGKILL")
        assert took <= DEADLINE_S, f"/ready went 503 only {took:.2f} s after the SIGKILL"
        assert body["engines"] == 0 and "no live engine" in body["problems"], body
    finally:
        gw.stop()
        if engine.poll() is None:
            engine.kill()
            engine.wait(10)
        log.close()


def test_a_starting_engine_gets_503_engines_starting_with_retry_after(redis_url, tiny_model_dir):
    """While a model's engine starts (its stages in Redis, no heartbeat yet) a request gets 503
    engines_starting, OpenAI's error shape, with Retry-After and the stage; /ready and /v1/status
    name the stage. Once the engine's last state is "serving" and no heartbeat came, it is no_engine."""
    from engine_worker.startup_report import StartupReport
    from shared.startup_stages import StartupStages

    stages = StartupStages(tiny_model_dir.name)
    report = StartupReport(redis_url, stages, interval=0.1).start()
    gw = start_gateway(redis_url, tiny_model_dir)
    body = {"model": tiny_model_dir.name, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}

    def post() -> httpx.Response:
        return httpx.post(gw.url + "/v1/chat/completions", json=body, timeout=10, trust_env=False)
    try:
        with stages.stage("compilation"):
            wait_until(lambda: "compilation" in post().json()["error"]["message"], 20, 0.1, "engines_starting")
            r = post()
            error = r.json()["error"]
            assert r.status_code == 503 and int(r.headers["retry-after"]) >= 1, r.text
            assert "starting (compilation, " in error["message"] and error["type"], error
            ready = httpx.get(gw.url + "/ready", timeout=5, trust_env=False)
            assert ready.status_code == 503 and "1 starting (compilation" in ready.json()["problems"][0], ready.text
            status = httpx.get(gw.url + "/v1/status", timeout=5, trust_env=False).json()
            assert status["engines"] == 0 and status["starting"][0].startswith("compilation, "), status
        report.finish()
        wait_until(lambda: post().json()["error"]["code"] == "no_engine", 20, 0.1, "no_engine once it serves")
    finally:
        report.finish()
        gw.stop()


def test_an_engine_compiling_in_the_background_is_listed_as_compiling(redis_url, tiny_model_dir):
    """An engine that serves the eager model while it compiles keeps its start-up key, SERVING with
    the background stage: /v1/status lists it under "compiling", not "starting", until it ends."""
    from engine_worker.startup_report import StartupReport
    from shared.startup_stages import StartupStages

    stages = StartupStages(tiny_model_dir.name)
    report = StartupReport(redis_url, stages, interval=0.1).start()
    gw = start_gateway(redis_url, tiny_model_dir)

    def status() -> dict:
        return httpx.get(gw.url + "/v1/status", timeout=5, trust_env=False).json()
    try:
        stages.begin_background("compilation")
        report.finish()
        wait_until(lambda: status()["compiling"], 20, 0.1, "listed as compiling")
        body = status()
        assert body["compiling"][0].startswith("compilation (serving eagerly), ") and body["starting"] == [], body
        stages.end_background("compilation", 1.5)
        wait_until(lambda: not status()["compiling"], 20, 0.1, "no longer compiling")
        assert ("compilation", 1.5) in stages.snapshot().done
    finally:
        report.close()
        gw.stop()
