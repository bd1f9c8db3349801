"""/metrics as Prometheus scrapes it: a real engine worker (tiny model) and two real gateways on a
real Redis; the text parsed with prometheus_client's own parser."""
from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.engine_support import WorkerThread, wait_until
from tests.redis_server import RedisServer
from tests.test_gateway_support import start_gateway

pytestmark = pytest.mark.timeout(180)
ENGINE = "metrics-engine"


def scrape(srv) -> dict[str, list]:
    """name -> [(labels, value)] for every sample of one scrape."""
    text = httpx.get(srv.url + "/metrics", trust_env=False, timeout=10).text
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
    w = WorkerThread(server.url, tiny_model_dir, ENGINE,
                     engine_kw={"kv_cache_memory": str(8 * _block_bytes(tiny_model_dir)), "max_num_seqs": 8}).start()
    gws = [start_gateway(server.url, tiny_model_dir) for _ in range(2)]
    for g in gws:
        wait_until(lambda: g.gw.monitor.live_engines(), 10)
    yield {"worker": w, "gws": gws}
    for g in gws:
        g.stop()
    w.stop()
    server.stop()


def _complete(srv, prompt: list[int], max_tokens: int) -> dict:
    r = httpx.post(srv.url + "/v1/completions", trust_env=False, timeout=120,
                   json={"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json()["usage"]


def test_request_histograms_and_engine_counters(system):
    gw_a, gw_b = system["gws"]
    before = scrape(gw_a)
    assert "kaiten:request_queue_time_seconds_count" in before
    # Four requests at once on gateway A: 30 + 60 tokens each, 360 in all, for 128 tokens of KV.
    prompts = [[5 + i] + [7] * 29 for i in range(4)]
    with ThreadPoolExecutor(4) as pool:
        usages = list(pool.map(lambda p: _complete(gw_a, p, 60), prompts))
    # The same 40-token prompt twice on gateway B: the second finds two full blocks cached.
    shared = [3] * 40
    usages += [_complete(gw_b, shared, 2), _complete(gw_b, shared, 2)]
    wait_until(lambda: one(scrape(gw_b), "kaiten:engine_steps_total", engine=ENGINE) >= 60, 10)
    a, b = scrape(gw_a), scrape(gw_b)

    # The request histograms count what each gateway served (sum over gateways).
    for name in ("kaiten:request_queue_time_seconds_count", "kaiten:request_prefill_time_seconds_count",
                 "kaiten:request_decode_time_seconds_count", "kaiten:request_prompt_tokens_count",
                 "kaiten:request_generation_tokens_count"):
        assert one(a, name) == 4 and one(b, name) == 2, name
    assert one(a, "kaiten:request_prompt_tokens_sum") == 4 * 30
    assert one(a, "kaiten:request_generation_tokens_sum") == sum(u["completion_tokens"] for u in usages[:4]) == 240
    assert one(b, "kaiten:request_prompt_tokens_bucket", le="50.0") == 2
    assert one(a, "kaiten:request_decode_time_seconds_sum") > 0
    assert one(a, "kaiten:request_queue_time_seconds_sum") > 0      # some waited for blocks

    # Engine series: labelled with the engine, the same from every gateway (count them once).
    for name in ("kaiten:num_preemptions_total", "kaiten:prefix_cache_queries_total",
                 "kaiten:prefix_cache_hits_total", "kaiten:num_requests_running", "kaiten:kv_cache_usage_perc"):
        assert [lbl["engine"] for lbl, _ in a[name]] == [ENGINE], name
    assert one(a, "kaiten:num_preemptions_total", engine=ENGINE) > 0
    assert one(a, "kaiten:prefix_cache_hits_total", engine=ENGINE) >= 32
    assert one(a, "kaiten:prefix_cache_queries_total", engine=ENGINE) >= 4 * 30 + 2 * 40
    assert one(a, "kaiten:engine_step_seconds_total", engine=ENGINE) > 0
    assert one(a, "kaiten:num_engines") == one(b, "kaiten:num_engines") == 1
    assert "kaiten:prefix_cache_hit_rate" not in a          # a counter pair now, not a gauge
