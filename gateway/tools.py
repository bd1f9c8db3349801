"""Tool calls on chat completions: the request's ``tools``/``tool_choice``, the grammar that forces a
call, and the model's output turned into OpenAI ``tool_calls`` (whole, or as stream deltas).

    tool_choice "none"       tools are in the prompt; the output is plain content
    tool_choice "auto"       (the default with tools) the model decides; calls in the Hermes format
                             ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (the format
                             of SmolLM2's and Qwen2's templates) are parsed out of the text, the
                             text before the first call is the content
    tool_choice "required"   a JSON schema grammar forces ``[{"name": ..., "parameters": {...}}, ...]``
                             (one item when parallel_tool_calls is false)
    {"type": "function", "function": {"name": N}}
                             the grammar forces N's parameters as the whole output

Streaming: a named call streams its arguments as they come; "required" and "auto" calls come as
one delta per call when the output ends ("auto" streams the content before ``<tool_call>``).
"""
from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass
from typing import Any

from .errors import bad_request
from .structured import schema_spec

TOOL_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)
EMPTY_PARAMETERS = {"type": "object", "properties": {}}


@dataclass(slots=True)
class ToolCalling:
    """A chat request's tools: the function definitions and how the output may call them."""
    tools: list[dict]                     # [{"type": "function", "function": {...}}], as sent
    choice: str                           # "none" | "auto" | "required" | "named"
    named: str | None = None              # the function of a named tool_choice
    parallel: bool = True

    @property
    def parses_output(self) -> bool:
        return self.choice != "none"

    def spec(self) -> dict | None:
        """The engine's structured_output spec that forces a call (required / named), else None."""
        params = {t["function"]["name"]: t["function"].get("parameters") or EMPTY_PARAMETERS for t in self.tools}
        if self.choice == "named":
            return schema_spec(params[self.named], "tools")
        if self.choice != "required":
            return None
        item = {"anyOf": [{"type": "object", "properties": {"name": {"const": name}, "parameters": p},
                           "required": ["name", "parameters"]} for name, p in params.items()]}
        schema = {"type": "array", "items": item, "minItems": 1}
        if not self.parallel:
            schema["maxItems"] = 1
        return schema_spec(schema, "tools")


