"""Structured output and tool calls end to end: the official `openai` SDK against a real gateway and
a real engine worker (tiny random model) on a real Redis. Only the grammar can make the random
model's output valid, so each test checks the output by its effect."""
from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest

from tests.support.engine_support import WorkerThread, wait_until
from tests.support.gateway_support import start_gateway
from tests.support.redis_server import RedisServer

pytestmark = pytest.mark.timeout(180)

MSGS = [{"role": "user", "content": "Give me data."}]
PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 8}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "pets": {"type": "array", "items": {"enum": ["cat", "dog"]}, "maxItems": 2}}, "required": ["name", "age"]}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Tokyo"]}, "days": {"type": "integer", "minimum": 1,
                                                                                    "maximum": 7}},
    "required": ["city", "days"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}}}


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    """The tools' system prompt alone is ~700 tokens of the tiny tokenizer: a longer context."""
    import httpx
    from tests.support.tiny_model import build_tiny_model
    tiny_model_dir = build_tiny_model(tmp_path_factory.mktemp("tiny-2k"), max_position_embeddings=2048)
    server = RedisServer().start()
    w = WorkerThread(server.url, tiny_model_dir, "structured-e2e").start()
    srv = start_gateway(server.url, tiny_model_dir)
    wait_until(lambda: srv.gw.monitor.live_engines(), 10)
    c = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60,
                      http_client=httpx.Client(trust_env=False, timeout=60))
    c.model_name = tiny_model_dir.name
    yield c
    srv.stop()
    w.stop()
    server.stop()


def _chat(client, **kw):
    defaults = {"model": client.model_name, "messages": MSGS, "max_tokens": 120, "temperature": 1.0}
    return client.chat.completions.create(**(defaults | kw))


def test_response_format_json_schema(client):
    rf = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    out = _chat(client, response_format=rf, n=3, seed=7)
    for ch in out.choices:
        assert ch.finish_reason == "stop"
        jsonschema.validate(json.loads(ch.message.content), PERSON)
    stream = _chat(client, response_format=rf, stream=True, seed=8)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    jsonschema.validate(json.loads(text), PERSON)


def test_response_format_json_object(client):
    out = _chat(client, response_format={"type": "json_object"}, seed=0, max_tokens=400)  # a short object
    assert out.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(out.choices[0].message.content), dict)


def test_structured_outputs_choice_regex_grammar(client):
    choices = ["positive", "negative", "neutral"]
    for seed in range(3):
        out = _chat(client, extra_body={"structured_outputs": {"choice": choices}}, seed=seed)
        assert out.choices[0].message.content in choices
    out = _chat(client, extra_body={"structured_outputs": {"regex": r"\d{3}-[a-z]{2,5}"}})
    assert re.fullmatch(r"\d{3}-[a-z]{2,5}", out.choices[0].message.content)
    out = _chat(client, extra_body={"structured_outputs": {"grammar": 'root ::= "(" [a-c]+ ")"'}})
    assert re.fullmatch(r"\([a-c]+\)", out.choices[0].message.content)
    comp = client.completions.create(model=client.model_name, prompt="The answer:",
                                     max_tokens=120, seed=1, extra_body={"structured_outputs": {"json": PERSON}})
    jsonschema.validate(json.loads(comp.choices[0].text), PERSON)


@pytest.mark.parametrize("kw,reason", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     'Unsupported type "nonsense"'),
    ({"extra_body": {"structured_outputs": {"regex": "a(b"}}}, "parenthesis"),
    ({"extra_body": {"structured_outputs": {"grammar": "root ::= undefined_rule"}}}, "undefined_rule"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
])
def test_invalid_specs_are_400(client, kw, reason):
    with pytest.raises(openai.BadRequestError) as e:
        _chat(client, **kw)
    assert reason in e.value.message


def _check_weather_call(call):
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])


