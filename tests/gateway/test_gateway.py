"""Gateway tests on a real Redis with a scripted fake engine (no model, no torch in the gateway)."""
from __future__ import annotations

import json
import subprocess
import sys
import time

import httpx
import msgpack
import pytest
import redis

from shared import names
from shared.protocol import Abort, decode
from tests.support.bad_requests import BAD_REQUESTS, is_openai_error
from tests.support.engine_support import wait_until
from tests.support.gateway_support import FakeEngine, default_tokens, post_stream, start_gateway

pytestmark = pytest.mark.timeout(120)

FOX = "The quick brown fox jumps over the lazy dog."


@pytest.fixture(scope="module")
def env(redis_server, tiny_model_dir):
    """One Redis, one fake engine, one gateway for the module's ordinary tests."""
    r = redis.Redis.from_url(redis_server.url)
    r.flushall()
    scripts: dict[str, object] = {}

    eng = FakeEngine(redis_server.url, model=tiny_model_dir.name)

    def script(req):
        for key, fn in scripts.items():
            if key in json.dumps(req.params) or key in str(req.prompt_token_ids):
                return fn(req)
        return eng.default_script(req)

    eng.script = script
    eng.start()
    srv = start_gateway(redis_server.url, tiny_model_dir, engine_timeout=2.0)
    client = httpx.Client(base_url=srv.url, timeout=30, trust_env=False)
    yield {"srv": srv, "eng": eng, "client": client, "r": r, "scripts": scripts, "model": tiny_model_dir.name,
           "url": redis_server.url, "model_dir": tiny_model_dir}
    client.close()
    srv.stop()
    eng.stop()


@pytest.fixture
def own_redis():
    """A Redis of the test's own (the module's fake engine keeps consuming the shared one)."""
    from tests.support.redis_server import RedisServer
    server = RedisServer().start()
    yield server
    server.stop()


@pytest.fixture
def tok(tiny_model_dir):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(tiny_model_dir))


# ---------------------------------------------------------------------- bad input
@pytest.mark.parametrize("name,path,body,status", BAD_REQUESTS, ids=[b[0] for b in BAD_REQUESTS])
def test_bad_requests(env, name, path, body, status):
    c = env["client"]
    stream = names.request_stream(env["model"])
    before = env["r"].xlen(stream)
    if isinstance(body, bytes):
        resp = c.post(path, content=body, headers={"content-type": "application/json"})
    else:
        resp = c.post(path, json=body)
    assert resp.status_code == status, resp.text
    assert is_openai_error(resp.json()), resp.text
    assert env["r"].xlen(stream) == before, "a bad request must not be queued"


def test_bad_input_table_is_large():
    assert len(BAD_REQUESTS) >= 30


def test_wrong_routes_and_methods(env):
    c = env["client"]
    r = c.get("/v1/completions")
    assert r.status_code == 405 and is_openai_error(r.json())
    r = c.post("/v1/nothing", json={})
    assert r.status_code == 404 and is_openai_error(r.json())
    r = c.delete("/v1/chat/completions")
    assert r.status_code == 405 and is_openai_error(r.json())


def test_oversized_body(own_redis, tiny_model_dir):
    eng = FakeEngine(own_redis.url, engine_id="fake-413", model=tiny_model_dir.name).start()
    srv = start_gateway(own_redis.url, tiny_model_dir, max_body_bytes=1000)
    try:
        with httpx.Client(base_url=srv.url, trust_env=False, timeout=10) as c:
            r = c.post("/v1/completions", json={"prompt": "x" * 5000})
            assert r.status_code == 413 and is_openai_error(r.json())
            # Chunked upload without Content-Length is cut off too.
            r = c.post("/v1/completions", content=iter([b'{"prompt": "', b"x" * 4000, b'"}']))
            assert r.status_code == 413 and is_openai_error(r.json())
            assert c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 200
    finally:
        srv.stop()
        eng.stop()


# ---------------------------------------------------------------------- happy paths
def test_health_ready_models_status(env):
    c = env["client"]
    assert c.get("/health").json()["status"] == "ok"
    r = c.get("/ready")
    assert r.status_code == 200, r.text
    models = c.get("/v1/models").json()
    assert models["object"] == "list" and models["data"][0]["id"] == env["model"]
    assert c.get(f"/v1/models/{env['model']}").status_code == 200
    assert c.get("/v1/models/nope").status_code == 404
    st = c.get("/v1/status").json()
    for key in ("model", "engines", "num_requests_running", "num_requests_waiting", "kv_cache_usage"):
        assert key in st
    assert st["engines"] >= 1 and st["model"] == env["model"]


