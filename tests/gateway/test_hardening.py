"""Hostile or unlucky input against a real gateway on a real Redis (scripted fake engine): deep
JSON, oversized WebSocket frames, foreign origins, the status page behind the key, and SSE
keep-alive comments while a stream waits."""
from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
import websockets

from tests.support.engine_support import wait_until
from tests.support.gateway_support import FakeEngine, start_gateway

pytestmark = pytest.mark.timeout(120)
KEY = "hardening-key"


@pytest.fixture(scope="module")
def env(redis_server, tiny_model_dir):
    import redis
    redis.Redis.from_url(redis_server.url).flushall()
    eng = FakeEngine(redis_server.url, model=tiny_model_dir.name)
    eng.script = lambda req: ([{"sleep": 1.0}] if req.params.get("seed") == 4242 else []) + eng.default_script(req)
    eng.start()
    open_gw = start_gateway(redis_server.url, tiny_model_dir, max_body_bytes=64 * 1024, sse_keepalive=0.2,
                            allowed_origins=("https://app.example",))
    keyed_gw = start_gateway(redis_server.url, tiny_model_dir, api_keys=(KEY,))
    for g in (open_gw, keyed_gw):
        wait_until(lambda: g.gw.monitor.live_engines(), 10)
    yield {"open": open_gw, "keyed": keyed_gw}
    open_gw.stop(), keyed_gw.stop(), eng.stop()


