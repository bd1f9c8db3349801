"""What the Redis threads hand to the engine loop: stream entries, aborts, requests to stop, and
control messages (adapters to load or unload).

Readers ``put_*``; the loop ``take()``s everything at the top of each step. The request reader
reads no more entries than the loop's last ``set_capacity``, minus what waits here or was taken
since, so an engine never takes requests it has no room for (other engines can serve them).

An entry put here stays *in hand* until the loop ``release()``s it, once the round that deleted it
from its stream (XACK + XDEL) has completed: the janitor never re-claims an entry in hand as an
orphan, however long its request or its deletion takes."""
from __future__ import annotations

import threading
from dataclasses import dataclass, field

from shared.protocol import Control


@dataclass(slots=True)
class StreamEntry:
    entry_id: bytes
    fields: dict | None          # None: the entry was deleted while pending
    deliveries: int
    source: str                  # "new", "pending" (own, re-read), "claimed from X", "orphan"
    stream: str                  # the model's shared stream, or an engine's own (routed)

    @property
    def taken_over(self) -> bool:
        """Read by a consumer that died (another, or an earlier process of this one)."""
        return self.source == "pending" or self.source.startswith("claimed")


@dataclass(slots=True)
class Stop:
    request_id: str
    reason: str                  # "gateway_gone" | "deadline"


@dataclass(slots=True)
class Arrivals:
    entries: list[StreamEntry] = field(default_factory=list)
    aborts: list[str] = field(default_factory=list)
    stops: list[Stop] = field(default_factory=list)
    controls: list[Control] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.entries or self.aborts or self.stops or self.controls)


class Inbox:
    def __init__(self):
        self._cond = threading.Condition()
        self._box = Arrivals()
        self._capacity = 0
        self._in_hand: set[tuple[str, bytes]] = set()     # (stream, entry id)
        self.wake = threading.Event()        # set by every put: the idle loop waits on it

    def put_entries(self, entries: list[StreamEntry]) -> None:
        def add(box: Arrivals) -> None:
            box.entries.extend(entries)
            self._in_hand.update((e.stream, e.entry_id) for e in entries)
        self._put(add, bool(entries))

    def put_aborts(self, request_ids: list[str]) -> None:
        self._put(lambda b: b.aborts.extend(request_ids), bool(request_ids))

    def put_stops(self, stops: list[Stop]) -> None:
        self._put(lambda b: b.stops.extend(stops), bool(stops))

    def put_controls(self, controls: list[Control]) -> None:
        self._put(lambda b: b.controls.extend(controls), bool(controls))

    def _put(self, add, nonempty: bool) -> None:
        if not nonempty:
            return
        with self._cond:
            add(self._box)
        self.wake.set()

    def take(self) -> Arrivals:
        """Everything that arrived. The entries taken count against the capacity until the loop
        sets it again (after admitting them)."""
        with self._cond:
            box, self._box = self._box, Arrivals()
            self._capacity -= len(box.entries)       # they are the engine's now
            self.wake.clear()
        return box

    def in_hand(self) -> set[tuple[str, bytes]]:
        """(stream, entry id) of every entry put here and not yet released."""
        with self._cond:
            return set(self._in_hand)

    def release(self, deleted: list[tuple[str, bytes]]) -> None:
        """(loop) These entries are deleted from their streams: no longer in hand."""
        if deleted:
            with self._cond:
                self._in_hand.difference_update(deleted)

    def set_capacity(self, n: int) -> None:
        with self._cond:
            self._capacity = n
            self._cond.notify_all()

    def wait_room(self, timeout: float) -> int:
        """(request reader) How many entries to read now; waits up to `timeout` for room."""
        with self._cond:
            room = self._capacity - len(self._box.entries)
            if room <= 0:
                self._cond.wait(timeout)
                room = self._capacity - len(self._box.entries)
            return max(0, room)

    def wait(self, timeout: float) -> None:
        """(loop, idle) Until something arrives or `timeout` passes."""
        self.wake.wait(timeout)
