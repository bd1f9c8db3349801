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

from .api_models import NamedToolChoice, ToolFields, validate
from .errors import bad_request
from .structured import schema_spec

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


def parse_tools(fields: ToolFields | dict) -> ToolCalling | None:
    """``tools``, ``tool_choice`` and ``parallel_tool_calls`` (validated, or a dict of them) as a
    ToolCalling; None when there are no tools."""
    if isinstance(fields, dict):
        fields = validate(ToolFields, fields)
    tools, choice = fields.tools, fields.tool_choice
    if not tools:
        if choice not in (None, "none"):
            raise bad_request("'tool_choice' needs 'tools'", "tool_choice")
        return None
    names = [t.function.name for t in tools]
    if len(set(names)) != len(names):
        raise bad_request("tool function names must be unique", "tools")
    calling = ToolCalling([t.model_dump(exclude_none=True) for t in tools], "auto",
                          parallel=fields.parallel_tool_calls is not False)
    if isinstance(choice, NamedToolChoice):
        if choice.function.name not in names:
            raise bad_request(f"tool_choice names the function {choice.function.name!r}, which is not in 'tools'",
                              "tool_choice")
        calling.choice, calling.named = "named", choice.function.name
    else:
        calling.choice = choice or "auto"
    return calling


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
