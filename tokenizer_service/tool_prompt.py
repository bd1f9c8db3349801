"""Tools in the prompt, for chat templates that do not handle them.

A template that mentions tools (Qwen2's, Llama 3.1's ...) gets the messages and ``tools=`` as they
are. Others (SmolLM2-135M's plain ChatML) would drop them silently, so the messages are rewritten
in the Hermes format the gateway parses back (``gateway/api/tools.py``): the tool signatures go in the
system message, earlier calls become ``<tool_call>`` text in the assistant's content, and tool
results become ``<tool_response>`` user messages.
"""
from __future__ import annotations

import json

HERMES_SYSTEM = (
    "You are a function calling AI model. You are provided with function signatures within <tools></tools> "
    "XML tags. You may call one or more functions to assist with the user query. Don't make assumptions about "
    "what values to plug into functions. Here are the available tools: <tools>\n{tools}\n</tools>\n"
    "For each function call return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags as follows:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-dict>}}\n</tool_call>'
)


def template_handles_tools(template: str | None) -> bool:
    return bool(template) and "tool" in template


def hermes_messages(messages: list[dict], tools: list[dict] | None) -> list[dict]:
    """`messages` with the tools, calls and results written out as text (see the module doc)."""
    out = []
    for m in messages:
        m = dict(m)
        calls = m.pop("tool_calls", None)
        if calls:
            text = "\n".join(f"<tool_call>\n{_dumps(c['function'])}\n</tool_call>" for c in calls)
            m["content"] = (m.get("content") or "") + ("\n" if m.get("content") else "") + text
        if m["role"] == "tool":
            m = {"role": "user", "content": f"<tool_response>\n{m['content']}\n</tool_response>"}
        out.append(m)
    if tools:
        system = HERMES_SYSTEM.format(tools="\n".join(_dumps(t) for t in tools))
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": out[0]["content"] + "\n\n" + system}
        else:
            out.insert(0, {"role": "system", "content": system})
    return out


def _dumps(obj) -> str:
    return json.dumps(obj, ensure_ascii=False)
