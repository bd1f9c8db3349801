"""The API's response bodies as pydantic models, and ``encode``, through which every body is built:
a body is validated as its model and serialized by it, so /openapi.json (gateway/api/openapi.py) and
the bytes agree. The request models are in gateway/api/api_models.py.
"""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict


class Reply(BaseModel):
    """A response body or part: exactly these fields (the spec says additionalProperties: false)."""
    model_config = ConfigDict(extra="forbid")


class ErrorDetail(Reply):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(Reply):
    error: ErrorDetail


class PromptTokensDetails(Reply):
    cached_tokens: int


class Usage(Reply):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(Reply):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class PromptLogprob(Reply):
    logprob: float
    rank: int | None
    decoded_token: str


PromptLogprobs = list[dict[str, PromptLogprob] | None] | None
FinishReason = Literal["stop", "length", "tool_calls", "abort", "error", "cancelled"] | None


class CompletionChoice(Reply):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: FinishReason
    stop_reason: int | str | None = None
    prompt_logprobs: PromptLogprobs = None


class CompletionResponse(Reply):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(Reply):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(Reply):
    content: list[TokenLogprob] | None
    refusal: None = None


class ResponseFunctionCall(Reply):
    name: str
    arguments: str


class ResponseToolCall(Reply):
    id: str
    type: Literal["function"]
    function: ResponseFunctionCall


class AssistantMessage(Reply):
    role: Literal["assistant"]
    content: str | None
    tool_calls: list[ResponseToolCall] | None = None


class ChatChoice(Reply):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: FinishReason
    stop_reason: int | str | None = None


class ChatCompletionResponse(Reply):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None
    prompt_logprobs: PromptLogprobs = None


class DeltaFunctionCall(Reply):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(Reply):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None


class Delta(Reply):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatChunkChoice(Reply):
    index: int
    delta: Delta
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(Reply):
    """One ``data:`` event of a streamed chat completion (the stream ends with ``data: [DONE]``)."""
    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class CompletionChunkChoice(Reply):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReason = None
    stop_reason: int | str | None = None


class CompletionChunk(Reply):
    """One ``data:`` event of a streamed completion (the stream ends with ``data: [DONE]``)."""
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChunkChoice]
    usage: Usage | None = None


class TokenizeResponse(Reply):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(Reply):
    prompt: str


class ModelCard(Reply):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    root: str
    parent: str | None
    max_model_len: int
    engines: int


class ModelList(Reply):
    object: Literal["list"]
    data: list[ModelCard]


def encode(model: type[Reply], body: dict) -> bytes:
    """`body` as JSON, validated as `model` (a wrong or undeclared field raises) and serialized by
    it. Only the fields `body` gives are written: an optional field it leaves out stays out (vLLM's
    chunks are written with exclude_unset too). The model's own validator and serializer, called
    directly: a stream writes a chunk per token, and TypeAdapter's wrappers cost as much again."""
    return model.__pydantic_serializer__.to_json(model.__pydantic_validator__.validate_python(body),
                                                 exclude_unset=True)


def sse(model: type[Reply], body: dict) -> bytes:
    """One server-sent event carrying `body`."""
    return b"data: " + encode(model, body) + b"\n\n"
