"""The shared KV store end to end (issue 63): two real engine processes (the tiny model, steps
slowed) share a second real Redis as their KV store, behind an in-process gateway.

- A stream whose engine is SIGKILLed continues on the other engine, which loads the stream's KV
  (prompt and the tokens delivered, written chunk by chunk as they were computed) and computes at
  most the chunks the dead engine had not written yet; every text equals an uninterrupted run.
- A prefix computed on one engine is loaded on the other, greedy output equal; then the store is
  killed, and the next request is computed, its output equal too.
- The store is a Sentinel deployment whose primary is SIGKILLed while 8 streams run: a store miss
  or a lost write is all it costs, so every stream completes unchanged, without a failover or an
  error; after the promotion the engines write to the new primary again."""
from __future__ import annotations

import shutil
import signal

import httpx
import msgpack
import pytest

from shared import names
from tests.support.engine_cluster import (N_TOKENS, PROMPTS, check_sequences, check_streams, run_sse_clients,
                                          two_engines_and_a_gateway, wait_engines)
from tests.support.engine_support import wait_until
from shared.redis_conn import redis_client
from tests.support.redis_server import RedisServer
from tests.support.sentinel_cluster import SentinelCluster

pytestmark = pytest.mark.timeout(240)

CHUNK = 32


@pytest.fixture
def kv_store():
    server = RedisServer().start()
    yield server
    server.stop()


def store_args(kv_store) -> tuple[str, ...]:
    return ("--kv-store-url", kv_store.url, "--kv-store-chunk-tokens", str(CHUNK))


def stats(st, engine_id: str) -> dict:
    raw = st.r.get(names.heartbeat_key(engine_id))
    return msgpack.unpackb(raw, raw=False) if raw else {}


def test_a_continuation_after_sigkill_loads_the_streams_kv(tiny_model_dir, tmp_path, reference, kv_store):
    go = tmp_path / "go-b"
    with two_engines_and_a_gateway(tiny_model_dir, tmp_path, go_files={"eng-b": str(go)},
                                   engine_args=store_args(kv_store)) as st:
        wait_engines(st, ["eng-a"])
        out: dict = {}
        prompts = PROMPTS[:4]
        clients = run_sse_clients(st.srv.url, prompts, out)
        wait_until(lambda: len(st.tap.tokens_so_far()) == 4 and min(st.tap.tokens_so_far().values()) >= 120,
                   90, 0.01, "4 streams with 120 tokens each")
        go.touch()
        wait_engines(st, ["eng-b"])
        st.procs["eng-a"].send_signal(signal.SIGKILL)
        clients.join(120)
        assert not clients.is_alive()
        check_streams(st, out["results"], reference["texts"][:4])
        moved = check_sequences(st, N_TOKENS)
        assert len(moved) == 4
        # What eng-b computed of each continuation's prompt (>= 125 tokens) is the tail that fills
        # no chunk, and at most one chunk more: the one eng-a may have had in its write queue when
        # it died (its write goes out as the step that filled it delivers its token).
        computed = continuation_tokens_computed(st)
        assert len(computed) == 4 and all(n <= 2 * CHUNK for n in computed.values()), computed
        b = stats(st, "eng-b")
        assert b["kv_store_loaded_tokens"] >= sum(n for n, _ in prompts_of_continuations(st).values()) \
            - sum(computed.values()), b


def prompts_of_continuations(st) -> dict[str, tuple[int, int]]:
    """continuation id -> (its prompt tokens, those cached or loaded), from its terminal delta."""
    return {d.request_id: (d.num_prompt_tokens, d.num_cached_tokens) for ds in st.tap.deltas().values()
            for _, _, d in ds if "~" in d.request_id and d.finish_reason is not None}


def continuation_tokens_computed(st) -> dict[str, int]:
    """continuation id -> prompt tokens its engine computed (neither prefix-cache hits nor loaded)."""
    return {rid: n - cached for rid, (n, cached) in prompts_of_continuations(st).items()}


