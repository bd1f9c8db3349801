"""/metrics as Prometheus scrapes it: a real engine worker (tiny model, its own /metrics port) and
two real gateways on a real Redis; the text parsed with prometheus_client's own parser. The
engine exports the engine series once; the gateways export request series only."""
from __future__ import annotations

import json
import socket
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support.engine_support import WorkerThread, wait_until
from tests.support.gateway_support import start_gateway
from tests.support.redis_server import RedisServer

pytestmark = pytest.mark.timeout(180)
ENGINE = "metrics-engine"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape(srv) -> dict[str, list]:
    """name -> [(labels, value)] for every sample of one scrape of `srv` (a gateway, or a URL)."""
    text = httpx.get(getattr(srv, "url", srv) + "/metrics", trust_env=False, timeout=10).text
    out: dict[str, list] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out.setdefault(s.name, []).append((s.labels, s.value))
    return out


def one(samples: dict, name: str, **labels) -> float:
    vals = [v for lbl, v in samples.get(name, []) if all(lbl.get(k) == x for k, x in labels.items())]
    assert len(vals) == 1, (name, labels, samples.get(name))
    return vals[0]


def _block_bytes(model_dir) -> int:
    cfg = json.loads((model_dir / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * head_dim * 16 * 4


@pytest.fixture(scope="module")
def system(tiny_model_dir):
    """A KV pool of 8 blocks (128 tokens): four 90-token requests at once must preempt."""
    server = RedisServer().start()
    w = WorkerThread(server.url, tiny_model_dir, ENGINE, metrics_port=free_port(),
                     engine_kw={"kv_cache_memory": str(8 * _block_bytes(tiny_model_dir)), "max_num_seqs": 8}).start()
    gws = [start_gateway(server.url, tiny_model_dir) for _ in range(2)]
    for g in gws:
        wait_until(lambda: g.gw.monitor.live_engines(), 10)
    yield {"worker": w, "gws": gws, "engine_url": f"http://127.0.0.1:{w.metrics.port}"}
    for g in gws:
        g.stop()
    w.stop()
    server.stop()


def _complete(srv, prompt: list[int], max_tokens: int) -> dict:
    r = httpx.post(srv.url + "/v1/completions", trust_env=False, timeout=120,
                   json={"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json()["usage"]


def test_request_histograms_and_engine_series(system):
    gw_a, gw_b = system["gws"]
    engine = system["engine_url"]
    before = scrape(gw_a)
    assert "kaiten:request_queue_time_seconds_count" in before
    steps_before = one(scrape(engine), "kaiten:engine_step_duration_seconds_count", engine=ENGINE)
    # Four requests at once on gateway A: 30 + 60 tokens each, 360 in all, for 128 tokens of KV.
    prompts = [[5 + i] + [7] * 29 for i in range(4)]
    with ThreadPoolExecutor(4) as pool:
        usages = list(pool.map(lambda p: _complete(gw_a, p, 60), prompts))
    # The same 40-token prompt twice on gateway B: the second finds two full blocks cached.
    shared = [3] * 40
    usages += [_complete(gw_b, shared, 2), _complete(gw_b, shared, 2)]
    a, b, e = scrape(gw_a), scrape(gw_b), scrape(engine)

    # The request histograms count what each gateway served (sum over gateways).
    for name in ("kaiten:request_queue_time_seconds_count", "kaiten:request_prefill_time_seconds_count",
                 "kaiten:request_decode_time_seconds_count", "kaiten:request_prompt_tokens_count",
                 "kaiten:request_generation_tokens_count", "kaiten:e2e_request_latency_seconds_count",
                 "kaiten:time_to_first_token_seconds_count"):
        assert one(a, name) == 4 and one(b, name) == 2, name
    assert one(a, "kaiten:request_prompt_tokens_sum") == 4 * 30
    assert one(a, "kaiten:request_generation_tokens_sum") == sum(u["completion_tokens"] for u in usages[:4]) == 240
    assert one(b, "kaiten:request_prompt_tokens_bucket", le="50.0") == 2
    assert one(a, "kaiten:request_decode_time_seconds_sum") > 0
    assert one(a, "kaiten:request_queue_time_seconds_sum") > 0      # some waited for blocks
    assert one(a, "kaiten:inter_token_latency_seconds_count") > 0

    # Engine series come from the engine alone, once, labelled with its id.
    engine_series = ("kaiten:num_preemptions_total", "kaiten:prefix_cache_queries_total",
                     "kaiten:prefix_cache_hits_total", "kaiten:num_requests_running", "kaiten:num_requests_waiting",
                     "kaiten:kv_cache_usage_perc", "kaiten:engine_step_duration_seconds_count",
                     "kaiten:engine_redis_round_seconds_count")
    for name in engine_series:
        assert [lbl["engine"] for lbl, _ in e[name]] == [ENGINE], name
        assert e[name][0][0]["model_name"] == system["worker"].engine.model_name
        assert name not in a and name not in b, f"{name} re-exported by a gateway"
    assert one(e, "kaiten:num_preemptions_total", engine=ENGINE) > 0
    assert one(e, "kaiten:prefix_cache_hits_total", engine=ENGINE) >= 32
    assert one(e, "kaiten:prefix_cache_queries_total", engine=ENGINE) >= 4 * 30 + 2 * 40
    # One step per generated token at least (each request's first token comes with its prefill).
    steps = one(e, "kaiten:engine_step_duration_seconds_count", engine=ENGINE) - steps_before
    assert steps >= 60, steps
    assert one(e, "kaiten:engine_step_duration_seconds_sum", engine=ENGINE) > 0
    assert one(e, "kaiten:engine_worker_events_total", engine=ENGINE, event="requests") >= 6
    # The engine's gauges are its stats as of a step; the last tokens can reach the client before
    # the step that finished them has left its stats (CI once scraped 1 here).
    wait_until(lambda: one(scrape(engine), "kaiten:num_requests_running", engine=ENGINE) == 0, timeout=10,
               what="the engine's num_requests_running gauge to read 0")
    assert "kaiten:num_engines" not in a and "kaiten:prefix_cache_hit_rate" not in e
    assert one(a, "kaiten:request_stream_backlog") == 0


def test_engine_counters_are_monotonic(system):
    """Counters only grow between scrapes, and each is a real Prometheus counter (`_total`)."""
    engine = system["engine_url"]
    text = httpx.get(engine + "/metrics", trust_env=False, timeout=10).text
    for name in ("kaiten:num_preemptions", "kaiten:prefix_cache_queries", "kaiten:prefix_cache_hits",
                 "kaiten:engine_worker_events"):
        assert f"# TYPE {name}_total counter" in text or f"# TYPE {name} counter" in text, name
    first = scrape(engine)
    _complete(system["gws"][0], [9] * 20, 4)
    second = scrape(engine)
    for name in ("kaiten:prefix_cache_queries_total", "kaiten:engine_step_duration_seconds_count"):
        assert one(second, name, engine=ENGINE) > one(first, name, engine=ENGINE), name
    assert one(second, "kaiten:num_preemptions_total", engine=ENGINE) >= one(first, "kaiten:num_preemptions_total",
                                                                              engine=ENGINE)


def test_engine_metrics_port_in_use_serves_on(tiny_model_dir):
    """A second engine on a taken port logs and serves requests without its /metrics."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        server = RedisServer().start()
        w = WorkerThread(server.url, tiny_model_dir, "metrics-port-taken", metrics_port=taken.getsockname()[1]).start()
        try:
            assert w.metrics.port == 0
            gw = start_gateway(server.url, tiny_model_dir)
            try:
                wait_until(lambda: gw.gw.monitor.live_engines(), 10)
                assert _complete(gw, [4] * 8, 3)["completion_tokens"] == 3
            finally:
                gw.stop()
        finally:
            w.stop()
            server.stop()
