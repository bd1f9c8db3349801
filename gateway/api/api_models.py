"""The API's request bodies as pydantic models: vLLM's field names, OpenAI's types,
defaults and limits (the sampling fields' limits come from shared/sampling_limits.py, as the
engine's do). They validate every request (``validate``) and generate /openapi.json
(gateway/api/openapi.py). Rules that need the model (vocabulary, context, max n) or join fields
are in gateway/api/openai_api.py.

Requests are strict (no "10" for 10, no true for 1, no NaN). A field no model knows is ignored with
one warning; a known field Kaiten does not implement (``UNSUPPORTED_FIELDS``) is a 400 unless it
has its off value.
"""
from __future__ import annotations

import json
import logging
from typing import Annotated, Any, ClassVar, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from shared.sampling_limits import LIMITS, MAX_LOGIT_BIAS, MAX_STOP_LEN, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS

from .errors import APIError, bad_request

log = logging.getLogger("kaiten.gateway")

MAX_PROMPTS = 64              # completions: a batch of prompts in one request
TOOL_NAME = r"^[A-Za-z0-9_.-]{1,64}$"

# vLLM's generation fields that Kaiten does not implement, with their "off" value: anything else is
# a 400.
UNSUPPORTED_FIELDS: dict[str, Any] = {
    "use_beam_search": False, "length_penalty": 1.0, "allowed_token_ids": None, "bad_words": None,
    "truncate_prompt_tokens": None, "guided_json": None, "guided_regex": None,
    "guided_choice": None, "guided_grammar": None, "guided_decoding_backend": None,
    "guided_whitespace_pattern": None, "logits_processors": None, "priority": 0,
    "prompt_embeds": None, "documents": None, "mm_processor_kwargs": None, "kv_transfer_params": None,
    "vllm_xargs": None,
}

TokenId = Annotated[int, Field(ge=0)]
NonEmpty = Annotated[str, Field(min_length=1)]
StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_LEN)]
JsonObject = dict[str, Any]


class Strict(BaseModel):
    """A request part: strict types, finite numbers, unknown fields refused."""
    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="forbid")


def _any_other_fields(schema: dict[str, Any]) -> None:
    """A body's schema leaves additionalProperties unsaid (JSON Schema's default: any): "true" from
    extra="allow" made Schemathesis generate deep junk fields, which crashed its generator."""
    schema.pop("additionalProperties", None)


class Body(Strict):
    """A request body: unknown fields kept aside in ``model_extra`` and ignored (``validate`` warns
    about them); its ``UNSUPPORTED`` fields refused unless off."""
    model_config = ConfigDict(extra="allow", json_schema_extra=_any_other_fields)
    UNSUPPORTED: ClassVar[dict[str, Any]] = {}


# ---------------------------------------------------------------------- parts
class StreamOptions(Strict):
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None


class TextPart(Strict):
    type: Literal["text"]
    text: str


class ImageURL(Strict):
    url: str
    detail: Literal["auto", "low", "high"] | None = None


class ImagePart(Strict):
    """Declared so it is named in the error; Kaiten's models take text only (a 400)."""
    type: Literal["image_url"]
    image_url: ImageURL


class InputAudio(Strict):
    data: str
    format: str


class AudioPart(Strict):
    """Declared so it is named in the error; Kaiten's models take text only (a 400)."""
    type: Literal["input_audio"]
    input_audio: InputAudio


ContentPart = Annotated[Union[TextPart, ImagePart, AudioPart], Field(discriminator="type")]


class FunctionCall(Strict):
    name: str
    arguments: str = Field(description="the arguments as JSON text")


class ToolCall(Strict):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(Strict):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    refusal: str | None = None


class FunctionDefinition(Strict):
    name: str = Field(pattern=TOOL_NAME)
    description: str | None = None
    parameters: JsonObject | None = Field(None, description="a JSON schema object")
    strict: bool | None = None