def test_tool_choice_required_and_named(client):
    out = _chat(client, tools=[WEATHER, TIME], tool_choice="required", seed=1, max_tokens=150)
    ch = out.choices[0]
    assert ch.finish_reason == "tool_calls" and ch.message.tool_calls
    tools = {"get_weather": WEATHER, "get_time": TIME}
    for call in ch.message.tool_calls:
        jsonschema.validate(json.loads(call.function.arguments), tools[call.function.name]["function"]["parameters"])
    out = _chat(client, tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False, seed=2,
                max_tokens=150)
    assert len(out.choices[0].message.tool_calls) == 1
    named = {"type": "function", "function": {"name": "get_weather"}}
    out = _chat(client, tools=[WEATHER, TIME], tool_choice=named, seed=3)
    assert out.choices[0].finish_reason == "tool_calls" and out.choices[0].message.content is None
    [call] = out.choices[0].message.tool_calls
    _check_weather_call(call)


def _streamed_calls(stream) -> tuple[str, dict[int, dict], str]:
    content, calls, finish = "", {}, None
    for c in stream:
        if not c.choices:
            continue
        d = c.choices[0].delta
        content += d.content or ""
        for tc in d.tool_calls or []:
            slot = calls.setdefault(tc.index, {"id": None, "name": None, "arguments": ""})
            slot["id"] = tc.id or slot["id"]
            slot["name"] = (tc.function.name if tc.function and tc.function.name else slot["name"])
            slot["arguments"] += (tc.function.arguments or "") if tc.function else ""
        finish = c.choices[0].finish_reason or finish
    return content, calls, finish


def test_streamed_tool_calls(client):
    named = {"type": "function", "function": {"name": "get_weather"}}
    content, calls, finish = _streamed_calls(_chat(client, tools=[WEATHER], tool_choice=named, stream=True, seed=4))
    assert finish == "tool_calls" and list(calls) == [0] and calls[0]["name"] == "get_weather"
    assert calls[0]["id"].startswith("call_")
    jsonschema.validate(json.loads(calls[0]["arguments"]), WEATHER["function"]["parameters"])
    content, calls, finish = _streamed_calls(_chat(client, tools=[WEATHER, TIME], tool_choice="required",
                                                   stream=True, seed=5, max_tokens=150))
    assert finish == "tool_calls" and calls and all(c["id"] and c["name"] for c in calls.values())


# "auto": the random model will not write a Hermes call by itself, so a regex grammar makes it.
HERMES = r'Sure\.\n<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "(Paris|Tokyo)", "days": [1-7]\}\}\n</tool_call>'


def test_tool_choice_auto_parses_hermes_calls(client):
    kw = {"tools": [WEATHER], "extra_body": {"structured_outputs": {"regex": HERMES}}, "max_tokens": 250}
    out = _chat(client, **kw)
    ch = out.choices[0]
    assert ch.finish_reason == "tool_calls" and ch.message.content == "Sure."
    [call] = ch.message.tool_calls
    _check_weather_call(call)
    content, calls, finish = _streamed_calls(_chat(client, stream=True, **kw))
    assert content == "Sure.\n" and finish == "tool_calls" and calls[0]["name"] == "get_weather"
    jsonschema.validate(json.loads(calls[0]["arguments"]), WEATHER["function"]["parameters"])
    # No call in the output: plain content; with tool_choice "none" nothing is parsed.
    out = _chat(client, tools=[WEATHER], extra_body={"structured_outputs": {"choice": ["no call needed"]}})
    assert out.choices[0].message.content == "no call needed" and not out.choices[0].message.tool_calls
    out = _chat(client, tools=[WEATHER], tool_choice="none", **{k: v for k, v in kw.items() if k != "tools"})
    assert out.choices[0].finish_reason == "stop" and "<tool_call>" in out.choices[0].message.content


def test_two_turn_call_result_answer(client):
    named = {"type": "function", "function": {"name": "get_weather"}}
    first = _chat(client, tools=[WEATHER], tool_choice=named, seed=6)
    call = first.choices[0].message.tool_calls[0]
    messages = MSGS + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature_c": 21})},
    ]
    answer = _chat(client, messages=messages, tools=[WEATHER], max_tokens=8, temperature=0)
    assert answer.choices[0].finish_reason in ("stop", "length")
    assert answer.usage.prompt_tokens > first.usage.prompt_tokens + 10      # the call and its result are in
