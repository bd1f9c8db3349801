"""End to end: real engine workers (tiny model, fp32 CPU) + gateways (in-process uvicorn) on Redis.

Clients are the official `openai` SDK, httpx (SSE) and the `websockets` client. Kept short
(max_tokens of a few tokens) so the suite stays within a few minutes on 2 cores.
"""
from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest
import redis

from shared import names
from tests.support.bad_requests import BAD_REQUESTS, is_openai_error
from tests.support.engine_support import e2e_worker, wait_until
from tests.support.gateway_support import openai_client, post_stream, start_gateway, stream_completion
from tests.support.paths import ROOT
from tests.support.redis_server import RedisServer

pytestmark = pytest.mark.timeout(180)

PROMPTS = ["Hello world", "The quick brown fox", "Paris is the capital of", "A paged KV cache"]
CHAT = [{"role": "user", "content": "How are you today?"}]


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    """The offline engine's greedy outputs: the gateway must produce the same text."""
    from engine_worker import LLM, SamplingParams
    llm = LLM(str(tiny_model_dir), dtype="float32", kv_cache_memory="4MiB")
    greedy = SamplingParams(temperature=0, max_tokens=8)
    texts = {p: c.text for p, c in zip(PROMPTS, llm.generate(PROMPTS, greedy))}
    ids40 = [[1, 10 + i, 20 + i, 30 + (i * 7) % 50] for i in range(40)]
    by_ids = [c.text for c in llm.generate(ids40, SamplingParams(temperature=0, max_tokens=6))]
    chat = llm.chat(CHAT, SamplingParams(temperature=0, max_tokens=8))
    return {"texts": texts, "ids40": ids40, "texts40": by_ids, "chat": chat.text, "chat_finish": chat.finish_reason,
            "finish": {p: c.finish_reason for p, c in zip(PROMPTS, llm.generate(PROMPTS, greedy))}}


@pytest.fixture(scope="module")
def stack(tiny_model_dir):
    """One Redis, one engine worker, one gateway for the ordinary tests."""
    server = RedisServer().start()
    w = e2e_worker(server.url, tiny_model_dir, "e2e-main").start()
    srv = start_gateway(server.url, tiny_model_dir, engine_timeout=3.0)
    wait_until(lambda: srv.gw.monitor.live_engines(), 10)
    yield {"server": server, "worker": w, "srv": srv, "r": redis.Redis.from_url(server.url),
           "model": tiny_model_dir.name}
    srv.stop()
    w.stop()
    server.stop()


# ---------------------------------------------------------------------- the OpenAI SDK
def test_openai_sdk_completions(stack, reference):
    client = openai_client(stack["srv"])
    for p in PROMPTS:
        out = client.completions.create(model=stack["model"], prompt=p, max_tokens=8, temperature=0)
        assert out.choices[0].text == reference["texts"][p]
        assert out.choices[0].finish_reason == reference["finish"][p]
        assert out.usage.completion_tokens <= 8 and out.usage.prompt_tokens > 0
    # streamed
    p = PROMPTS[1]
    stream = client.completions.create(model=stack["model"], prompt=p, max_tokens=8, temperature=0, stream=True,
                                       stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == reference["texts"][p]
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens >= 1
    # a prompt given as token ids
    ids = reference["ids40"][0]
    out = client.completions.create(model=stack["model"], prompt=ids, max_tokens=6, temperature=0)
    assert out.choices[0].text == reference["texts40"][0]


def test_openai_sdk_chat(stack, reference):
    client = openai_client(stack["srv"])
    out = client.chat.completions.create(model=stack["model"], messages=CHAT, max_tokens=8, temperature=0)
    assert out.choices[0].message.content == reference["chat"]
    assert out.choices[0].finish_reason == reference["chat_finish"]
    stream = client.chat.completions.create(model=stack["model"], messages=CHAT, max_tokens=8, temperature=0,
                                            stream=True)
    text = "".join((c.choices[0].delta.content or "") for c in stream if c.choices)
    assert text == reference["chat"]
    # logprobs through the real engine, and n > 1 with seeds
    out = client.chat.completions.create(model=stack["model"], messages=CHAT, max_tokens=5, temperature=0,
                                         logprobs=True, top_logprobs=3)
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens
    assert all(len(c.top_logprobs) == 3 and c.logprob <= 0 for c in content)
    assert all(c.logprob == pytest.approx(c.top_logprobs[0].logprob, abs=1e-4) for c in content)  # greedy
    out = client.completions.create(model=stack["model"], prompt="Hello", max_tokens=5, n=3, temperature=1.0,
                                    seed=5, logprobs=2)
    assert sorted(c.index for c in out.choices) == [0, 1, 2]
    assert all(len(c.logprobs.tokens) == len(c.logprobs.top_logprobs) for c in out.choices)
    again = client.completions.create(model=stack["model"], prompt="Hello", max_tokens=5, n=3, temperature=1.0,
                                      seed=5, logprobs=2)
    assert [c.text for c in again.choices] == [c.text for c in out.choices]   # seeded: reproducible


def test_stop_string_with_real_engine(stack, reference):
    text = reference["texts"][PROMPTS[0]]
    # A stop string taken from the middle of the greedy output.
    cut = next((i for i in range(1, len(text) - 1) if text[i].strip()), None)
    if cut is None:
        pytest.skip("greedy output too short for a stop string")
    stop = text[cut:cut + 2]
    client = openai_client(stack["srv"])
    out = client.completions.create(model=stack["model"], prompt=PROMPTS[0], max_tokens=8, temperature=0, stop=[stop])
    assert out.choices[0].text == text[:text.index(stop)]
    assert out.choices[0].finish_reason == "stop"


def test_repetition_penalty_with_real_engine(stack, tiny_model_dir):
    """Sent in extra_body by the SDK, applied by the engine: the offline engine's text with the penalty."""
    from engine_worker import LLM, SamplingParams
    llm = LLM(str(tiny_model_dir), dtype="float32", kv_cache_memory="4MiB")
    prompt = [40, 41, 42, 43] * 6                   # the tiny model's greedy output repeats one token
    want = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12, repetition_penalty=1.8))[0]
    plain = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12))[0]
    assert len(set(plain.token_ids)) < len(set(want.token_ids))
    out = openai_client(stack["srv"]).completions.create(model=stack["model"], prompt=prompt, max_tokens=12,
                                                         temperature=0, extra_body={"repetition_penalty": 1.8})
    assert out.choices[0].text == want.text != plain.text