def test_completion_not_streamed(env, tok):
    r = env["client"].post("/v1/completions", json={"model": env["model"], "prompt": "Hello world", "max_tokens": 6})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    ch = body["choices"][0]
    assert ch["text"] == tok.decode(default_tokens(6)) and ch["finish_reason"] == "length"
    n_prompt = len(tok.encode("Hello world", add_special_tokens=False))
    assert body["usage"]["prompt_tokens"] == n_prompt
    assert body["usage"]["completion_tokens"] == 6 and body["usage"]["total_tokens"] == n_prompt + 6


def test_completion_streamed_with_usage(env, tok):
    status, events = post_stream(env["client"], "/v1/completions",
                                 {"prompt": "Hello", "max_tokens": 5, "stream": True,
                                  "stream_options": {"include_usage": True}})
    assert status == 200
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    assert text == tok.decode(default_tokens(5))
    finals = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert finals == ["length"]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 5
    assert all(c["usage"] is None for c in chunks[:-1])


def test_chat_streamed_and_not(env, tok):
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    r = env["client"].post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 4})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"] == {"role": "assistant", "content": tok.decode(default_tokens(4))}
    ids = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert body["usage"]["prompt_tokens"] == len(ids)
    assert env["eng"].requests[body["id"]].req.prompt_token_ids == list(ids)

    status, events = post_stream(env["client"], "/v1/chat/completions",
                                 {"messages": msgs, "max_tokens": 4, "stream": True})
    assert status == 200 and events[-1] == "[DONE]"
    chunks = events[:-1]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert text == body["choices"][0]["message"]["content"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_params_reach_the_engine_as_sampling_params(env):
    from engine_worker.engine.sampling_params import SamplingParams
    r = env["client"].post("/v1/completions", json={
        "prompt": [5, 6, 7], "max_tokens": 3, "temperature": 0.5, "top_p": 0.9, "top_k": 7, "seed": 11,
        "stop_token_ids": [2, 9], "presence_penalty": 0.5, "frequency_penalty": -0.5, "logprobs": 2})
    assert r.status_code == 200, r.text
    req = env["eng"].requests[r.json()["id"]].req
    assert req.prompt_token_ids == [5, 6, 7]
    sp = SamplingParams.from_dict(req.params)
    assert (sp.temperature, sp.top_p, sp.top_k, sp.seed, sp.max_tokens) == (0.5, 0.9, 7, 11, 3)
    assert sp.stop_token_ids == [2, 9] and sp.logprobs == 2
    assert sp.presence_penalty == 0.5 and sp.frequency_penalty == -0.5


def test_n_choices_fan_out_with_distinct_seeds(env):
    r = env["client"].post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "n": 3, "seed": 7})
    assert r.status_code == 200, r.text
    body = r.json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    seeds = sorted(env["eng"].requests[f"{body['id']}-{i}"].req.params["seed"] for i in range(3))
    assert seeds == [7, 8, 9]
    assert body["usage"]["completion_tokens"] == 6
    # Without a seed, n > 1 still gets n distinct seeds.
    r = env["client"].post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}],
                                                         "max_tokens": 2, "n": 4})
    body = r.json()
    seeds = {env["eng"].requests[f"{body['id']}-{i}"].req.params["seed"] for i in range(4)}
    assert len(seeds) == 4 and len(body["choices"]) == 4
    # Streamed: every index finishes once.
    status, events = post_stream(env["client"], "/v1/completions",
                                 {"prompt": ["a", "b"], "max_tokens": 3, "n": 2, "stream": True})
    finished = sorted(c["choices"][0]["index"] for c in events[:-1] if c["choices"][0]["finish_reason"])
    assert finished == [0, 1, 2, 3]


def _text_script(tok, text, finish="length"):
    ids = tok.encode(text, add_special_tokens=False)

    def script(req):
        steps = [{"token_ids": [t]} for t in ids]
        steps += [{"sleep": 0.5}, {"token_ids": [ids[0]], "finish_reason": finish}]
        return steps
    return script


