"""The shared KV store end to end (issue 63): two real engine processes (the tiny model, steps
slowed) share a second real Redis as their KV store, behind an in-process gateway.

- A stream whose engine is SIGKILLed continues on the other engine, which loads the stream's KV
  (prompt and the tokens delivered, written chunk by chunk as they were computed) and computes at
  most the chunks the dead engine had not written yet; every text equals an uninterrupted run.
- A prefix computed on one engine is loaded on the other, greedy output equal; then the store is
  killed, and the next request is computed, its output equal too."""
from __future__ import annotations

import signal

import httpx
import msgpack
import pytest

from shared import names
from tests.support.engine_cluster import (N_TOKENS, PROMPTS, check_sequences, check_streams, run_sse_clients,
                                          two_engines_and_a_gateway, wait_engines)
from tests.support.engine_support import wait_until
from tests.support.redis_server import RedisServer

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
        b = stats(st, "eng-b")
        # Each continuation's prompt is >= 125 tokens; what eng-b computed of them is at most the
        # chunks eng-a had not written when it died (its last, and one still in its write queue).
        assert b["kv_store_hit_chunks"] >= 4 * 2, b
        assert b["kv_store_loaded_tokens"] >= 4 * (125 - 3 * CHUNK), b


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