def _post(srv, body: bytes | dict, path="/v1/chat/completions") -> httpx.Response:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(srv.url + path, content=data, trust_env=False, timeout=30,
                      headers={"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})


def test_deeply_nested_json_is_a_400(env):
    srv = env["keyed"]                # the default 4 MiB body limit
    for depth in (100_000, 65):
        r = _post(srv, b'{"messages": ' + b"[" * depth + b"]" * depth + b"}")
        assert r.status_code == 400, (depth, r.text)
        assert r.json()["error"]["code"] == "invalid_json" and "nested too deeply" in r.json()["error"]["message"]
    ok = _post(srv, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "metadata": {"a": [[1]]}})
    assert ok.status_code == 200, ok.text


def test_malformed_bodies_are_400s_from_the_validation_of_bytes(env):
    """Bodies with few brackets go to validation undecoded: pydantic's JSON errors are still ours."""
    srv = env["keyed"]
    for body, code, text in ((b'{"messages": [', "invalid_json", "invalid JSON"),
                             (b'{"a": "\\ud800"}', "invalid_json", "invalid JSON"),
                             (b"[1]", "invalid_type", "must be a JSON object"),
                             (b'"hi"', "invalid_type", "must be a JSON object")):
        r = _post(srv, body)
        assert r.status_code == 400 and r.json()["error"]["code"] == code and text in r.json()["error"]["message"], r.text


async def _ws(url: str, frames: list, origin: str | None = None) -> list:
    headers = {"Origin": origin} if origin else None
    out = []
    async with websockets.connect(url, additional_headers=headers, max_size=None) as ws:
        for f in frames:
            await ws.send(f if isinstance(f, str) else json.dumps(f))
            out.append(json.loads(await ws.recv()))
    return out


def test_websocket_frames_obey_the_body_limit_and_depth(env):
    srv = env["open"]
    big = json.dumps({"type": "chat", "id": "a", "messages": [{"role": "user", "content": "x" * 100_000}]})
    deep = '{"type": "ping", "x": ' + "[" * 5000 + "]" * 5000 + "}"
    t0 = time.monotonic()
    replies = asyncio.run(_ws(srv.ws_url + "/v1/chat/ws", [big, deep, {"type": "ping"}]))
    assert time.monotonic() - t0 < 5
    assert replies[0]["type"] == "error" and replies[0]["status"] == 413
    assert replies[0]["error"]["code"] == "request_too_large"
    assert replies[1]["status"] == 400 and "nested too deeply" in replies[1]["error"]["message"]
    assert replies[2] == {"type": "pong"}                     # the connection lives on


def test_websocket_origin_check_without_a_key(env):
    srv = env["open"]
    url = srv.ws_url + "/v1/chat/ws"
    same = f"http://127.0.0.1:{srv.port}"
    assert asyncio.run(_ws(url, [{"type": "ping"}], same)) == [{"type": "pong"}]
    assert asyncio.run(_ws(url, [{"type": "ping"}], "https://app.example")) == [{"type": "pong"}]
    assert asyncio.run(_ws(url, [{"type": "ping"}])) == [{"type": "pong"}]          # no browser

    async def foreign():
        async with websockets.connect(url, additional_headers={"Origin": "http://evil.example"}) as ws:
            first = json.loads(await ws.recv())
            with pytest.raises(websockets.ConnectionClosed) as closed:
                await ws.recv()
            return first, closed.value.rcvd.code
    first, code = asyncio.run(foreign())
    assert first["status"] == 403 and first["error"]["code"] == "origin_not_allowed" and code == 1008
    # With an API key, the key decides (a foreign page that holds the key may connect).
    keyed = env["keyed"].ws_url + f"/v1/chat/ws?api_key={KEY}"
    assert asyncio.run(_ws(keyed, [{"type": "ping"}], "http://evil.example")) == [{"type": "pong"}]


def test_status_needs_the_key_when_keys_are_set(env):
    url = env["keyed"].url + "/v1/status"
    r = httpx.get(url, trust_env=False)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(url, headers={"Authorization": f"Bearer {KEY}"}, trust_env=False).json()["engines"] == 1
    assert httpx.get(env["open"].url + "/v1/status", trust_env=False).status_code == 200


def test_sse_keepalive_comments_while_a_stream_waits(env):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": True, "seed": 4242}
    with httpx.stream("POST", env["open"].url + "/v1/chat/completions", json=body, trust_env=False,
                      timeout=30) as r:
        lines = [ln for ln in r.iter_lines() if ln]
    # The role chunk comes at once; then the engine takes 1 s to the first token (0.2 s period).
    data = [i for i, ln in enumerate(lines) if ln.startswith("data:")]
    assert lines[data[0] + 1:data[1]].count(": keep-alive") >= 3, lines[:data[1] + 1]
    assert lines[-1] == "data: [DONE]"


def bench_client_events(srv, body: dict) -> list[dict]:
    """The events of a stream as the stock `vllm bench serve` client reads them: every network read
    stripped of surrounding whitespace, appended to a buffer, complete events split off at blank
    lines (or a buffer that is one whole `data:` JSON event), comments skipped."""
    buffer, events = "", []
    with httpx.stream("POST", srv.url + "/v1/completions", json=body, trust_env=False, timeout=30,
                      headers={"Authorization": f"Bearer {KEY}"}) as r:
        for read in r.iter_raw():
            read = read.strip()
            if not read:
                continue
            buffer += read.decode()
            messages = []
            while "\n\n" in buffer:
                message, buffer = buffer.split("\n\n", 1)
                if message.strip():
                    messages.append(message.strip())
            if buffer.startswith("data: "):
                rest = buffer.removeprefix("data: ").strip()
                try:
                    if rest == "[DONE]" or json.loads(rest) is not None:
                        messages.append(buffer.strip())
                        buffer = ""
                except ValueError:
                    pass
            for m in messages:
                if not m.startswith(":") and m != "data: [DONE]":
                    events.append(json.loads(m.removeprefix("data: ")))
    return events


def test_bench_client_parses_streams_with_a_slow_first_token(env):
    """A first token after 1 s: with keep-alive comments (0.2 s here, 15 s in the field) the
    client above gets no event at all; by default the gateway sends none (as vLLM), and it gets all."""
    body = {"prompt": "hi", "max_tokens": 3, "stream": True, "seed": 4242}
    assert bench_client_events(env["open"], body) == []      # the failure of issue 26, reproduced
    events = bench_client_events(env["keyed"], body)
    texts = [e["choices"][0]["text"] for e in events if e["choices"]]
    assert len(texts) == 3 and events[-1]["choices"][0]["finish_reason"] == "length"