@pytest.mark.parametrize("name,path,body,status", BAD_REQUESTS, ids=[b[0] for b in BAD_REQUESTS])
def test_malformed_requests(stack, name, path, body, status):
    with httpx.Client(base_url=stack["srv"].url, trust_env=False, timeout=10) as c:
        if isinstance(body, bytes):
            resp = c.post(path, content=body, headers={"content-type": "application/json"})
        else:
            resp = c.post(path, json=body)
    assert resp.status_code == status, resp.text
    assert 400 <= resp.status_code < 500 and is_openai_error(resp.json())


def test_websocket_chat_and_cancel(stack, reference):
    from websockets.sync.client import connect
    with connect(stack["srv"].ws_url + "/v1/chat/ws", proxy=None, open_timeout=5) as ws:
        ws.send(json.dumps({"type": "chat", "id": "a", "messages": CHAT, "max_tokens": 8, "temperature": 0}))
        events = []
        while not events or events[-1]["type"] not in ("done", "error"):
            events.append(json.loads(ws.recv(30)))
        assert events[0]["type"] == "start" and events[-1]["type"] == "done", events
        assert "".join(e["content"] for e in events if e["type"] == "delta") == reference["chat"]
        assert events[-1]["usage"]["completion_tokens"] >= 1
        # cancel a long one
        ws.send(json.dumps({"type": "chat", "id": "b", "messages": CHAT, "max_tokens": 400, "ignore_eos": True}))
        assert json.loads(ws.recv(30))["type"] == "start"
        while json.loads(ws.recv(30))["type"] != "delta":
            pass
        ws.send(json.dumps({"type": "cancel", "id": "b"}))
        while True:
            ev = json.loads(ws.recv(30))
            if ev["type"] == "done":
                break
        assert ev["finish_reason"] == "cancelled" and ev["usage"]["completion_tokens"] < 400
    eng = stack["worker"].worker.engine
    wait_until(lambda: eng.stats().num_running == 0 and not eng.has_unfinished(), 10)


