"""Request JSON from untrusted bytes: refused (400) when nested deeper than a limit, so that
nothing later (validation, logging, msgpack) recurses without bound; decoded, or checked and handed
to validation as bytes (pydantic decodes them faster than json.loads)."""
from __future__ import annotations

import json
from typing import Any

from .errors import bad_request


def parse_json(raw: str | bytes, max_depth: int, what: str = "the request body") -> Any:
    try:
        value = json.loads(raw)
    except RecursionError:
        raise _too_deep(max_depth, what) from None
    except (ValueError, UnicodeDecodeError) as e:
        raise bad_request(f"invalid JSON in {what}: {e}", None, "invalid_json") from None
    if json_depth(value, max_depth) > max_depth:
        raise _too_deep(max_depth, what)
    return value


def check_json(raw: bytes, max_depth: int) -> bytes:
    """`raw`, refused when nested deeper than `max_depth`. Decoded only when it holds more brackets
    than that (a typical request holds a handful): fewer cannot nest deeper."""
    if raw.count(b"{") + raw.count(b"[") > max_depth:
        parse_json(raw, max_depth)
    return raw


def json_depth(value: Any, stop_above: int) -> int:
    """Nesting depth of a decoded JSON value (a scalar is 0); stops counting past `stop_above`."""
    deepest = 0
    stack = [(value, 0)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, (dict, list)):
            d += 1
            deepest = max(deepest, d)
            if deepest > stop_above:
                return deepest
            stack.extend((x, d) for x in (v.values() if isinstance(v, dict) else v))
    return deepest


def _too_deep(limit: int, what: str):
    return bad_request(f"{what} is nested too deeply (limit {limit} levels)", None, "invalid_json")
