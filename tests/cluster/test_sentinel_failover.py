"""Redis Sentinel failover under load (issue 21), on loopback: a real primary, two replicas and
three sentinels (tests/support/sentinel_cluster.py), two real engine processes (the tiny model, slowed
steps) and a gateway, all pointed at the redis+sentinel:// URL. The primary is SIGKILLed while 8
greedy streams run: every stream completes with the text of an uninterrupted run (no repeated,
no missing token, no error), and new requests are answered again within 5 s of the kill."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time

import httpx
import pytest

from shared import names
from shared.launcher import wait_redis
from shared.redis_conn import redis_client
from tests.support.engine_cluster import PROMPTS, check_streams, engine_process, run_sse_clients
from tests.support.engine_support import wait_until
from tests.support.gateway_support import start_gateway
from tests.support.paths import ROOT
from tests.support.sentinel_cluster import SentinelCluster

pytestmark = [pytest.mark.timeout(240),
              pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server")]


def first_answer_after(url: str, t0: float, limit: float = 30.0) -> float:
    """Seconds from t0 until a new (non-streamed) request gets its whole answer."""
    with httpx.Client(base_url=url, trust_env=False, timeout=10) as c:
        while time.monotonic() - t0 < limit:
            try:
                r = c.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 4, "temperature": 0})
                if r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4:
                    return time.monotonic() - t0
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
    raise AssertionError(f"no request answered within {limit} s of the primary's kill")


def test_sigkill_the_primary_8_streams_complete_unchanged(tiny_model_dir, tmp_path, reference):  # noqa: F811
    cluster = SentinelCluster(replicas=2, sentinels=3, down_after_ms=1000).start()
    procs, srv = {}, None
    try:
        r = redis_client(cluster.url, retries=5)
        procs = {e: engine_process(cluster.url, tiny_model_dir, e, tmp_path / f"{e}.log") for e in ("eng-a", "eng-b")}
        srv = start_gateway(cluster.url, tiny_model_dir, engine_timeout=8.0, failover_timeout=2.0)
        wait_until(lambda: all(r.exists(names.heartbeat_key(e)) for e in procs), 120, 0.1, "the engines")
        wait_until(lambda: len(srv.gw.monitor.live_engines()) == 2, 10)
        out: dict = {}
        clients = run_sse_clients(srv.url, PROMPTS[:8], out)
        wait_until(lambda: len(srv.gw.router.streams) == 8
                   and min(len(s.token_ids) for s in srv.gw.router.streams.values()) >= 10, 60, 0.01,
                   "8 streams with 10 tokens each")
        old = cluster.primary()
        cluster.kill(old)
        t_kill = time.monotonic()
        new = cluster.wait_promoted(old)
        t_promoted = time.monotonic() - t_kill
        t_answer = first_answer_after(srv.url, t_kill)
        clients.join(120)
        assert not clients.is_alive()
        check_streams(None, out["results"], reference["texts"][:8])
        c = srv.gw.router.counters
        assert c["gaps"] == 0 and c["foreign_engine"] == 0, c
        print(f"\nprimary {old.name} SIGKILLed: {new.name} promoted after {t_promoted:.2f} s, a new request "
              f"answered after {t_answer:.2f} s; {c['failovers']} streams continued, counters {c}")
        assert t_answer <= 5.0
        assert all(p.poll() is None for p in procs.values())      # the engines lived through it
        wait_until(lambda: all(r.exists(names.heartbeat_key(e)) for e in procs), 10, 0.1, "heartbeats on the new primary")
        # The container healthcheck and `kaiten serve`'s wait for Redis take the sentinel URL too.
        env = dict(os.environ, REDIS_URL=cluster.url, KAITEN_HEARTBEAT_TTL="3")
        hc = subprocess.run([sys.executable, "-m", "shared.healthcheck", "engine", "eng-a"], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=60)
        assert hc.returncode == 0 and "healthy: engine 'eng-a'" in hc.stdout, hc.stdout + hc.stderr
        wait_redis(cluster.url, timeout=5)
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
        if srv is not None:
            srv.stop()
        cluster.stop()