def test_abort_on_disconnect_frees_blocks_within_one_step(stack):
    w = stack["worker"].worker
    engine = w.engine
    events: dict = {}
    orig_abort, orig_route = w._abort, w._route

    def spy_abort(rid):
        events.setdefault("abort_read_at_step", engine.step_count)
        return orig_abort(rid)

    def spy_route(outputs):
        for o in outputs:
            if o.finish_reason == "abort":
                events["abort_output_at_step"] = engine.step_count
                events["stats"] = engine.stats()
        return orig_route(outputs)

    w._abort, w._route = spy_abort, spy_route
    try:
        with httpx.Client(base_url=stack["srv"].url, trust_env=False, timeout=30) as c:
            with c.stream("POST", "/v1/completions", json={"prompt": "Hello", "max_tokens": 400, "ignore_eos": True,
                                                           "stream": True}) as resp:
                got = 0
                for line in resp.iter_lines():
                    if line.startswith("data:"):
                        got += 1
                        if got == 3:
                            assert engine.stats().num_free_blocks < engine.stats().num_blocks
                            break
        wait_until(lambda: "abort_output_at_step" in events, 10)
        assert events["abort_output_at_step"] - events["abort_read_at_step"] <= 1
        st = events["stats"]
        assert st.num_running == 0 and st.num_free_blocks == st.num_blocks, st
    finally:
        w._abort, w._route = orig_abort, orig_route


def test_garbage_stream_entry_is_dead_lettered(stack):
    r = stack["r"]
    stream = names.request_stream(stack["model"])
    r.xadd(stream, {names.PAYLOAD_FIELD: b"\x93garbage"})
    r.xadd(stream, {b"other": b"field"})
    wait_until(lambda: r.xlen(names.DEAD_LETTER_STREAM) >= 2, 15)
    client = openai_client(stack["srv"])
    out = client.completions.create(model=stack["model"], prompt="Hello", max_tokens=3, temperature=0)
    assert out.choices[0].finish_reason in ("length", "stop")


def test_models_ready_status_metrics(stack):
    with httpx.Client(base_url=stack["srv"].url, trust_env=False, timeout=10) as c:
        assert c.get("/ready").status_code == 200
        assert c.get("/v1/models").json()["data"][0]["id"] == stack["model"]
        st = c.get("/v1/status").json()
        assert st["engines"] == 1 and st["model"] == stack["model"]
        text = c.get("/metrics").text
        assert "kaiten:e2e_request_latency_seconds_count" in text and "kaiten:generation_tokens_total" in text


# ---------------------------------------------------------------------- two gateways, two engines
def test_two_gateways_two_engines_40_concurrent_streams(tiny_model_dir, reference):
    server = RedisServer().start()
    workers = [e2e_worker(server.url, tiny_model_dir, f"e2e-w{i}", engine_kw={"max_num_seqs": 8}).start()
               for i in range(2)]
    gws = [start_gateway(server.url, tiny_model_dir) for _ in range(2)]
    try:
        for g in gws:
            wait_until(lambda: len(g.gw.monitor.live_engines()) == 2, 10)

        async def one(i: int, client: httpx.AsyncClient):
            body = {"prompt": reference["ids40"][i], "max_tokens": 6, "temperature": 0, "stream": True}
            out = await stream_completion(client, body)
            assert not out["errors"], out["errors"]
            return out["text"], out["finish"], out["done"]

        async def main():
            clients = [httpx.AsyncClient(base_url=g.url, trust_env=False, timeout=60,
                                         limits=httpx.Limits(max_connections=40)) for g in gws]
            try:
                return await asyncio.gather(*(one(i, clients[i % 2]) for i in range(40)))
            finally:
                for c in clients:
                    await c.aclose()

        results = asyncio.run(main())
        for i, (text, finish, done) in enumerate(results):
            assert done and finish in ("length", "stop"), (i, results[i])
            assert text == reference["texts40"][i], i
        served = [w.worker.counters["requests"] for w in workers]
        assert all(n > 0 for n in served), served
        assert sum(served) == 40
    finally:
        for g in gws:
            g.stop()
        for w in workers:
            w.stop()
        server.stop()