def test_a_prefix_computed_on_one_engine_is_loaded_on_the_other_and_a_dead_store_changes_nothing(
        tiny_model_dir, tmp_path, reference, kv_store):
    go = tmp_path / "go-b"
    shared = [1] + [(5 * i) % 300 + 3 for i in range(150)]
    with two_engines_and_a_gateway(tiny_model_dir, tmp_path, go_files={"eng-b": str(go)},
                                   engine_args=store_args(kv_store)) as st:
        wait_engines(st, ["eng-a"])
        body = {"prompt": shared + [7, 8], "max_tokens": 16, "temperature": 0, "ignore_eos": True}
        with httpx.Client(base_url=st.srv.url, trust_env=False, timeout=60) as c:
            first = c.post("/v1/completions", json=body).json()
            wait_until(lambda: stats(st, "eng-a").get("kv_store_saved_chunks", 0) >= 4, 10, 0.05,
                       "eng-a to write the prompt's chunks")
            go.touch()
            wait_engines(st, ["eng-b"])
            st.procs["eng-a"].send_signal(signal.SIGKILL)
            st.procs["eng-a"].wait()
            wait_until(lambda: [e.engine_id for e in st.srv.gw.monitor.live_engines()] == ["eng-b"], 15, 0.05,
                       "the gateway to see eng-a gone")
            second = c.post("/v1/completions", json=body).json()
            assert second["choices"][0]["text"] == first["choices"][0]["text"]
            assert second["usage"]["prompt_tokens_details"]["cached_tokens"] >= 4 * CHUNK
            assert stats(st, "eng-b")["kv_store_loaded_tokens"] >= 4 * CHUNK
            kv_store.stop()                               # the store dies: loads miss, writes are lost
            body["prompt"] = shared[:100] + [9, 9, 9]
            third = c.post("/v1/completions", json=body).json()
            assert third["choices"][0]["finish_reason"] == "length"
        want = llm_text(tiny_model_dir, body["prompt"], 16)
        assert third["choices"][0]["text"] == want


def llm_text(model_dir, prompt: list[int], max_tokens: int) -> str:
    from engine_worker import LLM, SamplingParams
    llm = LLM(str(model_dir), dtype="float32", kv_cache_memory="8MiB", enforce_eager=True)
    return llm.generate([prompt], SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))[0].text


@pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server")
def test_a_sentinel_failover_of_the_store_under_load_changes_no_stream(tiny_model_dir, tmp_path, reference):
    cluster = SentinelCluster(replicas=1, sentinels=3, down_after_ms=1000).start()
    args = ("--kv-store-url", cluster.url, "--kv-store-chunk-tokens", str(CHUNK))
    try:
        with two_engines_and_a_gateway(tiny_model_dir, tmp_path, engine_args=args) as st:
            wait_engines(st, ["eng-a", "eng-b"])
            out: dict = {}
            clients = run_sse_clients(st.srv.url, PROMPTS[:8], out)
            wait_until(lambda: len(st.tap.tokens_so_far()) == 8 and min(st.tap.tokens_so_far().values()) >= 40,
                       90, 0.01, "8 streams with 40 tokens each (a chunk written)")
            old = cluster.primary()
            cluster.kill(old)
            new = cluster.wait_promoted(old)
            clients.join(120)
            assert not clients.is_alive()
            check_streams(st, out["results"], reference["texts"][:8])
            check_sequences(st, N_TOKENS)
            c = st.srv.gw.router.counters
            assert c["failovers"] == 0 and c["engine_lost"] == 0, c
            wait_until(lambda: sum(stats(st, e).get("kv_store_errors", 0) for e in st.procs) > 0, 10, 0.1,
                       "the engines to count the store's errors (the kill hit their writes)")
            # The store works again on its new primary: a new prompt's chunks are written there.
            store = redis_client(cluster.url, retries=3)
            assert cluster.node_at(store.connection_pool.get_master_address()) is new
            before = len(store.keys("kaiten:kv:*"))
            body = {"prompt": [1] + [(7 * i) % 300 + 3 for i in range(150)], "max_tokens": 4, "temperature": 0}
            with httpx.Client(base_url=st.srv.url, trust_env=False, timeout=60) as client:
                assert client.post("/v1/completions", json=body).status_code == 200
            wait_until(lambda: len(store.keys("kaiten:kv:*")) >= before + 150 // CHUNK, 15, 0.1,
                       "the new prompt's chunks on the new primary")
    finally:
        cluster.stop()
