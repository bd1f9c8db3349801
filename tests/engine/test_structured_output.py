"""Structured output in the engine (xgrammar): the grammar forces the tiny random model's output.

The model is random, so only the grammar can make its output valid: every test here checks the
output by its effect (jsonschema validates it, the regex matches it, it is one of the choices).
"""
from __future__ import annotations

import json
import re

import jsonschema
import pytest

from engine_worker import LLM, SamplingParams

S = {"type": "string", "maxLength": 8}
SCHEMAS = [
    {"type": "object", "properties": {"name": S, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"]},
    {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"]},
    {"type": "object", "properties": {"x": {"type": "number", "minimum": -1.5, "maximum": 2.5}}, "required": ["x"]},
    {"type": "object", "properties": {"tags": {"type": "array", "items": S, "minItems": 1, "maxItems": 3}},
     "required": ["tags"]},
    {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "object", "properties": {
        "c": {"type": "integer", "minimum": 1, "maximum": 9}}, "required": ["c"]}}, "required": ["b"]}},
     "required": ["a"]},
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}, "minItems": 2, "maxItems": 4},
    {"type": "object", "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 1000}, "note": S},
     "required": ["id"]},                                                      # an optional field
    {"type": "object", "properties": {"v": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 5},
                                                      {"type": "null"}]}}, "required": ["v"]},
    {"type": "object", "properties": {"kind": {"const": "point"}, "xy": {
        "type": "array", "prefixItems": [{"type": "integer", "minimum": 0, "maximum": 9}] * 2, "items": False}},
     "required": ["kind", "xy"]},
    {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{3}$"}},
     "required": ["code"]},
    {"type": "object", "properties": {"people": {"type": "array", "maxItems": 2, "items": {
        "type": "object", "properties": {"n": S, "k": {"enum": [1, 2, 3]}}, "required": ["n", "k"]}}},
     "required": ["people"]},
    {"$defs": {"leaf": {"type": "object", "properties": {"w": {"type": "boolean"}}, "required": ["w"]}},
     "type": "object", "properties": {"l": {"$ref": "#/$defs/leaf"}, "r": {"$ref": "#/$defs/leaf"}},
     "required": ["l", "r"]},
    {"type": "object", "properties": {"p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1}},
     "required": ["p"]},
    {"type": "object", "properties": {"s": {"type": "string", "minLength": 2, "maxLength": 4}}, "required": ["s"]},
    {"enum": ["alpha", "beta", 3, None]},
    {"type": "object", "properties": {"m": {"type": "object", "properties": {"q": {"type": "integer", "minimum": -5,
                                                                                   "maximum": 5}}}},
     "required": ["m"]},                                              # nested, all fields optional
    {"type": "object", "properties": {"flags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 5},
                                      "count": {"type": "integer", "minimum": 0, "maximum": 3}},
     "required": ["flags", "count"]},
    {"type": "object", "properties": {"u": {"oneOf": [{"type": "string", "enum": ["on", "off"]},
                                                      {"type": "integer", "minimum": 10, "maximum": 20}]}},
     "required": ["u"]},
    {"type": "integer", "minimum": 100, "maximum": 200},
]


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(str(tiny_model_dir), dtype="float32", kv_cache_memory="4MiB", enforce_eager=True)


def _params(kind, value=None, **kw) -> SamplingParams:
    spec = {"kind": kind} if value is None else {"kind": kind, "value": value}
    return SamplingParams(**({"temperature": 1.0, "max_tokens": 200} | kw), structured_output=spec)


def test_twenty_schemas_validate_at_temperature_1(llm):
    assert len(SCHEMAS) == 20
    params = [_params("json", json.dumps(s), seed=i) for i, s in enumerate(SCHEMAS)]
    outs = llm.generate(["Hello world"] * len(SCHEMAS), params)
    for schema, out in zip(SCHEMAS, outs):
        assert out.finish_reason == "stop", (schema, out.text)
        jsonschema.validate(json.loads(out.text), schema)