class Tool(Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(Strict):
    name: str


class NamedToolChoice(Strict):
    type: Literal["function"]
    function: NamedFunction


class JsonSchemaFormat(Strict):
    name: NonEmpty
    schema_: JsonObject | str = Field(alias="schema", description="a JSON schema (an object, or its JSON text)")
    strict: bool | None = None
    description: str | None = None


class TextFormat(Strict):
    type: Literal["text"]


class JsonObjectFormat(Strict):
    type: Literal["json_object"]


class JsonSchemaResponseFormat(Strict):
    type: Literal["json_schema"]
    json_schema: JsonSchemaFormat


ResponseFormat = Annotated[Union[TextFormat, JsonObjectFormat, JsonSchemaResponseFormat], Field(discriminator="type")]


class StructuredOutputs(Strict):
    """vLLM's structured outputs: exactly one of these."""
    json_: JsonObject | str | None = Field(None, alias="json")
    regex: NonEmpty | None = None
    choice: Annotated[list[NonEmpty], Field(min_length=1)] | None = None
    grammar: NonEmpty | None = None
    json_object: bool | None = None


# ---------------------------------------------------------------------- requests
class SamplingRequest(Body):
    """The fields both generation APIs share. Unset (null) sampling fields take the model's
    defaults (its generation_config.json)."""
    UNSUPPORTED: ClassVar[dict[str, Any]] = UNSUPPORTED_FIELDS
    model: str | None = None
    n: Annotated[int, Field(**LIMITS["n"].bounds())] = 1
    # 0: a completion's echo alone (gateway/api/openai_api.py); else at least LIMITS["max_tokens"]'s 1.
    max_tokens: Annotated[int, Field(ge=0)] | None = None
    temperature: Annotated[float, Field(**LIMITS["temperature"].bounds())] | None = None
    top_p: Annotated[float, Field(**LIMITS["top_p"].bounds())] | None = None
    top_k: Annotated[int, Field(**LIMITS["top_k"].bounds())] | None = None
    min_p: Annotated[float, Field(**LIMITS["min_p"].bounds())] | None = None
    presence_penalty: Annotated[float, Field(**LIMITS["presence_penalty"].bounds())] | None = None
    frequency_penalty: Annotated[float, Field(**LIMITS["frequency_penalty"].bounds())] | None = None
    repetition_penalty: Annotated[float, Field(**LIMITS["repetition_penalty"].bounds())] | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)] | None = None
    stop_token_ids: Annotated[list[TokenId], Field(max_length=MAX_STOP_TOKEN_IDS)] | None = None
    seed: Annotated[int, Field(**LIMITS["seed"].bounds())] | None = None
    ignore_eos: bool | None = None
    min_tokens: Annotated[int, Field(**LIMITS["min_tokens"].bounds())] | None = None
    logit_bias: Annotated[dict[Annotated[str, Field(pattern=r"^\s*[+-]?\d+\s*$")],
                               Annotated[float, Field(**LIMITS["logit_bias"].bounds())]],
                          Field(max_length=MAX_LOGIT_BIAS)] | None = None
    user: str | None = None
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    return_tokens_as_token_ids: bool | None = None
    prompt_logprobs: Annotated[int, Field(**LIMITS["prompt_logprobs"].bounds())] | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    extra_body: JsonObject | None = Field(None, description="fields merged into the body (as some clients send them)")
    # Known, not implemented: a 400 unless off (UNSUPPORTED_FIELDS).
    use_beam_search: Any = None
    length_penalty: Any = None
    allowed_token_ids: Any = None
    bad_words: Any = None
    truncate_prompt_tokens: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    guided_decoding_backend: Any = None
    guided_whitespace_pattern: Any = None
    logits_processors: Any = None
    priority: Any = None
    prompt_embeds: Any = None
    documents: Any = None
    mm_processor_kwargs: Any = None
    kv_transfer_params: Any = None
    vllm_xargs: Any = None


Prompt = Union[str, list[str], list[TokenId], list[list[TokenId]]]


class CompletionRequest(SamplingRequest):
    prompt: Annotated[Prompt, Field(description="a string, a list of strings, a list of token ids or a list "
                                                "of lists of token ids")]
    logprobs: Annotated[int, Field(**LIMITS["logprobs"].bounds())] | None = None
    echo: bool | None = None
    suffix: str | None = Field(None, description="not supported: only null or empty")
    best_of: Annotated[int, Field(**LIMITS["n"].bounds())] | None = Field(None, description="only equal to n")
    add_special_tokens: bool = Field(True, description="add the tokenizer's special tokens (e.g. BOS) to a text prompt")


class ChatTemplateFields(Body):
    """vLLM's chat template fields (chat completions and /tokenize)."""
    model: str | None = None
    messages: Annotated[list[Message], Field(min_length=1)]
    chat_template: str | None = None
    chat_template_kwargs: JsonObject | None = None
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None


class ToolFields(Body):
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None


class ChatCompletionRequest(ChatTemplateFields, ToolFields, SamplingRequest):
    max_completion_tokens: Annotated[int, Field(**LIMITS["max_tokens"].bounds())] | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Field(**LIMITS["top_logprobs"].bounds())] | None = None
    store: bool | None = None
    metadata: JsonObject | None = None
    service_tier: str | None = None
    add_special_tokens: bool = Field(False, description="add the tokenizer's special tokens (e.g. BOS) on top of "
                                                        "the chat template's")