@pytest.mark.parametrize("stream", [False, True])
def test_stop_strings_truncate_and_abort(env, tok, stream):
    env["scripts"]["7771"] = _text_script(tok, FOX)
    body = {"prompt": [7771 % 300, 77], "max_tokens": 50, "stop": ["zzz", "fox j"], "seed": 7771, "stream": stream}
    # (the seed routes the request to the script)
    if stream:
        status, events = post_stream(env["client"], "/v1/completions", body)
        assert status == 200 and events[-1] == "[DONE]"
        pieces = [c["choices"][0]["text"] for c in events[:-1]]
        assert all("fox" not in p for p in pieces)
        text = "".join(pieces)
        finish = [c["choices"][0]["finish_reason"] for c in events[:-1] if c["choices"][0]["finish_reason"]]
        rid = events[0]["id"]
    else:
        r = env["client"].post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        text, finish, rid = r.json()["choices"][0]["text"], [r.json()["choices"][0]["finish_reason"]], r.json()["id"]
    assert text == "The quick brown "
    assert finish == ["stop"]
    # The engine was still generating: the gateway aborted it.
    wait_until(lambda: rid in env["eng"].aborts, 5)


def test_stop_string_in_chat_across_tokens(env, tok):
    env["scripts"]["7772"] = _text_script(tok, FOX)
    r = env["client"].post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "x"}], "max_tokens": 40, "stop": "lazy", "seed": 7772})
    assert r.json()["choices"][0]["message"]["content"] == "The quick brown fox jumps over the "
    assert r.json()["choices"][0]["finish_reason"] == "stop"


def test_eos_finish_flushes_held_back_text(env, tok):
    env["scripts"]["7773"] = lambda req: [{"token_ids": [t]} for t in tok.encode("ab", add_special_tokens=False)] + [
        {"token_ids": [2], "finish_reason": "stop"}]
    r = env["client"].post("/v1/completions", json={"prompt": "x", "max_tokens": 10, "stop": ["abc"], "seed": 7773})
    assert r.json()["choices"][0]["text"] == "ab"
    assert r.json()["choices"][0]["finish_reason"] == "stop"


def _lp_script(tok):
    ids = tok.encode("Hello world", add_special_tokens=False)

    def script(req):
        steps = []
        for i, t in enumerate(ids):
            steps.append({"token_ids": [t], "logprobs": [{"token_id": t, "logprob": -0.5 - i,
                                                          "top": [[t, -0.5 - i], [3, -2.0], [4, -3.0]]}]})
        steps[-1]["finish_reason"] = "length"
        return steps
    return script, ids


def test_logprobs_both_shapes(env, tok):
    script, ids = _lp_script(tok)
    env["scripts"]["7774"] = script
    r = env["client"].post("/v1/completions", json={"prompt": "x", "max_tokens": 10, "logprobs": 2, "seed": 7774})
    lp = r.json()["choices"][0]["logprobs"]
    assert lp["tokens"] == [tok.decode([t]) for t in ids]
    assert lp["token_logprobs"] == [-0.5 - i for i in range(len(ids))]
    assert len(lp["top_logprobs"]) == len(ids) and len(lp["top_logprobs"][0]) == 2
    assert lp["text_offset"][0] == 0 and lp["text_offset"][1] == len(lp["tokens"][0])
    assert env["eng"].requests[r.json()["id"]].req.params["logprobs"] == 2

    r = env["client"].post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "x"}], "max_tokens": 10, "logprobs": True, "top_logprobs": 2,
        "seed": 7774})
    content = r.json()["choices"][0]["logprobs"]["content"]
    assert [c["token"] for c in content] == [tok.decode([t]) for t in ids]
    assert content[0]["logprob"] == -0.5 and content[0]["bytes"] == list(content[0]["token"].encode())
    assert len(content[0]["top_logprobs"]) == 2 and content[0]["top_logprobs"][1]["logprob"] == -2.0

    status, events = post_stream(env["client"], "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "x"}], "max_tokens": 10, "logprobs": True, "seed": 7774,
        "stream": True})
    streamed = [c for e in events[:-1] for ch in e["choices"] if ch["logprobs"] for c in ch["logprobs"]["content"]]
    assert [c["token"] for c in streamed] == [tok.decode([t]) for t in ids]
    assert all(c["top_logprobs"] == [] for c in streamed)


def test_echo(env, tok):
    r = env["client"].post("/v1/completions", json={"prompt": "Hello", "max_tokens": 2, "echo": True})
    assert r.json()["choices"][0]["text"] == "Hello" + tok.decode(default_tokens(2))


def test_duplicate_seq_is_dropped(env, tok):
    ids = tok.encode("Hello world", add_special_tokens=False)
    env["scripts"]["7775"] = lambda req: [{"token_ids": [ids[0]]}, {"token_ids": [ids[0]], "seq": 0},
                                          {"token_ids": ids[1:], "seq": 1, "finish_reason": "length"}]
    r = env["client"].post("/v1/completions", json={"prompt": "x", "max_tokens": 10, "seed": 7775})
    assert r.json()["choices"][0]["text"] == "Hello world"