def parse_tools(body: dict) -> ToolCalling | None:
    """Check ``tools``, ``tool_choice`` and ``parallel_tool_calls``; None when there are no tools."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise bad_request("'parallel_tool_calls' must be a boolean", "parallel_tool_calls", "invalid_type")
    if tools is None or tools == []:
        if choice not in (None, "none"):
            raise bad_request("'tool_choice' needs 'tools'", "tool_choice")
        return None
    if not isinstance(tools, list):
        raise bad_request("'tools' must be a list of tool objects", "tools", "invalid_type")
    names = [_check_tool(t, i) for i, t in enumerate(tools)]
    if len(set(names)) != len(names):
        raise bad_request("tool function names must be unique", "tools")
    calling = ToolCalling(tools, "auto", parallel=parallel is not False)
    if choice in (None, "auto", "none", "required"):
        calling.choice = choice or "auto"
    elif isinstance(choice, dict):
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if choice.get("type") != "function" or not isinstance(name, str):
            raise bad_request("'tool_choice' must be 'none', 'auto', 'required' or "
                              "{'type': 'function', 'function': {'name': ...}}", "tool_choice")
        if name not in names:
            raise bad_request(f"tool_choice names the function {name!r}, which is not in 'tools'", "tool_choice")
        calling.choice, calling.named = "named", name
    else:
        raise bad_request("'tool_choice' must be 'none', 'auto', 'required' or "
                          "{'type': 'function', 'function': {'name': ...}}", "tool_choice")
    return calling


def _check_tool(tool: Any, i: int) -> str:
    where = f"tools[{i}]"
    if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
        raise bad_request(f"{where} must be {{'type': 'function', 'function': {{...}}}}", where, "invalid_type")
    fn = tool["function"]
    unknown = sorted(set(fn) - {"name", "description", "parameters", "strict"})
    if unknown:
        raise bad_request(f"{where}.function: unknown fields {unknown}", f"{where}.function", "unknown_parameter")
    name = fn.get("name")
    if not isinstance(name, str) or not TOOL_NAME.match(name):
        raise bad_request(f"{where}.function.name must be 1-64 letters, digits, '_', '.' or '-'",
                          f"{where}.function.name")
    if fn.get("description") is not None and not isinstance(fn["description"], str):
        raise bad_request(f"{where}.function.description must be a string", f"{where}.function.description",
                          "invalid_type")
    if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
        raise bad_request(f"{where}.function.parameters must be a JSON schema object",
                          f"{where}.function.parameters", "invalid_schema")
    return name


# ---------------------------------------------------------------------- output
def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


def call(name: str, arguments: Any) -> dict:
    """One tool call in the OpenAI shape (arguments as JSON text)."""
    args = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {"id": new_call_id(), "type": "function", "function": {"name": name, "arguments": args}}


def extract(calling: ToolCalling, text: str) -> tuple[str | None, list[dict]]:
    """(content, tool calls) of a whole output. Output that does not parse stays content."""
    if calling.choice == "named":
        return None, [call(calling.named, text)]
    if calling.choice == "required":
        try:
            items = json.loads(text)
            return None, [call(it["name"], it["parameters"]) for it in items]
        except (ValueError, TypeError, KeyError):     # cut off by max_tokens
            return text, []
    return _hermes(text)


def _hermes(text: str) -> tuple[str | None, list[dict]]:
    start = text.find(CALL_OPEN)
    if start < 0:
        return text, []
    calls = []
    for body in HERMES_CALL.findall(text, start):
        try:
            obj = json.loads(body)
            name, args = obj["name"], obj.get("arguments", obj.get("parameters", {}))
        except (ValueError, TypeError, KeyError):
            return text, []
        if not isinstance(name, str):
            return text, []
        calls.append(call(name, args))
    content = text[:start].strip()
    return content or None, calls


@dataclass(slots=True)
class ToolStream:
    """One streamed choice's output as chat deltas: content, and tool_calls deltas."""
    calling: ToolCalling
    text: str = ""                          # everything generated so far
    sent: int = 0                           # characters of `text` already sent as content/arguments
    named_id: str | None = None
    num_calls: int = 0

    def feed(self, piece: str) -> list[dict]:
        """The deltas `piece` gives now."""
        self.text += piece
        if self.calling.choice == "named":
            return self._named(piece)
        if self.calling.choice != "auto":
            return []                         # "required": whole calls at the end
        start = self.text.find(CALL_OPEN)
        end = start if start >= 0 else len(self.text) - _partial_tail(self.text, CALL_OPEN)
        return self._content_until(end)

    def finish(self) -> list[dict]:
        """The deltas left when the output ends (the calls of "required" and "auto")."""
        if self.calling.choice == "named":
            return []
        content, calls = extract(self.calling, self.text)
        if not calls:
            return self._content_until(len(self.text))
        self.num_calls = len(calls)
        return [{"tool_calls": [{"index": i, **c}]} for i, c in enumerate(calls)]

    def _named(self, piece: str) -> list[dict]:
        if self.named_id is None:
            self.named_id, self.num_calls = new_call_id(), 1
            return [{"tool_calls": [{"index": 0, "id": self.named_id, "type": "function",
                                     "function": {"name": self.calling.named, "arguments": piece}}]}]
        return [{"tool_calls": [{"index": 0, "function": {"arguments": piece}}]}] if piece else []

    def _content_until(self, end: int) -> list[dict]:
        if end <= self.sent:
            return []
        out, self.sent = self.text[self.sent:end], end
        return [{"content": out}]


def _partial_tail(text: str, marker: str) -> int:
    """Length of the longest end of `text` that is the start of `marker` (held back)."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0
