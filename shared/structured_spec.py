"""The engine's structured-output spec ``{"kind": K, "value": V}`` (a ``SamplingParams`` field): its
kinds and size, and the check of its shape. What each kind means and how the engine compiles it:
engine_worker/engine/structured_output.py. Plain Python (no torch, no xgrammar): the gateway
builds specs (gateway/api/structured.py) and ``SamplingParams.validate`` checks them with it."""
from __future__ import annotations

import json
from typing import Any

KINDS = ("json", "json_object", "regex", "choice", "grammar")
MAX_SPEC_CHARS = 1 << 20          # the value's JSON text


def validate_spec(spec: Any) -> None:
    """Check the shape of a ``structured_output`` map (compiling is what proves it valid)."""
    if not isinstance(spec, dict) or set(spec) - {"kind", "value"} or spec.get("kind") not in KINDS:
        raise ValueError(f"structured_output must be a map {{'kind': one of {', '.join(KINDS)}, 'value': ...}}, "
                         f"got {spec!r:.200}")
    kind, value = spec["kind"], spec.get("value")
    if kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
            raise ValueError("structured_output choice: 'value' must be a non-empty list of non-empty strings")
    elif kind != "json_object" and (not isinstance(value, str) or not value):
        raise ValueError(f"structured_output {kind}: 'value' must be a non-empty string")
    if len(json.dumps(value)) > MAX_SPEC_CHARS:
        raise ValueError(f"structured_output {kind}: the specification is larger than {MAX_SPEC_CHARS} characters")
