"""The shipped dashboard against a real Prometheus (Debian's `prometheus`) scraping a running system.

A real Redis, a `kaiten engine` process (tiny model, its own /metrics port) and a gateway; a
Prometheus with the shipped scrape config, its DNS discovery replaced by these addresses and a 1 s
interval. Traffic runs while it scrapes (completions, a repeated prompt for the prefix cache, a
streamed reply the client drops, a refused request); then every PromQL expression of every panel
of docker/monitoring/grafana/dashboards/kaiten.json must return a number through the HTTP API.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import redis
import yaml

from shared import names
from tests.support.engine_support import wait_until
from tests.support.gateway_support import start_gateway
from tests.support.paths import ROOT
from tests.support.redis_server import RedisServer, free_port

pytestmark = pytest.mark.timeout(240)
MONITORING = ROOT / "docker" / "monitoring"
DASHBOARD = MONITORING / "grafana" / "dashboards" / "kaiten.json"
ENGINE = "prom-engine"
# Grafana's interval variables, as Grafana would fill them for a recent window.
GRAFANA_VARS = {"$__rate_interval": "1m", "$__interval": "5s", "$__range": "5m"}


def prometheus_exe() -> str | None:
    return shutil.which("prometheus") or shutil.which("prometheus", path="/usr/bin:/usr/local/bin:/usr/sbin")


def dashboard_exprs() -> list[tuple[str, str]]:
    """(panel title, expr) of every target of every panel, rows' nested panels included."""
    def walk(panels):
        for p in panels:
            yield p
            yield from walk(p.get("panels", []))
    dash = json.loads(DASHBOARD.read_text())
    return [(p["title"], t["expr"]) for p in walk(dash["panels"]) for t in p.get("targets", [])]


def scrape_config(gateway: str, engine: str) -> dict:
    """The shipped config: the same jobs, static targets instead of DNS, 1 s scrapes."""
    cfg = yaml.safe_load((MONITORING / "prometheus.yml").read_text())
    cfg["global"] = {"scrape_interval": "1s", "evaluation_interval": "1s"}
    targets = {"kaiten-gateway": gateway, "kaiten-engine": engine}
    for job in cfg["scrape_configs"]:
        del job["dns_sd_configs"]
        job["static_configs"] = [{"targets": [targets[job["job_name"]]]}]
    assert {j["job_name"] for j in cfg["scrape_configs"]} == set(targets)
    return cfg


def test_dashboard_is_well_formed():
    dash = json.loads(DASHBOARD.read_text())
    assert dash["uid"] and dash["title"] and not dash["templating"]["list"]
    exprs = dashboard_exprs()
    assert len(exprs) >= 20
    panels = [p for p in dash["panels"] if p["type"] != "row"]
    for p in panels:
        assert p["datasource"]["uid"] == "kaiten-prometheus", p["title"]   # the provisioned datasource
        assert p["targets"] and all(t["expr"] and t["refId"] for t in p["targets"]), p["title"]
    assert len({p["id"] for p in dash["panels"]}) == len(dash["panels"])
    # Every series the engine and the gateway export is on the dashboard.
    text = " ".join(e for _, e in exprs)
    for series in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "num_preemptions_total",
                   "prefix_cache_queries_total", "prefix_cache_hits_total", "engine_step_duration_seconds",
                   "engine_redis_round_seconds", "engine_worker_events_total", "time_to_first_token_seconds",
                   "inter_token_latency_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds",
                   "request_prefill_time_seconds", "request_decode_time_seconds", "request_prompt_tokens",
                   "request_generation_tokens", "request_success_total", "request_errors_total",
                   "requests_rejected_total", "request_failovers_total", "prompt_tokens_total",
                   "generation_tokens_total", "gateway_requests_in_flight", "request_stream_backlog",
                   "spec_decode_num_drafts_total", "spec_decode_num_draft_tokens_total",
                   "spec_decode_num_accepted_tokens_total"):
        assert f"kaiten:{series}" in text, series


