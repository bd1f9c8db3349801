"""What the engine sends: one ``TokenBatch`` per gateway per step (then any ``Handoff``), and the
stream bookkeeping.

``add()`` turns the engine's ``RequestOutput``s into ``protocol.Delta``s (the one place that
conversion happens), merged per request until the next ``take()``: normally one step's worth, more
while Redis is unreachable. ``take()`` numbers the deltas (``seq`` per request) and encodes one
message per gateway; a round that failed is ``put_back()`` and re-sent first, with the same
``seq``s (a gateway drops a seq it has seen). Entries to delete from the request stream (finished,
errored, dead-lettered) and dead letters travel with the messages, after them. A batch also lists
the requests admitted since the last one; a ``Handoff`` to a gateway follows its batch, so the
gateway has every token sent before it moves the request."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from shared import names
from shared.protocol import Delta, Handoff, TokenBatch, encode

if TYPE_CHECKING:
    from engine_worker.engine.llm_engine import RequestOutput


@dataclass(slots=True)
class Outgoing:
    messages: list[tuple[str, bytes]] = field(default_factory=list)   # (channel, TokenBatch)
    dead_letters: list[dict] = field(default_factory=list)
    done_entries: list[tuple[str, bytes]] = field(default_factory=list)   # (stream, id): XACK + XDEL

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
        self._admitted: dict[str, list[str]] = {}           # reply_to -> request ids
        self._handoffs: dict[tuple[str, str], list[str]] = {}   # (reply_to, reason) -> request ids
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

    def admitted(self, reply_to: str, request_id: str, first_seq: int = 0) -> None:
        """The engine took the request: say so in the next batch; its deltas number from first_seq."""
        self._admitted.setdefault(reply_to, []).append(request_id)
        if first_seq:
            self._next_seq[request_id] = first_seq

    def handoff(self, reply_to: str, request_id: str, reason: str) -> None:
        """Tell the gateway to move the request elsewhere (after the tokens it was sent)."""
        self._handoffs.setdefault((reply_to, reason), []).append(request_id)

    def done(self, entry_id: bytes, stream: str) -> None:
        """The request stream entry is finished with: acknowledge and delete it."""
        self._held_back.done_entries.append((stream, entry_id))

    def dead_letter(self, fields: dict) -> None:
        self._held_back.dead_letters.append(fields)

    def _delta(self, reply_to: str, request_id: str) -> Delta:
        per = self._deltas.setdefault(reply_to, {})
        d = per.get(request_id)
        if d is None:
            d = per[request_id] = Delta(request_id, 0, [])
        return d

    def has_outgoing(self) -> bool:
        return bool(self._deltas or self._admitted or self._handoffs or self._held_back)

    def take(self) -> Outgoing:
        """Everything to send now, messages encoded; put_back() it if it could not be sent."""
        out, self._held_back = self._held_back, Outgoing()
        for reply_to in self._deltas.keys() | self._admitted.keys():
            per = self._deltas.get(reply_to, {})
            for rid, d in per.items():
                d.seq = self._next_seq.get(rid, 0)
                if d.finish_reason is None:
                    self._next_seq[rid] = d.seq + 1
                else:
                    self._next_seq.pop(rid, None)
            batch = TokenBatch(self.engine_id, list(per.values()), self._admitted.get(reply_to, []))
            out.messages.append((names.reply_channel(reply_to), encode(batch)))
        for (reply_to, reason), rids in self._handoffs.items():
            for rid in rids:
                self._next_seq.pop(rid, None)
            out.messages.append((names.reply_channel(reply_to), encode(Handoff(self.engine_id, rids, reason))))
        self._deltas, self._admitted, self._handoffs = {}, {}, {}
        return out

    def put_back(self, out: Outgoing) -> None:
        """A round that failed: its writes go first in the next one, in their order."""
        self._held_back = out + self._held_back