# ---------------------------------------------------------------------- failures end with an error
@pytest.mark.parametrize("stream", [False, True])
def test_sequence_gap_is_an_error(env, stream):
    env["scripts"]["7776"] = lambda req: [{"token_ids": [50]}, {"token_ids": [51], "seq": 3},
                                          {"token_ids": [52], "seq": 4, "finish_reason": "length"}]
    body = {"prompt": "x", "max_tokens": 10, "seed": 7776, "stream": stream}
    if stream:
        status, events = post_stream(env["client"], "/v1/completions", body)
        assert events[-1] == "[DONE]"
        err = events[-2]
        assert is_openai_error(err) and err["error"]["code"] == "stream_gap"
    else:
        r = env["client"].post("/v1/completions", json=body)
        assert r.status_code >= 500 and is_openai_error(r.json())
        assert r.json()["error"]["code"] == "stream_gap"


def test_engine_error_delta(env):
    env["scripts"]["7777"] = lambda req: [{"token_ids": [], "finish_reason": "error", "error": "bad params"}]
    r = env["client"].post("/v1/completions", json={"prompt": "x", "max_tokens": 3, "seed": 7777})
    assert r.status_code == 400 and "bad params" in r.json()["error"]["message"]
    env["scripts"]["7778"] = lambda req: [{"token_ids": [50]}, {"token_ids": [], "finish_reason": "error",
                                                                  "error": "engine exploded"}]
    r = env["client"].post("/v1/completions", json={"prompt": "x", "max_tokens": 3, "seed": 7778})
    assert r.status_code == 500 and "engine exploded" in r.json()["error"]["message"]


def test_garbage_on_reply_channel_is_ignored(env):
    gw_id = env["srv"].gw.gateway_id
    env["r"].publish(names.reply_channel(gw_id), b"\xc1garbage")
    env["r"].publish(names.reply_channel(gw_id), msgpack.packb({"v": 1, "t": "tokens", "deltas": "x"}))
    r = env["client"].post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
    assert r.status_code == 200


def test_metrics(env):
    env["client"].post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
    text = env["client"].get("/metrics").text
    for name in ("kaiten:time_to_first_token_seconds_bucket", "kaiten:inter_token_latency_seconds_bucket",
                 "kaiten:e2e_request_latency_seconds_count", "kaiten:prompt_tokens_total",
                 "kaiten:generation_tokens_total", 'kaiten:request_success_total{finished_reason="length"'):
        assert name in text, name
    # The engines' series are the engines' own (engine_worker/metrics.py), never re-exported here.
    for name in ("kaiten:num_requests_running", "kaiten:num_requests_waiting", "kaiten:kv_cache_usage_perc"):
        assert name not in text, name


# ---------------------------------------------------------------------- disconnects abort
def test_streaming_client_disconnect_aborts(env):
    env["scripts"]["7779"] = lambda req: [{"token_ids": [50]}] * 400 + [{"token_ids": [50], "finish_reason": "length"}]
    with httpx.Client(base_url=env["srv"].url, timeout=10, trust_env=False) as c:
        with c.stream("POST", "/v1/completions", json={"prompt": "x", "max_tokens": 450, "seed": 7779,
                                                       "stream": True}) as resp:
            lines = resp.iter_lines()
            first = next(l for l in lines if l.startswith("data:"))
            rid = json.loads(first[5:])["id"]
    wait_until(lambda: rid in env["eng"].aborts, 5)
    wait_until(lambda: rid not in env["srv"].gw.router.streams, 5)
    raw = env["r"].xrange(names.ABORT_STREAM)
    msgs = [decode(f[names.PAYLOAD_FIELD]) for _, f in raw]
    assert any(isinstance(m, Abort) and m.request_id == rid and m.reply_to == env["srv"].gw.gateway_id for m in msgs)


def test_unstreamed_client_disconnect_aborts(env):
    env["scripts"]["7780"] = lambda req: [{"token_ids": [50]}] * 400 + [{"token_ids": [50], "finish_reason": "length"}]
    with pytest.raises(httpx.ReadTimeout):
        with httpx.Client(base_url=env["srv"].url, timeout=0.5, trust_env=False) as c:
            c.post("/v1/completions", json={"prompt": "x", "max_tokens": 450, "seed": 7780})
    rid = wait_until(lambda: next((rid for rid, fr in env["eng"].requests.items()
                                 if fr.req.params.get("seed") == 7780), None), 5)
    wait_until(lambda: rid in env["eng"].aborts, 5)


