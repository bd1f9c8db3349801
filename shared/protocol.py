"""The wire protocol between gateways and engine workers: msgpack maps, never pickle.

Every message is a map with ``v`` (protocol version) and ``t`` (type). Types:

- ``request``  gateway -> engines (stream ``kaiten:requests``)
- ``abort``    gateway -> engines (stream ``kaiten:aborts``)
- ``tokens``   engine -> one gateway (pub/sub): every delta that gateway's requests got in one step,
  and the requests the engine admitted in that step (``admitted``: from then on the gateway knows
  which engine holds them). ``engine_worker/publisher.py`` builds them from ``Delta`` and
  ``TokenBatch``; fields at their default are left out on the wire and filled in by ``decode``.
- ``control``  gateway -> every engine of one model (stream ``names.control_stream(model)``): load or
  unload a LoRA adapter at run time. Each engine reports the outcome under ``op_id`` in its
  heartbeat (``control_results``) and announces its adapters (``adapters``).
- ``handoff``  engine -> one gateway (pub/sub): "these requests of yours get no more tokens from me;
  move them" (the engine is shutting down, or its janitor found them at a dead engine). The gateway
  resubmits each as a continuation (``gateway/backend/failover.py``).

A delta carries a per-request sequence number ``seq`` (0, 1, 2, ...). The last delta of a request
has ``finish_reason`` set; ``finish_reason == "error"`` comes with ``error`` text. So "finish" and
"error" are terminal deltas, numbered like any other, and a gap is visible. ``finish_reason ==
"stop"`` means the request's last token is an EOS or one of its stop token ids (``stop_reason``
names the latter); gateways do not show that token as text.

Versions: 1 had ``request``, ``abort`` and ``tokens``. 2 added the continuation fields of a request
(``num_generated``, ``first_seq``), ``TokenBatch.admitted`` and ``handoff``. A decoder accepts
both; a version-1 message simply has none of the new fields. 3 added ``lora_name`` to a request
(the LoRA adapter to run it through; "" for the base model, and left out on the wire then) and the
``control`` message.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import msgpack

PROTOCOL_VERSION = 3
SUPPORTED_VERSIONS = (1, 2, 3)
HANDOFF_REASONS = ("shutdown", "engine_lost", "restarted")
FINISH_REASONS = ("stop", "length", "abort", "error")
CONTROL_OPS = ("load_lora", "unload_lora")


class ProtocolError(ValueError):
    """A message that cannot be decoded or does not match the protocol."""


@dataclass(slots=True)
class GenerateRequest:
    request_id: str
    reply_to: str                       # gateway id; replies go to names.reply_channel(reply_to)
    prompt_token_ids: list[int]
    params: dict[str, Any]              # SamplingParams fields (engine_worker.SamplingParams)
    arrival_time: float = 0.0           # gateway clock, informational only
    deadline: float | None = None       # gateway clock (unix seconds); engine may drop late work
    # A continuation (failover): the last `num_generated` prompt tokens are this request's own
    # output from an engine that was lost; its deltas are numbered from `first_seq`.
    num_generated: int = 0
    first_seq: int = 0
    lora_name: str = ""                 # LoRA adapter to run through; "" for the base model
    T = "request"


@dataclass(slots=True)
class Abort:
    request_id: str
    reply_to: str = ""
    T = "abort"


@dataclass(slots=True)
class Control:
    op_id: str                          # unique; the engines report its outcome under it
    op: str                             # one of CONTROL_OPS
    lora_name: str
    lora_path: str = ""                 # load_lora: the adapter's directory
    T = "control"


@dataclass(slots=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)   # (token_id, logprob), best first
    rank: int | None = None             # prompt logprobs: the token's rank in its distribution (1: the top)


@dataclass(slots=True)
class Delta:
    request_id: str
    seq: int
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None
    error: str | None = None
    stop_reason: int | None = None      # the stop token id that ended it ("stop" by EOS: None)
    # On the first delta of a request that asked: one per prompt token (the first has none: None).
    prompt_logprobs: list[TokenLogprob | None] | None = None
    # Filled on the terminal delta: usage and the engine's own event times (engine clock).
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_output_tokens: int = 0
    metrics: dict[str, float] | None = None


@dataclass(slots=True)
class TokenBatch:
    engine_id: str
    deltas: list[Delta]
    admitted: list[str] = field(default_factory=list)   # request ids this engine took in this step
    T = "tokens"


@dataclass(slots=True)
class Handoff:
    engine_id: str
    request_ids: list[str]
    reason: str                         # one of HANDOFF_REASONS
    T = "handoff"


_TYPES: dict[str, type] = {c.T: c for c in (GenerateRequest, Abort, TokenBatch, Handoff, Control)}


def _to_wire(obj: Any) -> Any:
    """Plain msgpack-able values. A field still at its (plain) default is left out: the decoder
    fills it in, so messages stay small and old readers see the fields they always saw."""
    if dataclasses.is_dataclass(obj):
        return {f.name: _to_wire(v) for f in dataclasses.fields(obj)
                if (v := getattr(obj, f.name)) is not f.default and not _is_plain_default(v, f)}
    if isinstance(obj, (list, tuple)):
        return [_to_wire(x) for x in obj]
    return obj


def _is_plain_default(value: Any, f: dataclasses.Field) -> bool:
    default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
    return default is not dataclasses.MISSING and type(value) is type(default) and value == default


Message = GenerateRequest | Abort | TokenBatch | Handoff | Control


def encode(msg: Message) -> bytes:
    body = _to_wire(msg)
    body["v"] = PROTOCOL_VERSION
    body["t"] = msg.T
    return msgpack.packb(body, use_bin_type=True)


def _build(cls: type, body: dict) -> Any:
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = set(body) - names
    if unknown:
        raise ProtocolError(f"{cls.T}: unknown fields {sorted(unknown)}")
    try:
        return cls(**body)
    except TypeError as e:
        raise ProtocolError(f"{cls.T}: {e}") from None


def _check(cond: bool, what: str) -> None:
    if not cond:
        raise ProtocolError(what)


def _decode_request(body: dict) -> GenerateRequest:
    req = _build(GenerateRequest, body)
    _check(isinstance(req.request_id, str) and req.request_id != "", "request: request_id must be a non-empty string")
    _check(isinstance(req.reply_to, str) and req.reply_to != "", "request: reply_to must be a non-empty string")
    _check(isinstance(req.prompt_token_ids, list) and all(type(t) is int for t in req.prompt_token_ids),
           "request: prompt_token_ids must be a list of ints")
    _check(isinstance(req.params, dict), "request: params must be a map")
    _check(isinstance(req.lora_name, str), "request: lora_name must be a string")
    for name in ("num_generated", "first_seq"):
        _check(type(getattr(req, name)) is int and getattr(req, name) >= 0, f"request: {name} must be an int >= 0")
    _check(req.num_generated < max(1, len(req.prompt_token_ids)),
           "request: num_generated must be smaller than the prompt")
    return req


def _str_list(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(x, str) for x in value)


def _decode_tokens(body: dict) -> TokenBatch:
    _check(isinstance(body.get("deltas"), list), "tokens: deltas must be a list")
    deltas = []
    for d in body["deltas"]:
        _check(isinstance(d, dict), "tokens: a delta must be a map")
        delta = _build(Delta, d)
        if delta.logprobs is not None:
            delta.logprobs = [_token_logprob(lp) for lp in delta.logprobs]
        if delta.prompt_logprobs is not None:
            delta.prompt_logprobs = [None if lp is None else _token_logprob(lp) for lp in delta.prompt_logprobs]
        deltas.append(delta)
    body["deltas"] = deltas
    batch = _build(TokenBatch, body)
    _check(_str_list(batch.admitted), "tokens: admitted must be a list of strings")
    return batch


def _token_logprob(body: Any) -> TokenLogprob:
    _check(isinstance(body, dict), "tokens: a logprob must be a map")
    lp = _build(TokenLogprob, body)
    lp.top = [tuple(x) for x in lp.top]
    return lp


def _decode_handoff(body: dict) -> Handoff:
    msg = _build(Handoff, body)
    _check(isinstance(msg.engine_id, str), "handoff: engine_id must be a string")
    _check(_str_list(msg.request_ids), "handoff: request_ids must be a list of strings")
    _check(msg.reason in HANDOFF_REASONS, f"handoff: reason must be one of {HANDOFF_REASONS}")
    return msg


def _decode_control(body: dict) -> Control:
    msg = _build(Control, body)
    _check(isinstance(msg.op_id, str) and msg.op_id != "", "control: op_id must be a non-empty string")
    _check(msg.op in CONTROL_OPS, f"control: op must be one of {CONTROL_OPS}")
    _check(isinstance(msg.lora_name, str) and msg.lora_name != "", "control: lora_name must be a non-empty string")
    _check(isinstance(msg.lora_path, str), "control: lora_path must be a string")
    return msg


def decode(data: bytes) -> Message:
    """Decode and validate one message. Raises ProtocolError on anything malformed."""
    try:
        body = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except Exception as e:  # msgpack raises several unrelated exception types
        raise ProtocolError(f"not msgpack: {e}") from None
    _check(isinstance(body, dict), "message must be a map")
    version = body.pop("v", None)
    _check(version in SUPPORTED_VERSIONS, f"unsupported protocol version {version!r}")
    kind = body.pop("t", None)
    _check(kind in _TYPES, f"unknown message type {kind!r}")
    if kind == GenerateRequest.T:
        return _decode_request(body)
    if kind == TokenBatch.T:
        return _decode_tokens(body)
    if kind == Handoff.T:
        return _decode_handoff(body)
    if kind == Control.T:
        return _decode_control(body)
    abort = _build(Abort, body)
    _check(isinstance(abort.request_id, str), "abort: request_id must be a string")
    return abort
