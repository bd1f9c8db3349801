"""The API against its own spec: Schemathesis (its CLI, as users run it) generates valid and
invalid requests from GET /openapi.json for every operation of a live gateway with the tiny model's
engine, and checks every answer: no 5xx, status codes, content types and bodies as the spec says,
invalid requests refused. Afterwards the gateway and the engine still serve. Also: /docs loads
nothing from the internet, and the spec documents the API-key scheme."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import httpx
import pytest

from tests.support.engine_support import e2e_worker, wait_until
from tests.support.gateway_support import openai_client, start_gateway
from tests.support.redis_server import RedisServer

pytestmark = pytest.mark.timeout(600)

CHECKS = ("not_a_server_error,status_code_conformance,content_type_conformance,response_schema_conformance,"
          "negative_data_rejection")
MAX_EXAMPLES = int(os.environ.get("KAITEN_FUZZ_EXAMPLES", "150"))
MAX_TIME = int(os.environ.get("KAITEN_FUZZ_SECONDS", "120"))
MIN_REQUESTS = 1000


@pytest.fixture(scope="module")
def stack(tiny_model_dir):
    server = RedisServer().start()
    w = e2e_worker(server.url, tiny_model_dir, "fuzz").start()
    srv = start_gateway(server.url, tiny_model_dir, engine_timeout=10.0)
    wait_until(lambda: srv.gw.monitor.live_engines(), 10)
    yield {"srv": srv, "worker": w, "model": tiny_model_dir.name}
    srv.stop()
    w.stop()
    server.stop()


def test_spec_and_docs(stack):
    with httpx.Client(base_url=stack["srv"].url, trust_env=False, timeout=10) as c:
        spec = c.get("/openapi.json").json()
        assert spec["components"]["securitySchemes"]["bearer"] == {
            "type": "http", "scheme": "bearer", "description": spec["components"]["securitySchemes"]["bearer"][
                "description"]}
        assert {"/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize", "/v1/models"} <= set(spec["paths"])
        chat = spec["components"]["schemas"]["ChatCompletionRequest"]["properties"]
        assert chat["temperature"]["anyOf"][0] == {"type": "number", "minimum": 0.0, "maximum": 2.0}
        page = c.get("/docs")
        assert page.status_code == 200 and "text/html" in page.headers["content-type"]
        assets = re.findall(r'(?:src|href)="([^"]+)"', page.text)
        assert len(assets) == 3 and all(a.startswith("/static/") for a in assets), assets
        assert "http" not in page.text and "//" not in c.get("/static/docs.js").text.split("\n", 1)[1]
        for a in assets:
            r = c.get(a)
            assert r.status_code == 200 and len(r.content) > 100, a


def test_schemathesis_finds_no_server_error(stack, tmp_path):
    url = stack["srv"].url
    report = tmp_path / "events.ndjson"
    cmd = [os.path.join(os.path.dirname(sys.executable), "schemathesis"), "run", f"{url}/openapi.json",
           "--checks", CHECKS, "--max-examples", str(MAX_EXAMPLES), "--max-time", str(MAX_TIME), "--seed", "1",
           "--request-timeout", "60", "--workers", "2", "--continue-on-failure", "--no-color",
           "--suppress-health-check", "all", "--report", "ndjson", "--report-ndjson-path", str(report)]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=MAX_TIME + 240,
                         env={**os.environ, "NO_PROXY": "*", "SCHEMATHESIS_HOOKS": ""})
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-6000:]
    requests = _count_requests(report)
    print(f"schemathesis: {requests} requests; {out.strip().splitlines()[-1]}")
    assert requests >= MIN_REQUESTS, f"only {requests} requests\n{out[-3000:]}"
    # Both processes still serve: the gateway answers, the engine generates.
    with httpx.Client(base_url=url, trust_env=False, timeout=30) as c:
        assert c.get("/health").status_code == 200
        assert c.get("/ready").status_code == 200, c.get("/ready").text
    assert stack["worker"].thread.is_alive()
    out = openai_client(stack["srv"]).completions.create(model=stack["model"], prompt=[40, 41, 42], max_tokens=4,
                                                         temperature=0)
    assert out.usage.completion_tokens == 4


def _count_requests(report) -> int:
    """HTTP requests Schemathesis sent, from its ndjson event log."""
    n = 0
    for line in report.read_text().splitlines():
        n += line.count('"request":')
    return n


def _sse_events(srv, path: str, body: dict) -> list[dict]:
    with httpx.stream("POST", srv.url + path, json=body, trust_env=False, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        data = [ln.removeprefix("data: ") for ln in r.iter_lines() if ln.startswith("data: ")]
    assert data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]


def test_streams_and_bodies_match_the_models(stack):
    """What the spec cannot say of a text/event-stream: every chunk of real streams (logprobs, usage,
    tool calls) is a CompletionChunk / ChatCompletionChunk; and the unstreamed bodies are theirs."""
    from gateway.api.response_models import (ChatCompletionChunk, ChatCompletionResponse, CompletionChunk,
                                         CompletionResponse)
    srv, model = stack["srv"], stack["model"]
    usage = {"stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    comp = {"model": model, "prompt": [40, 41, 42], "max_tokens": 4, "logprobs": 2, "echo": True}
    chat = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "logprobs": True,
            "top_logprobs": 2}
    tools = {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
             "tool_choice": {"type": "function", "function": {"name": "f"}}}
    for event in _sse_events(srv, "/v1/completions", comp | usage | {"stream": True}):
        CompletionChunk.model_validate(event)
    for body in (chat, chat | tools):
        for event in _sse_events(srv, "/v1/chat/completions", body | usage | {"stream": True}):
            ChatCompletionChunk.model_validate(event)
    with httpx.Client(base_url=srv.url, trust_env=False, timeout=60) as c:
        CompletionResponse.model_validate(c.post("/v1/completions", json=comp | {"prompt_logprobs": 1}).json())
        ChatCompletionResponse.model_validate(c.post("/v1/chat/completions", json=chat | tools).json())


def test_stream_events_match_the_spec(stack):
    """Every event of a real stream, [DONE] included, is valid under the spec's text/event-stream
    schema, checked as Schemathesis' response check does (that check meets a stream only when its
    fuzzer happens on a valid streaming request)."""
    import jsonschema_rs
    from schemathesis.specs.openapi.content_keywords import SseValidator
    srv, model = stack["srv"], stack["model"]
    spec = httpx.get(srv.url + "/openapi.json", trust_env=False, timeout=30).json()
    bodies = {"/v1/completions": {"prompt": "hi"},
              "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}]}}
    for path, body in bodies.items():
        event = spec["paths"][path]["post"]["responses"]["200"]["content"]["text/event-stream"]["schema"]
        validator = SseValidator(_inline(event, spec["components"]["schemas"]), jsonschema_rs.Draft202012Validator)
        with httpx.stream("POST", srv.url + path, json=body | {"model": model, "max_tokens": 3, "stream": True},
                          trust_env=False, timeout=60) as r:
            data = [ln.removeprefix("data: ") for ln in r.iter_lines() if ln.startswith("data: ")]
        assert data[-1] == "[DONE]" and len(data) >= 2
        with validator.with_deserializer(lambda media_type, payload: json.loads(payload)):
            for d in data:
                validator.validate({"data": d, "event": "message"})
            with pytest.raises(jsonschema_rs.ValidationError):
                validator.validate({"data": json.dumps({"not": "a chunk"}), "event": "message"})


def _inline(node, schemas: dict):
    """`node` with every #/components/schemas/ reference replaced by its schema (as Schemathesis
    bundles them before it validates an embedded payload)."""
    if isinstance(node, dict):
        ref = node.get("$ref", "")
        if ref.startswith("#/components/schemas/"):
            return _inline(schemas[ref.rsplit("/", 1)[1]], schemas)
        return {k: _inline(v, schemas) for k, v in node.items()}
    if isinstance(node, list):
        return [_inline(v, schemas) for v in node]
    return node


def test_bodies_are_written_through_their_models():
    """encode: only declared fields with their declared types; optional fields left out stay out."""
    from pydantic import ValidationError

    from gateway.api.response_models import ChatCompletionChunk, encode
    chunk = {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m",
             "choices": [{"index": 0, "delta": {"content": "é"}, "logprobs": None, "finish_reason": None}]}
    assert encode(ChatCompletionChunk, chunk) == json.dumps(chunk, ensure_ascii=False,
                                                            separators=(",", ":")).encode()
    for bad in ({**chunk, "extra": 1}, {**chunk, "object": "chat.completion"},
                {**chunk, "choices": [{"index": 0, "delta": {"text": "x"}}]}):
        with pytest.raises(ValidationError):
            encode(ChatCompletionChunk, bad)