# ---------------------------------------------------------------------- WebSocket
def test_websocket_chat_cancel_and_close(env, tok):
    from websockets.sync.client import connect
    env["scripts"]["7781"] = lambda req: [{"token_ids": [50]}] * 300 + [{"token_ids": [50], "finish_reason": "length"}]
    url = env["srv"].ws_url + "/v1/chat/ws"
    with connect(url, proxy=None, open_timeout=5) as ws:
        ws.send(json.dumps({"type": "ping"}))
        assert json.loads(ws.recv(5)) == {"type": "pong"}
        ws.send(json.dumps({"type": "chat", "id": "c1", "messages": [{"role": "user", "content": "hi"}],
                            "max_tokens": 4, "temperature": 0}))
        events = []
        while True:
            ev = json.loads(ws.recv(10))
            events.append(ev)
            if ev["type"] in ("done", "error"):
                break
        assert events[0]["type"] == "start" and events[0]["id"] == "c1" and events[0]["model"] == env["model"]
        assert "".join(e["content"] for e in events if e["type"] == "delta") == tok.decode(default_tokens(4))
        done = events[-1]
        assert done["type"] == "done" and done["finish_reason"] == "length"
        assert done["usage"]["completion_tokens"] == 4
        assert set(done["metrics"]) == {"ttft_s", "tokens_per_second", "e2e_s"}

        # cancel a long generation
        ws.send(json.dumps({"type": "chat", "id": "c2", "messages": [{"role": "user", "content": "hi"}],
                            "max_tokens": 400, "seed": 7781}))
        start = json.loads(ws.recv(10))
        assert start["type"] == "start"
        rid = start["request_id"]
        json.loads(ws.recv(10))        # a delta
        ws.send(json.dumps({"type": "cancel", "id": "c2"}))
        while True:
            ev = json.loads(ws.recv(10))
            if ev["type"] == "done":
                break
            assert ev["type"] == "delta"
        assert ev["finish_reason"] == "cancelled"
        wait_until(lambda: rid in env["eng"].aborts, 5)

        # errors: bad frame, bad request, unknown type
        ws.send("not json")
        ev = json.loads(ws.recv(5))
        assert ev["type"] == "error" and ev["id"] is None and ev["status"] == 400
        ws.send(json.dumps({"type": "chat", "id": "c3", "messages": []}))
        ev = json.loads(ws.recv(5))
        assert ev["type"] == "error" and ev["id"] == "c3" and ev["status"] == 400 and ev["error"]["message"]
        ws.send(json.dumps({"type": "nope", "id": "c4"}))
        assert json.loads(ws.recv(5))["type"] == "error"

        # closing the socket aborts what it carries
        ws.send(json.dumps({"type": "chat", "id": "c5", "messages": [{"role": "user", "content": "hi"}],
                            "max_tokens": 400, "seed": 7781}))
        rid5 = json.loads(ws.recv(10))["request_id"]
    wait_until(lambda: rid5 in env["eng"].aborts, 5)


# ---------------------------------------------------------------------- dedicated gateways
def test_auth(own_redis, tiny_model_dir):
    from websockets.sync.client import connect
    eng = FakeEngine(own_redis.url, engine_id="fake-auth", model=tiny_model_dir.name).start()
    srv = start_gateway(own_redis.url, tiny_model_dir, api_keys=("key-one", "key-two"))
    try:
        with httpx.Client(base_url=srv.url, trust_env=False, timeout=10) as c:
            body = {"prompt": "hi", "max_tokens": 2}
            r = c.post("/v1/completions", json=body)
            assert r.status_code == 401 and is_openai_error(r.json())
            r = c.post("/v1/completions", json=body, headers={"Authorization": "Bearer wrong"})
            assert r.status_code == 401
            r = c.post("/v1/completions", json=body, headers={"Authorization": "Basic key-one"})
            assert r.status_code == 401
            assert c.get("/v1/models").status_code == 401
            for key in ("key-one", "key-two"):
                r = c.post("/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"})
                assert r.status_code == 200, r.text
            assert c.get("/health").status_code == 200
            assert c.get("/metrics").status_code == 200
        with connect(srv.ws_url + "/v1/chat/ws", proxy=None) as ws:
            ev = json.loads(ws.recv(5))
            assert ev["type"] == "error" and ev["status"] == 401
        with connect(srv.ws_url + "/v1/chat/ws", proxy=None,
                     additional_headers={"Authorization": "Bearer key-two"}) as ws:
            ws.send(json.dumps({"type": "ping"}))
            assert json.loads(ws.recv(5))["type"] == "pong"
    finally:
        srv.stop()
        eng.stop()


