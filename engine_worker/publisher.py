"""What the engine sends: one ``TokenBatch`` per gateway per step, and the stream bookkeeping.

``add()`` turns the engine's ``RequestOutput``s into ``protocol.Delta``s (the one place that
conversion happens), merged per request until the next ``take()``: normally one step's worth, more
while Redis is unreachable. ``take()`` numbers the deltas (``seq`` per request) and encodes one
message per gateway; a round that failed is ``put_back()`` and re-sent first, with the same
``seq``s (a gateway drops a seq it has seen). Entries to delete from the request stream (finished,
errored, dead-lettered) and dead letters travel with the messages, after them."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from shared import names
from shared.protocol import Delta, TokenBatch, encode

if TYPE_CHECKING:
    from engine_worker.llm_engine import RequestOutput


@dataclass(slots=True)
class Outgoing:
    messages: list[tuple[str, bytes]] = field(default_factory=list)   # (channel, TokenBatch)
    dead_letters: list[dict] = field(default_factory=list)
    done_entries: list[bytes] = field(default_factory=list)           # XACK + XDEL

    def __bool__(self) -> bool:
        return bool(self.messages or self.dead_letters or self.done_entries)

    def __add__(self, later: "Outgoing") -> "Outgoing":
        return Outgoing(self.messages + later.messages, self.dead_letters + later.dead_letters,
                        self.done_entries + later.done_entries)


class Publisher:
    def __init__(self, engine_id: str):
        self.engine_id = engine_id
        self._deltas: dict[str, dict[str, Delta]] = {}     # reply_to -> request_id -> delta
        self._next_seq: dict[str, int] = {}                 # requests that have sent a delta
        self._held_back = Outgoing()                        # taken, not known to be sent

    def add(self, reply_to: str, out: "RequestOutput") -> None:
        d = self._delta(reply_to, out.request_id)
        d.token_ids.extend(out.new_token_ids)
        if out.new_logprobs:
            d.logprobs = (d.logprobs or []) + list(out.new_logprobs)
        if out.prompt_logprobs is not None:
            d.prompt_logprobs = out.prompt_logprobs
        if out.finish_reason is not None:
            d.finish_reason, d.error, d.stop_reason = out.finish_reason, out.error, out.stop_reason
            d.num_prompt_tokens, d.num_cached_tokens = out.num_prompt_tokens, out.num_cached_tokens
            d.num_output_tokens, d.metrics = out.num_output_tokens, dict(out.metrics) or None

    def terminal(self, reply_to: str, request_id: str, reason: str, error: str | None = None) -> None:
        """End a request that the engine did not (or no longer does) run."""
        d = self._delta(reply_to, request_id)
        d.finish_reason, d.error = reason, error

    def done(self, entry_id: bytes) -> None:
        """The request stream entry is finished with: acknowledge and delete it."""
        self._held_back.done_entries.append(entry_id)

    def dead_letter(self, fields: dict) -> None:
        self._held_back.dead_letters.append(fields)

    def _delta(self, reply_to: str, request_id: str) -> Delta:
        per = self._deltas.setdefault(reply_to, {})
        d = per.get(request_id)
        if d is None:
            d = per[request_id] = Delta(request_id, 0, [])
        return d

    def started(self, request_id: str, reply_to: str) -> bool:
        """Has anything of this request been sent, or is about to be?"""
        return request_id in self._next_seq or request_id in self._deltas.get(reply_to, {})

    def has_outgoing(self) -> bool:
        return bool(self._deltas) or bool(self._held_back)

    def take(self) -> Outgoing:
        """Everything to send now, messages encoded; put_back() it if it could not be sent."""
        out, self._held_back = self._held_back, Outgoing()
        for reply_to, per in self._deltas.items():
            for rid, d in per.items():
                d.seq = self._next_seq.get(rid, 0)
                if d.finish_reason is None:
                    self._next_seq[rid] = d.seq + 1
                else:
                    self._next_seq.pop(rid, None)
            batch = TokenBatch(self.engine_id, list(per.values()))
            out.messages.append((names.reply_channel(reply_to), encode(batch)))
        self._deltas = {}
        return out

    def put_back(self, out: Outgoing) -> None:
        """A round that failed: its writes go first in the next one, in their order."""
        self._held_back = out + self._held_back
