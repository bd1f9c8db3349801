"""Structured-output requests: OpenAI ``response_format`` and vLLM's ``structured_outputs`` extras,
checked here and turned into the engine's ``structured_output`` spec ``{"kind", "value"}``
(see engine_worker/structured_output.py).

    response_format     {"type": "text"} | {"type": "json_object"}
                        | {"type": "json_schema", "json_schema": {"name", "schema", "strict", "description"}}
    structured_outputs  exactly one of {"json": schema}, {"regex": str}, {"choice": [str, ...]},
                        {"grammar": EBNF str}, {"json_object": true}

Only the shape is checked here (the gateway does not load xgrammar, which pulls in torch): the
engine compiles the grammar, and one that does not compile comes back as a 400 with xgrammar's
reason before any token is generated.
"""
from __future__ import annotations

import json
from typing import Any

from .errors import bad_request

STRUCTURED_KEYS = ("json", "regex", "choice", "grammar", "json_object")
MAX_SPEC_CHARS = 1 << 20          # engine_worker.structured_output.MAX_SPEC_CHARS


def structured_spec(body: dict) -> dict | None:
    """The engine spec for `body`'s response_format / structured_outputs, or None (free text)."""
    from_rf = _response_format(body.get("response_format"))
    from_so = _structured_outputs(body.get("structured_outputs"))
    if from_rf is not None and from_so is not None:
        raise bad_request("give 'response_format' or 'structured_outputs', not both", "structured_outputs")
    spec = from_rf or from_so
    if spec is not None and len(json.dumps(spec.get("value"))) > MAX_SPEC_CHARS:
        raise bad_request(f"the structured output specification is larger than {MAX_SPEC_CHARS} characters",
                          "response_format" if from_rf else "structured_outputs")
    return spec


def schema_spec(schema: Any, param: str) -> dict:
    """{"kind": "json"} for a JSON schema given as an object (or as JSON text of one)."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as e:
            raise bad_request(f"'{param}' is not valid JSON: {e}", param, "invalid_schema") from None
    if not isinstance(schema, dict):
        raise bad_request(f"'{param}' must be a JSON schema object", param, "invalid_schema")
    return {"kind": "json", "value": json.dumps(schema, sort_keys=True, ensure_ascii=False)}


def _response_format(rf: Any) -> dict | None:
    if rf is None:
        return None
    if not isinstance(rf, dict):
        raise bad_request("'response_format' must be an object", "response_format", "invalid_type")
    kind = rf.get("type")
    if kind == "text":
        _only(rf, {"type"}, "response_format")
        return None
    if kind == "json_object":
        _only(rf, {"type"}, "response_format")
        return {"kind": "json_object"}
    if kind != "json_schema":
        raise bad_request(f"response_format.type must be 'text', 'json_object' or 'json_schema', got {kind!r}",
                          "response_format.type")
    _only(rf, {"type", "json_schema"}, "response_format")
    js = rf.get("json_schema")
    if not isinstance(js, dict):
        raise bad_request("response_format.json_schema must be an object with 'name' and 'schema'",
                          "response_format.json_schema", "invalid_type")
    _only(js, {"name", "schema", "strict", "description"}, "response_format.json_schema")
    name = js.get("name")
    if not isinstance(name, str) or not name:
        raise bad_request("response_format.json_schema.name must be a non-empty string",
                          "response_format.json_schema.name")
    if js.get("strict") is not None and not isinstance(js["strict"], bool):
        raise bad_request("response_format.json_schema.strict must be a boolean", "response_format.json_schema.strict",
                          "invalid_type")
    if "schema" not in js:
        raise bad_request("response_format.json_schema.schema is required", "response_format.json_schema.schema",
                          "missing_required_parameter")
    return schema_spec(js["schema"], "response_format.json_schema.schema")


def _structured_outputs(so: Any) -> dict | None:
    if so is None:
        return None
    param = "structured_outputs"
    if not isinstance(so, dict):
        raise bad_request(f"'{param}' must be an object", param, "invalid_type")
    unknown = sorted(set(so) - set(STRUCTURED_KEYS))
    if unknown:
        raise bad_request(f"{param}: unsupported fields {unknown}; supported: {', '.join(STRUCTURED_KEYS)}",
                          f"{param}.{unknown[0]}", "unsupported_parameter")
    given = [k for k in STRUCTURED_KEYS if so.get(k) not in (None, False)]
    if len(given) != 1:
        raise bad_request(f"{param} takes exactly one of {', '.join(STRUCTURED_KEYS)}", param)
    key = given[0]
    value, where = so[key], f"{param}.{key}"
    if key == "json":
        return schema_spec(value, where)
    if key == "json_object":
        if value is not True:
            raise bad_request(f"'{where}' must be true", where, "invalid_type")
        return {"kind": "json_object"}
    if key == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
            raise bad_request(f"'{where}' must be a non-empty list of non-empty strings", where, "invalid_type")
        return {"kind": "choice", "value": list(dict.fromkeys(value))}
    if not isinstance(value, str) or not value:
        raise bad_request(f"'{where}' must be a non-empty string", where, "invalid_type")
    return {"kind": key, "value": value}


def _only(obj: dict, allowed: set[str], where: str) -> None:
    unknown = sorted(set(obj) - allowed)
    if unknown:
        raise bad_request(f"{where}: unknown fields {unknown}", f"{where}.{unknown[0]}", "unknown_parameter")
