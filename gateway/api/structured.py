"""Structured-output requests: OpenAI ``response_format`` and vLLM's ``structured_outputs`` extras,
checked here and turned into the engine's ``structured_output`` spec ``{"kind", "value"}``
(shared/structured_spec.py; what the engine does with it: engine_worker/engine/structured_output.py).

    response_format     {"type": "text"} | {"type": "json_object"}
                        | {"type": "json_schema", "json_schema": {"name", "schema", "strict", "description"}}
    structured_outputs  exactly one of {"json": schema}, {"regex": str}, {"choice": [str, ...]},
                        {"grammar": EBNF str}, {"json_object": true}

The shapes are the models of gateway/api/api_models.py; only the rules across them are checked here (the gateway does not load xgrammar, which pulls in torch): the
engine compiles the grammar, and one that does not compile comes back as a 400 with xgrammar's
reason before any token is generated.
"""
from __future__ import annotations

import json
from typing import Any

from shared.structured_spec import MAX_SPEC_CHARS

from .api_models import SamplingRequest, StructuredOutputs
from .errors import bad_request

STRUCTURED_KEYS = ("json", "regex", "choice", "grammar", "json_object")


def structured_spec(req: SamplingRequest) -> dict | None:
    """The engine spec for `req`'s response_format / structured_outputs, or None (free text)."""
    rf = req.response_format
    from_rf = None
    if rf is not None and rf.type == "json_object":
        from_rf = {"kind": "json_object"}
    elif rf is not None and rf.type == "json_schema":
        from_rf = schema_spec(rf.json_schema.schema_, "response_format.json_schema.schema")
    from_so = _structured_outputs(req.structured_outputs)
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


def _structured_outputs(so: StructuredOutputs | None) -> dict | None:
    if so is None:
        return None
    given = {k: v for k, v in so.model_dump(by_alias=True).items() if v not in (None, False)}
    if len(given) != 1:
        raise bad_request(f"structured_outputs takes exactly one of {', '.join(STRUCTURED_KEYS)}",
                          "structured_outputs")
    (key, value), = given.items()
    if key == "json":
        return schema_spec(value, "structured_outputs.json")
    if key == "json_object":
        return {"kind": "json_object"}
    if key == "choice":
        return {"kind": "choice", "value": list(dict.fromkeys(value))}
    return {"kind": key, "value": value}
