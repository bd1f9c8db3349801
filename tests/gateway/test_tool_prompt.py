"""Tools in the prompt (tokenizer_service/tool_prompt.py) and tool calls out of the text (gateway/api/tools.py)."""
from __future__ import annotations

import json

import pytest

from gateway.api.tools import ToolStream, extract, parse_tools
from tokenizer_service import ChatTokenizer
from tokenizer_service.tokenizer import ChatTemplateOptions
from tests.support.tiny_model import build_tokenizer

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
TURNS = [{"role": "user", "content": "Weather in Paris?"},
         {"role": "assistant", "content": "", "tool_calls": [
             {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
         {"role": "tool", "tool_call_id": "call_1", "content": '{"c": 21}'}]


@pytest.fixture(scope="module")
def hf():
    return build_tokenizer()


def test_template_without_tools_gets_the_hermes_format(hf):
    text = ChatTokenizer(hf).render_chat(TURNS, options=ChatTemplateOptions(tools=TOOLS))
    system, rest = text.split("<|im_end|>", 1)
    assert system.startswith("<|im_start|>system\n") and "<tools>" in system and '"get_weather"' in system
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in rest
    assert '<|im_start|>user\n<tool_response>\n{"c": 21}\n</tool_response><|im_end|>' in rest
    assert text.endswith("<|im_start|>assistant\n")
    # Without tools the messages are as they were.
    plain = TURNS[:1]
    assert ChatTokenizer(hf).render_chat(plain) == hf.apply_chat_template(plain, tokenize=False,
                                                                         add_generation_prompt=True)


def test_template_with_tools_gets_them_natively():
    hf = build_tokenizer()
    hf.chat_template = ("{% for t in tools %}TOOL {{ t.function.name }}\n{% endfor %}"
                        "{% for m in messages %}{{ m.role }}: {{ m.content }}"
                        "{% for c in m.tool_calls or [] %}CALL {{ c.function.arguments.city }}{% endfor %}\n{% endfor %}")
    text = ChatTokenizer(hf).render_chat(TURNS, add_generation_prompt=False, options=ChatTemplateOptions(tools=TOOLS))
    assert text.startswith("TOOL get_weather") and "assistant: CALL Paris" in text and 'tool: {"c": 21}' in text


def test_hermes_output_parsing_and_streaming():
    auto = parse_tools({"tools": TOOLS})
    text = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    content, calls = extract(auto, text)
    assert content == "Let me check." and calls[0]["function"]["name"] == "get_weather"
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Oslo"}
    assert extract(auto, "no calls here") == ("no calls here", [])
    assert extract(auto, "<tool_call>{not json</tool_call>") == ("<tool_call>{not json</tool_call>", [])
    # Streamed: the content goes out at once, except a tail that may start "<tool_call>".
    ts = ToolStream(auto)
    out = [d for piece in ("Let me", " check.\n<tool", "_call>\n{\"name\": \"get_weather\", ",
                           "\"arguments\": {\"city\": \"Oslo\"}}\n</tool_call>") for d in ts.feed(piece)]
    assert out == [{"content": "Let me"}, {"content": " check.\n"}]
    [end] = ts.finish()
    assert end["tool_calls"][0]["function"]["arguments"] == '{"city": "Oslo"}' and ts.num_calls == 1


def test_required_and_named_specs():
    required = parse_tools({"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False})
    schema = json.loads(required.spec()["value"])
    assert schema["maxItems"] == 1 and schema["items"]["anyOf"][0]["properties"]["name"] == {"const": "get_weather"}
    content, calls = extract(required, '[{"name": "get_weather", "parameters": {"city": "Rome"}}]')
    assert content is None and json.loads(calls[0]["function"]["arguments"]) == {"city": "Rome"}
    named = parse_tools({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}})
    assert json.loads(named.spec()["value"]) == TOOLS[0]["function"]["parameters"]
    assert parse_tools({"tools": TOOLS, "tool_choice": "none"}).spec() is None