def test_admission_control(own_redis, tiny_model_dir):
    r = redis.Redis.from_url(own_redis.url)
    srv = start_gateway(own_redis.url, tiny_model_dir, max_queued_requests=10, max_queued_tokens=1000)
    c = httpx.Client(base_url=srv.url, trust_env=False, timeout=10)
    body = {"prompt": "hi", "max_tokens": 2}
    try:
        # No engine: 503 with Retry-After.
        resp = c.post("/v1/completions", json=body)
        assert resp.status_code == 503 and "retry-after" in resp.headers and is_openai_error(resp.json())
        assert c.get("/ready").status_code == 503
        # An engine reporting a full queue: 429.
        eng = FakeEngine(own_redis.url, engine_id="fake-busy", model=tiny_model_dir.name, hb={"num_waiting": 50})
        eng.start()
        try:
            # the model's view, not live_engines(): a poll publishes its views after the engine table
            wait_until(lambda: srv.gw.monitor.view(tiny_model_dir.name).live, 5)
            resp = c.post("/v1/completions", json=body)
            assert resp.status_code == 429 and int(resp.headers["retry-after"]) >= 1, resp.text
            assert resp.json()["error"]["type"] == "rate_limit_error"
            # admission reads the model's view, which a poll publishes after monitor.load()'s table
            view_tokens = lambda: srv.gw.monitor.view(tiny_model_dir.name).load.get("num_waiting_tokens")  # noqa: E731
            eng.set_heartbeat(num_waiting=1, num_waiting_tokens=5000)
            wait_until(lambda: view_tokens() == 5000, 5)
            assert c.post("/v1/completions", json=body).status_code == 429
            eng.set_heartbeat()
            wait_until(lambda: view_tokens() == 0, 5)
            assert c.post("/v1/completions", json=body).status_code == 200
        finally:
            eng.stop()
        # The undelivered backlog counts too: a live engine that does not consume.
        idle = FakeEngine(own_redis.url, engine_id="fake-idle", model=tiny_model_dir.name)
        idle.heartbeat()
        for i in range(12):
            r.xadd(names.request_stream(tiny_model_dir.name), {names.PAYLOAD_FIELD: b"backlog"})
        wait_until(lambda: srv.gw.monitor.backlog.lag >= 12 and srv.gw.monitor.view(tiny_model_dir.name).live, 5)
        resp = c.post("/v1/completions", json=body)
        assert resp.status_code == 429, resp.text
    finally:
        c.close()
        srv.stop()


def test_engine_lost_mid_request(own_redis, tiny_model_dir):
    eng = FakeEngine(own_redis.url, engine_id="fake-dies", model=tiny_model_dir.name,
                     script=lambda req: [{"token_ids": [50]}, {"stop_heartbeat": True}, {"hang": True}]).start()
    # No failover (test_failover.py has it): the client gets engine_lost once the engine is silent.
    srv = start_gateway(own_redis.url, tiny_model_dir, engine_timeout=1.0, max_failovers=0, failover_timeout=1.0)
    try:
        with httpx.Client(base_url=srv.url, trust_env=False, timeout=20) as c:
            t0 = time.monotonic()
            status, events = post_stream(c, "/v1/completions", {"prompt": "x", "max_tokens": 5, "stream": True})
            assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "engine_lost"
            assert time.monotonic() - t0 < 6
            eng.heartbeat_on = True
            eng.heartbeat()
            wait_until(lambda: srv.gw.monitor.live_engines(), 5)
            resp = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 5})
            assert resp.status_code == 503 and resp.json()["error"]["code"] == "engine_lost"
    finally:
        srv.stop()
        eng.stop()


def test_queued_request_fails_when_no_engine_is_left(own_redis, tiny_model_dir):
    eng = FakeEngine(own_redis.url, engine_id="fake-vanishes", model=tiny_model_dir.name,
                     script=lambda req: [{"stop_heartbeat": True}, {"hang": True}]).start()
    srv = start_gateway(own_redis.url, tiny_model_dir, engine_timeout=1.0)
    try:
        with httpx.Client(base_url=srv.url, trust_env=False, timeout=20) as c:
            resp = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 5})
            assert resp.status_code == 503 and resp.json()["error"]["code"] == "engine_lost"
    finally:
        srv.stop()
        eng.stop()


def test_deadline(own_redis, tiny_model_dir):
    eng = FakeEngine(own_redis.url, engine_id="fake-slow", model=tiny_model_dir.name,
                     script=lambda req: [{"token_ids": [50]}] + [{"sleep": 0.1}, {"token_ids": [51]}] * 100).start()
    srv = start_gateway(own_redis.url, tiny_model_dir, request_timeout=1.0)
    try:
        with httpx.Client(base_url=srv.url, trust_env=False, timeout=20) as c:
            resp = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 300})
            assert resp.status_code == 504 and resp.json()["error"]["code"] == "timeout"
            status, events = post_stream(c, "/v1/completions", {"prompt": "x", "max_tokens": 300, "stream": True})
            assert events[-2]["error"]["code"] == "timeout" and events[-1] == "[DONE]"
    finally:
        srv.stop()
        eng.stop()


