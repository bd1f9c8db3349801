"""Stream entries to requests: decode and validate an entry of ``kaiten:requests``, or say why not.

Pure functions: the worker decides what to do with a ``RejectedEntry`` (dead-letter it, answer its
gateway when the ids could be salvaged, and delete it from the stream)."""
from __future__ import annotations

import time

import msgpack

from engine_worker.inbox import StreamEntry
from shared import names
from shared.protocol import GenerateRequest, ProtocolError, decode


class RejectedEntry(Exception):
    """An entry no engine will serve. ``request_id``/``reply_to`` when they could be salvaged."""

    def __init__(self, reason: str, request_id: str | None = None, reply_to: str | None = None):
        super().__init__(reason)
        self.reason, self.request_id, self.reply_to = reason, request_id, reply_to


def decode_entry(entry: StreamEntry, max_deliveries: int) -> GenerateRequest:
    """The request in `entry`; raises RejectedEntry for a malformed or too often delivered one."""
    payload = (entry.fields or {}).get(names.PAYLOAD_FIELD)
    try:
        if payload is None:
            raise ProtocolError(f"entry has no {names.PAYLOAD_FIELD.decode()!r} field")
        msg = decode(payload)
        if not isinstance(msg, GenerateRequest):
            raise ProtocolError(f"expected a request message on {entry.stream}, got {msg.T!r}")
        if msg.deadline is not None and (not isinstance(msg.deadline, (int, float)) or isinstance(msg.deadline, bool)):
            raise ProtocolError("request: deadline must be a number or nil")
    except ProtocolError as e:
        raise RejectedEntry(f"malformed request: {e}", *salvage_ids(payload)) from None
    if entry.deliveries > max_deliveries:
        raise RejectedEntry(f"delivered {entry.deliveries} times (max_deliveries={max_deliveries}); "
                            "the engines that took it died", msg.request_id, msg.reply_to)
    return msg


def dead_letter_fields(entry: StreamEntry, reason: str, engine_id: str, request_id: str | None) -> dict:
    """The entry for ``kaiten:requests:dead``: the payload, why, and where it came from."""
    fields = entry.fields or {}
    dead = {"m": fields.get(names.PAYLOAD_FIELD, b""), "error": reason, "source_id": entry.entry_id,
            "source_stream": entry.stream,
            "engine_id": engine_id, "deliveries": entry.deliveries, "time": repr(time.time())}
    others = {k: v for k, v in fields.items() if k != names.PAYLOAD_FIELD}
    if others:
        dead["fields"] = msgpack.packb(others, use_bin_type=True)
    if request_id is not None:
        dead["request_id"] = request_id
    return dead


def salvage_ids(payload) -> tuple[str | None, str | None]:
    """request_id and reply_to from a malformed request, when both are usable strings."""
    if not isinstance(payload, (bytes, bytearray)):
        return None, None
    try:
        body = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except Exception:       # msgpack raises several unrelated exception types
        return None, None
    if not isinstance(body, dict):
        return None, None
    rid, reply_to = body.get("request_id"), body.get("reply_to")
    if isinstance(rid, str) and rid and isinstance(reply_to, str) and reply_to:
        return rid, reply_to
    return None, None