class TokenizeCompletionRequest(Body):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = Field(True, description="add the tokenizer's special tokens (e.g. BOS)")
    return_token_strs: bool | None = None


class LoadLoRAAdapterRequest(Body):
    """vLLM's body; `model` (Kaiten's) names the base model where the gateway serves several."""
    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)
    model: str | None = Field(None, description="the base model (needed when the gateway serves several)")


class UnloadLoRAAdapterRequest(Body):
    lora_name: str = Field(min_length=1)
    lora_int_id: int | None = Field(None, description="accepted for vLLM's clients; the name decides")


class TokenizeChatRequest(ChatTemplateFields):
    add_special_tokens: bool = Field(False, description="add the tokenizer's special tokens (e.g. BOS) on top of "
                                                        "what the chat template writes (as vLLM; most templates "
                                                        "write them, hence the default)")
    return_token_strs: bool | None = None


class DetokenizeRequest(Body):
    model: str | None = None
    tokens: list[TokenId]


# ---------------------------------------------------------------------- validation
_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "dict", "list", "none"})


def _param(loc: tuple) -> str | None:
    """An error location as a field path: ``messages[0].content``."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part.isidentifier() and part not in _TYPE_TAGS:
            out += ("." if out else "") + part
    return out or None


def _error(e: ValidationError) -> APIError:
    err = e.errors(include_url=False)[0]
    kind = err["type"]
    if kind == "json_invalid":
        return bad_request(f"invalid JSON in the request body: {err['ctx']['error']}", None, "invalid_json")
    if not err["loc"]:
        return bad_request("the request body must be a JSON object", None, "invalid_type")
    param = _param(err["loc"])
    if kind == "union_tag_invalid":            # name the tag field: response_format.type
        param = f"{param}.{err['ctx']['discriminator'].strip(chr(39))}"
    if kind == "missing":
        return bad_request(f"'{param}' is required", param, "missing_required_parameter")
    if kind == "extra_forbidden":
        return bad_request(f"unknown field '{param}'", param, "unknown_parameter")
    code = "invalid_type" if kind.endswith("_type") or kind == "union_tag_invalid" else "invalid_value"
    return bad_request(f"'{param}': {err['msg']}", param, code)


def flatten(body: dict) -> dict:
    """The body with an "extra_body" object's fields (as some clients send them) merged in."""
    extra = body.get("extra_body")
    if extra is None:
        return body
    if not isinstance(extra, dict):
        raise bad_request("'extra_body' must be an object", "extra_body", "invalid_type")
    clash = sorted(set(extra) & set(body))
    if clash or "extra_body" in extra:
        raise bad_request(f"'{(clash or ['extra_body'])[0]}' is given both in the body and in 'extra_body'",
                          "extra_body")
    merged = {k: v for k, v in body.items() if k != "extra_body"}
    merged.update(extra)
    return merged


def _names(names: set[str], most: int = 16) -> str:
    """Field names for a log line: escaped (no newlines or controls from a client), at most `most`."""
    shown = [n[:64].encode("unicode_escape").decode("ascii") for n in sorted(names)[:most]]
    return ", ".join(shown) + (f" and {len(names) - most} more" if len(names) > most else "")


def validate(model: type[Body], body: bytes | Any, allowed: frozenset[str] | None = None) -> Any:
    """`body` as `model`: validated straight from the JSON bytes (``model_validate_json``), or from
    the decoded JSON where fields outside `allowed` are dropped. "extra_body" merged, unknown fields
    warned about, known unsupported fields refused unless off. A 400 names the field."""
    if isinstance(body, bytes):
        req = _validated(model.model_validate_json, body)
        if getattr(req, "extra_body", None) is None:
            return _checked(req)
        body = json.loads(body)           # rare: merge extra_body's fields, then validate again
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object", None, "invalid_type")
    if allowed is not None and body.keys() - allowed:
        log.warning("ignoring unknown request fields: %s", _names(body.keys() - allowed))
        body = {k: v for k, v in body.items() if k in allowed}
    if "extra_body" in model.model_fields:
        body = flatten(body)
    return _checked(_validated(model.model_validate, body))


def _validated(validator, body: Any) -> Any:
    try:
        return validator(body)
    except ValidationError as e:
        raise _error(e) from None


def _checked(req: Body) -> Body:
    if req.model_extra:
        log.warning("ignoring unknown request fields: %s", _names(set(req.model_extra)))
    for name in req.model_fields_set & req.UNSUPPORTED.keys():
        v = getattr(req, name)
        if v is not None and v != req.UNSUPPORTED[name] and v not in ([], {}):
            raise bad_request(f"'{name}' is not supported", name, "unsupported_parameter")
    return req