@pytest.mark.parametrize("grace", [10.0, 0.0])
def test_lost_subscription_continues_or_fails_in_flight_requests(own_redis, tiny_model_dir, grace):
    """redis-py silently reconnects and re-subscribes a killed pub/sub connection: the gateway
    notices and continues what was in flight as continuations (tokens published meanwhile may be
    lost), or with redis_grace 0 fails it; either way it serves new requests."""
    r = redis.Redis.from_url(own_redis.url)
    eng = FakeEngine(own_redis.url, engine_id="fake-resub", model=tiny_model_dir.name,
                     script=lambda req: [{"token_ids": [50]}] + [{"sleep": 0.05}, {"token_ids": [51]}] * 40
                     + [{"token_ids": [52], "finish_reason": "length"}]
                     if req.params["max_tokens"] > 10 else eng.default_script(req)).start()
    srv = start_gateway(own_redis.url, tiny_model_dir, redis_grace=grace)
    try:
        with httpx.Client(base_url=srv.url, trust_env=False, timeout=20) as c:
            with c.stream("POST", "/v1/completions", json={"prompt": "x", "max_tokens": 200, "stream": True}) as resp:
                lines = resp.iter_lines()
                next(l for l in lines if l.startswith("data:"))
                r.client_kill_filter(_type="pubsub")
                rest = [l for l in lines if l.startswith("data:")]
            assert rest[-1] == "data: [DONE]"
            last = json.loads(rest[-2][5:])
            if grace:
                assert "error" not in last and last["choices"][0]["finish_reason"] == "length", rest[-3:]
                rid = next(k for k in eng.requests if "~" not in k)
                cont = eng.requests[f"{rid}~1"].req
                assert cont.num_generated >= 1 and cont.params["max_tokens"] == 200 - cont.num_generated
                wait_until(lambda: rid in eng.aborts, 5)        # the orphaned work is dropped
            else:
                assert last["error"]["code"] == "reply_channel_lost"
            wait_until(lambda: srv.gw.router.subscribed.is_set(), 5)
            assert srv.gw.router.counters["resubscribed"] >= 1
            resp = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 3})
            assert resp.status_code == 200, resp.text
    finally:
        srv.stop()
        eng.stop()


def test_two_gateways_in_one_process_keep_separate_metrics(own_redis, tiny_model_dir):
    eng = FakeEngine(own_redis.url, engine_id="fake-two", model=tiny_model_dir.name).start()
    a = start_gateway(own_redis.url, tiny_model_dir)
    b = start_gateway(own_redis.url, tiny_model_dir)
    try:
        assert a.gw.gateway_id != b.gw.gateway_id
        with httpx.Client(trust_env=False, timeout=10) as c:
            for _ in range(3):
                assert c.post(a.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}).status_code == 200
            assert c.post(b.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}).status_code == 200

            def count(srv):
                text = c.get(srv.url + "/metrics").text
                return float([l for l in text.splitlines()
                              if l.startswith('kaiten:request_success_total{finished_reason="length"')][0].split()[-1])
            assert count(a) == 3 and count(b) == 1
    finally:
        a.stop()
        b.stop()
        eng.stop()


def test_repetition_penalty_reaches_the_engine(env):
    """In the body or in extra_body, on both endpoints, as the stock benchmark client sends it."""
    c, eng = env["client"], env["eng"]
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    cases = [("/v1/completions", {"prompt": "hi", "max_tokens": 2, "repetition_penalty": 1.25}, 1.25),
             ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "extra_body": {"repetition_penalty": 1.5}}, 1.5),
             ("/v1/chat/completions", chat | {"repetition_penalty": 0.9}, 0.9),
             ("/v1/chat/completions", chat | {"extra_body": {"repetition_penalty": 2.0, "top_k": 5}}, 2.0),
             ("/v1/completions", {"prompt": "hi", "max_tokens": 2}, 1.0)]
    for path, body, expected in cases:
        r = c.post(path, json=body)
        assert r.status_code == 200, r.text
        params = eng.requests[r.json()["id"]].req.params
        assert params["repetition_penalty"] == expected
        if "top_k" in json.dumps(body):
            assert params["top_k"] == 5
    # What `vllm bench serve` sends to /v1/completions.
    r = c.post("/v1/completions", json={"model": env["model"], "prompt": "hi", "repetition_penalty": 1.0,
                                        "temperature": 0.0, "max_tokens": 3, "logprobs": None, "ignore_eos": True,
                                        "stream": True, "stream_options": {"include_usage": True}})
    assert r.status_code == 200 and "[DONE]" in r.text