def test_shipped_scrape_config_is_valid():
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed (Debian's prometheus package has it: apt-get install prometheus)")
    out = subprocess.run([promtool, "check", "config", str(MONITORING / "prometheus.yml")], capture_output=True,
                         text=True, timeout=30)
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.fixture
def system(tiny_model_dir, tmp_path):
    server = RedisServer().start()
    metrics_port = free_port()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    log = open(tmp_path / "engine.log", "wb")
    engine = subprocess.Popen(
        [sys.executable, "-m", "shared.cli", "engine", "--model", str(tiny_model_dir), "--redis-url", server.url,
         "--engine-id", ENGINE, "--dtype", "float32", "--kv-cache-memory", "4MiB", "--num-threads", "1",
         "--heartbeat-interval", "0.2", "--idle-block-ms", "20", "--metrics-port", str(metrics_port)],
        cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    gw = None
    try:
        r = redis.Redis.from_url(server.url)
        wait_until(lambda: r.exists(names.heartbeat_key(ENGINE)) or engine.poll() is not None, 90, 0.1, "the engine")
        assert engine.poll() is None, (tmp_path / "engine.log").read_text()
        gw = start_gateway(server.url, tiny_model_dir)
        wait_until(lambda: gw.gw.monitor.live_engines(), 10)
        yield {"gateway": gw, "engine": f"127.0.0.1:{metrics_port}"}
    finally:
        if gw is not None:
            gw.stop()
        engine.terminate()
        engine.wait(30)
        log.close()
        server.stop()


@pytest.fixture
def prometheus(system, tmp_path):
    exe = prometheus_exe()
    if exe is None:
        pytest.skip("the prometheus binary is not installed (apt-get install prometheus; scripts/setup.sh test)")
    port = free_port()
    gateway = system["gateway"].url.removeprefix("http://")
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(scrape_config(gateway, system["engine"])))
    log = open(tmp_path / "prometheus.log", "wb")
    proc = subprocess.Popen([exe, f"--config.file={tmp_path / 'prometheus.yml'}",
                             f"--storage.tsdb.path={tmp_path / 'tsdb'}", f"--web.listen-address=127.0.0.1:{port}"],
                            cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT)
    api = httpx.Client(base_url=f"http://127.0.0.1:{port}", trust_env=False, timeout=10)
    try:
        def ready():
            assert proc.poll() is None, (tmp_path / "prometheus.log").read_text()
            try:
                return api.get("/-/ready").status_code == 200
            except httpx.TransportError:
                return False
        wait_until(ready, 60, 0.2, "prometheus to be ready")
        yield api
    finally:
        api.close()
        proc.terminate()
        proc.wait(30)
        log.close()


def _targets_up(api: httpx.Client) -> dict[str, str]:
    active = api.get("/api/v1/targets").json()["data"]["activeTargets"]
    return {t["labels"]["job"]: t["health"] for t in active}


def _traffic(url: str) -> None:
    with httpx.Client(base_url=url, trust_env=False, timeout=120) as c:
        def complete(prompt, n):
            r = c.post("/v1/completions", json={"prompt": prompt, "max_tokens": n, "temperature": 0,
                                                "ignore_eos": True})
            assert r.status_code == 200, r.text

        with ThreadPoolExecutor(4) as pool:
            list(pool.map(lambda i: complete([5 + i] + [7] * 40, 24), range(8)))
        complete([3] * 48, 4)                                    # the same prompt twice: prefix-cache hits
        complete([3] * 48, 4)
        chat = {"messages": [{"role": "user", "content": "Count"}], "max_tokens": 16, "stream": True}
        with c.stream("POST", "/v1/chat/completions", json=chat) as resp:
            assert resp.status_code == 200 and sum(1 for ln in resp.iter_lines() if ln.startswith("data:")) > 2
        # A streamed reply its client drops (an error), and a request refused before submission.
        with c.stream("POST", "/v1/completions", json={"prompt": "Hi", "max_tokens": 400, "ignore_eos": True,
                                                       "stream": True}) as resp:
            next(ln for ln in resp.iter_lines() if ln.startswith("data:"))
        assert c.post("/v1/completions", json={"prompt": "Hi", "max_tokens": -1}).status_code == 400


def _instant(api: httpx.Client, expr: str) -> list:
    body = api.get("/api/v1/query", params={"query": expr}).json()
    assert body["status"] == "success", (expr, body)
    return body["data"]["result"]


def test_every_dashboard_panel_returns_data(system, prometheus):
    api = prometheus
    wait_until(lambda: _targets_up(api) == {"kaiten-gateway": "up", "kaiten-engine": "up"}, 30, 0.5,
               "both targets scraped")
    _traffic(system["gateway"].url)
    # Scrapes after the traffic, and the dropped stream's error counted.
    wait_until(lambda: _instant(api, "sum(kaiten:request_errors_total)"), 30, 0.5, "the error counted")
    time.sleep(3)

    # The engine's series come once, from the engine, labelled with its id.
    running = _instant(api, "kaiten:num_requests_running")
    assert [(s["metric"]["engine"], s["metric"]["job"]) for s in running] == [(ENGINE, "kaiten-engine")]
    assert not _instant(api, 'kaiten:num_requests_running{job="kaiten-gateway"}')

    empty = []
    for title, expr in dashboard_exprs():
        query = expr
        for var, value in GRAFANA_VARS.items():
            query = query.replace(var, value)
        values = [float(s["value"][1]) for s in _instant(api, query)]
        if not any(math.isfinite(v) for v in values):
            empty.append(f"{title}: {expr} -> {values}")
    assert not empty, "\n".join(empty)