# ---------------------------------------------------------------------- failures
def _engine_process(url, model_dir, engine_id, *extra):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    return subprocess.Popen(
        [sys.executable, "-m", "shared.cli", "engine", "--model", str(model_dir), "--redis-url", url,
         "--engine-id", engine_id, "--dtype", "float32", "--kv-cache-memory", "4MiB", "--heartbeat-interval", "0.2",
         "--heartbeat-ttl", "1.5", "--idle-block-ms", "20", "--num-threads", "1", *extra],
        cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def test_sigkill_engine_its_streams_continue_and_the_other_serves_the_queue(tiny_model_dir, reference):
    server = RedisServer().start()
    r = redis.Redis.from_url(server.url)
    proc = _engine_process(server.url, tiny_model_dir, "victim", "--max-num-seqs", "2")
    srv = start_gateway(server.url, tiny_model_dir, engine_timeout=1.5)
    survivor = None
    try:
        wait_until(lambda: r.exists(names.heartbeat_key("victim")) or proc.poll() is not None, 60)
        assert proc.poll() is None
        wait_until(lambda: srv.gw.monitor.live_engines(), 10)
        # The survivor is loaded now but starts consuming only once the victim is killed.
        survivor = e2e_worker(server.url, tiny_model_dir, "survivor")
        long_results: dict[int, list] = {}
        first_token = [threading.Event(), threading.Event()]

        def long_stream(k):
            with httpx.Client(base_url=srv.url, trust_env=False, timeout=60) as c:
                with c.stream("POST", "/v1/completions", json={
                        "prompt": "Hello", "max_tokens": 480, "ignore_eos": True, "stream": True}) as resp:
                    evs = []
                    for line in resp.iter_lines():
                        if line.startswith("data:"):
                            evs.append(line[5:].strip())
                            first_token[k].set()
                    long_results[k] = evs

        threads = [threading.Thread(target=long_stream, args=(k,)) for k in range(2)]
        for t in threads:
            t.start()
        for e in first_token:
            assert e.wait(60)
        short_results: dict[str, object] = {}

        def short(p):
            with httpx.Client(base_url=srv.url, trust_env=False, timeout=60) as c:
                short_results[p] = c.post("/v1/completions", json={"prompt": p, "max_tokens": 8, "temperature": 0})

        shorts = [threading.Thread(target=short, args=(p,)) for p in PROMPTS]
        for t in shorts:
            t.start()
        # The victim holds the two long streams (its max_num_seqs); the shorts are queued behind.
        wait_until(lambda: len(srv.gw.router.streams) >= 2 + len(PROMPTS), 10, 0.005)
        assert r.xpending(srv.gw.models.default.stream, names.ENGINE_GROUP)["pending"] == 2   # still running
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        survivor.start()
        for t in threads + shorts:
            t.join(60)
        for k in range(2):      # continued on the survivor (failover), unbroken
            evs = long_results[k]
            assert evs[-1] == "[DONE]" and not any('"error"' in e for e in evs), evs[-3:]
            assert json.loads(evs[-2])["choices"][0]["finish_reason"] == "length"
        assert srv.gw.router.counters["failovers"] == 2
        for p in PROMPTS:
            resp = short_results[p]
            assert resp.status_code == 200, resp.text
            assert resp.json()["choices"][0]["text"] == reference["texts"][p]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        srv.stop()
        if survivor is not None and survivor.thread.is_alive():
            survivor.stop()
        server.stop()


def test_redis_restart_empty_recovers_without_restarts(tiny_model_dir, reference):
    server = RedisServer().start()
    w = e2e_worker(server.url, tiny_model_dir, "e2e-restart").start()
    srv = start_gateway(server.url, tiny_model_dir, engine_timeout=2.0)
    try:
        with httpx.Client(base_url=srv.url, trust_env=False, timeout=30) as c:
            wait_until(lambda: c.get("/ready").status_code == 200, 10)
            body = {"prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0}
            assert c.post("/v1/completions", json=body).json()["choices"][0]["text"] == reference["texts"][PROMPTS[0]]
            # A stream in flight while Redis restarts goes on as a continuation (test_failover.py
            # checks the texts), neither a hang nor an error.
            result = {}

            def long_stream():
                result["v"] = post_stream(c, "/v1/completions", {"prompt": "Hello", "max_tokens": 480,
                                                                 "ignore_eos": True, "stream": True})
            t = threading.Thread(target=long_stream)
            t.start()
            wait_until(lambda: srv.gw.router.streams, 10)
            time.sleep(0.2)
            server.restart_empty()
            t.join(30)
            assert not t.is_alive()
            status, events = result["v"]
            assert events[-1] == "[DONE]" and "error" not in events[-2], events[-3:]
            assert events[-2]["choices"][0]["finish_reason"] == "length"
            # New requests succeed once the worker is back on the new Redis (no process restarted).
            deadline = time.monotonic() + 30
            while True:
                resp = c.post("/v1/completions", json=body)
                if resp.status_code == 200:
                    break
                assert resp.status_code in (503, 429), resp.text
                assert time.monotonic() < deadline, resp.text
                time.sleep(0.3)
            assert resp.json()["choices"][0]["text"] == reference["texts"][PROMPTS[0]]
            chat = c.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 8, "temperature": 0})
            assert chat.status_code == 200 and chat.json()["choices"][0]["message"]["content"] == reference["chat"]
            assert c.get("/ready").status_code == 200
    finally:
        srv.stop()
        w.stop()
        server.stop()