def test_gateway_imports_without_torch():
    code = ("import sys; sys.modules['torch'] = None\n"
            "import gateway.app, gateway.core\n"
            "assert 'engine_worker' not in sys.modules\n")
    subprocess.run([sys.executable, "-c", code], check=True)


# ---------------------------------------------------------------------- stop strings (unit)
def test_stop_checker_random_splits():
    import random
    from gateway.backend.output import StopChecker
    rng = random.Random(0)
    alphabet = "ab c\n"
    for _ in range(2000):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 80)))
        stops = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(0, 3))]
        cuts = sorted(rng.sample(range(len(text) + 1), k=min(len(text) + 1, rng.randint(0, 6))))
        pieces = [text[i:j] for i, j in zip([0] + cuts, cuts + [len(text)])]
        sc = StopChecker(stops)
        out, stopped = "", False
        for p in pieces:
            o, stopped = sc.feed(p)
            out += o
            if stopped:
                break
        if not stopped:
            out += sc.flush()
        # The stop string that completes first ends the text (the longest one if several end there).
        ends = [(text.find(s) + len(s), -len(s)) for s in stops if s in text]
        expected = text[:min(ends)[0] + min(ends)[1]] if ends else text
        assert out == expected, (text, stops, pieces, out)
        assert stopped == bool(ends)


def test_failover_continues_then_gives_up_after_max_failovers(own_redis, tiny_model_dir):
    """An engine that goes silent after one token, every time: the request moves as a continuation
    (prompt + delivered tokens, max_tokens reduced, seq continued) twice, then the client gets
    engine_lost. Once a working engine is back, the gateway serves again."""
    eng = FakeEngine(own_redis.url, engine_id="fake-flaky", model=tiny_model_dir.name,
                     script=lambda req: [{"token_ids": [60 + req.num_generated]}, {"stop_heartbeat": True},
                                         {"hang": True}]).start()
    srv = start_gateway(own_redis.url, tiny_model_dir, engine_timeout=5.0, failover_timeout=0.5, max_failovers=2)
    try:
        with httpx.Client(base_url=srv.url, trust_env=False, timeout=30) as c:
            status, events = post_stream(c, "/v1/completions", {"prompt": "x", "max_tokens": 5, "stream": True})
            err = events[-2]["error"]
            assert events[-1] == "[DONE]" and err["code"] == "engine_lost" and "max_failovers=2" in err["message"]
            tok = srv.gw.models.default.text_tokenizer
            assert "".join(e["choices"][0]["text"] for e in events[:-2]) == tok.decode([60, 61, 62])
            first, *moves = sorted(eng.requests.values(), key=lambda fr: fr.req.request_id)
            rid, prompt = first.req.request_id, first.req.prompt_token_ids
            assert [m.req.request_id for m in moves] == [f"{rid}~1", f"{rid}~2"]
            for n, m in enumerate(moves, 1):
                assert m.req.prompt_token_ids == prompt + [60 + k for k in range(n)]
                assert (m.req.num_generated, m.req.first_seq, m.req.params["max_tokens"]) == (n, n, 5 - n)
                assert m.req.deadline == first.req.deadline
            wait_until(lambda: set(eng.aborts) >= {rid, f"{rid}~1", f"{rid}~2"}, 5)
            assert srv.gw.router.counters["failovers"] == 2
            assert "kaiten:request_failovers_total" in c.get("/metrics").text
        eng.stop()
        with FakeEngine(own_redis.url, engine_id="fake-back", model=tiny_model_dir.name):
            wait_until(lambda: srv.gw.monitor.is_alive("fake-back"), 5)
            with httpx.Client(base_url=srv.url, trust_env=False, timeout=30) as c:
                resp = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 4})
                assert resp.status_code == 200 and resp.json()["choices"][0]["finish_reason"] == "length"
    finally:
        srv.stop()
        eng.stop()


def test_failover_config_is_validated(tiny_model_dir):
    from gateway.core import Gateway
    from shared.config import GatewayConfig
    for bad in ({"max_failovers": -1}, {"failover_timeout": 0.0}):
        with pytest.raises(ValueError, match="max_failovers|failover_timeout"):
            Gateway(GatewayConfig(model=str(tiny_model_dir), **bad))