def test_json_object_choice_regex_grammar(llm):
    outs = llm.generate(["Hello"] * 6, [
        _params("json_object", seed=1),
        _params("choice", ["yes", "no", 'say "maybe"'], seed=2),
        _params("regex", r"[0-9]{3}-[a-z]{2,4}", seed=3),
        _params("grammar", 'root ::= "A" [0-9] [0-9]? "Z"', seed=4),
        _params("choice", ["yes", "no", 'say "maybe"'], temperature=0),
        _params("regex", r"(cat|dog)s?", temperature=0),
    ])
    assert all(o.finish_reason == "stop" for o in outs), [(o.text, o.finish_reason) for o in outs]
    assert isinstance(json.loads(outs[0].text), dict)
    assert outs[1].text in ("yes", "no", 'say "maybe"') and outs[4].text in ("yes", "no", 'say "maybe"')
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", outs[2].text)
    assert re.fullmatch(r"A[0-9][0-9]?Z", outs[3].text)
    assert re.fullmatch(r"(cat|dog)s?", outs[5].text)


def test_bad_grammars_fail_their_request_only(llm):
    free = SamplingParams(temperature=0, max_tokens=8)
    alone = llm.generate(["The quick brown fox"], free)[0]
    outs = llm.generate(["The quick brown fox", "a", "b", "c"], [
        free, _params("json", '{"type": "nonsense"}'), _params("regex", "a(b"), _params("grammar", "root ::= foo")])
    assert outs[0].token_ids == alone.token_ids and outs[0].finish_reason == alone.finish_reason
    assert [o.finish_reason for o in outs[1:]] == ["error"] * 3
    assert 'Unsupported type "nonsense"' in outs[1].error and outs[1].error.startswith("invalid structured output json")
    assert "parenthesis" in outs[2].error and 'Rule "foo" is not defined' in outs[3].error
    llm.engine.check_block_accounting()


def test_free_requests_are_untouched_by_constrained_neighbours(llm):
    """Greedy free requests give the same tokens whether constrained requests share their batch or not."""
    free = SamplingParams(temperature=0, max_tokens=12)
    prompts = ["Hello world", "Paris is the capital of"]
    alone = llm.generate(prompts, free)
    mixed = llm.generate(prompts + ["x", "y"], [free, free, _params("json", json.dumps(SCHEMAS[0])),
                                                _params("choice", ["a", "b"])])
    assert [o.token_ids for o in mixed[:2]] == [o.token_ids for o in alone]


def test_compiled_grammars_are_cached_by_spec(llm):
    cache = llm.engine.structured.compiled_cache
    spec = json.dumps({"type": "object", "properties": {"z": {"type": "boolean"}}, "required": ["z"]})
    llm.generate(["a", "b"], _params("json", spec))
    n = len(cache)
    assert ("json", spec) in cache
    outs = llm.generate(["c"] * 3, _params("json", spec))
    assert len(cache) == n and all(isinstance(json.loads(o.text)["z"], bool) for o in outs)


def test_abort_while_compiling_and_invalid_specs(llm):
    engine = llm.engine
    engine.add_request("slow", [5, 6, 7], _params("json", json.dumps({"type": "object", "properties": {
        f"k{i}": {"type": "integer"} for i in range(40)}})))
    assert engine.abort_request("slow")
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    assert [(o.request_id, o.finish_reason) for o in outs] == [("slow", "abort")]
    for bad in ({"kind": "xml", "value": "x"}, {"kind": "choice", "value": []}, {"kind": "regex", "value": 3},
                {"kind": "json", "value": "{}", "extra": 1}, "json"):
        with pytest.raises(ValueError, match="structured_output"):
            engine.add_request("bad", [1, 2], SamplingParams(structured_output=bad))
    assert not engine.has_unfinished()
