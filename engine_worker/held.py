"""The requests this engine holds: taken from the stream, not yet finished with. The loop owns the
table; other threads (janitor, orphan watch) read ``view``, an immutable snapshot the loop
``publish()``es once per step when the table changed."""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class HeldRequest:
    request_id: str
    entry_id: bytes
    reply_to: str
    deadline: float | None           # gateway clock, unix seconds
    stream: str                      # the model's shared stream, or this engine's own


class HeldRequests:
    def __init__(self):
        self._by_id: dict[str, HeldRequest] = {}
        self._dirty = False
        self.view: tuple[HeldRequest, ...] = ()

    def add(self, h: HeldRequest) -> None:
        self._by_id[h.request_id] = h
        self._dirty = True

    def pop(self, request_id: str) -> HeldRequest | None:
        h = self._by_id.pop(request_id, None)
        self._dirty = self._dirty or h is not None
        return h

    def get(self, request_id: str) -> HeldRequest | None:
        return self._by_id.get(request_id)

    def __len__(self) -> int:
        return len(self._by_id)

    def all(self) -> list[HeldRequest]:
        return list(self._by_id.values())

    def publish(self) -> None:
        if self._dirty:
            self.view = tuple(self._by_id.values())
            self._dirty = False


class BoundedSet:
    """An insertion-ordered set that forgets its oldest members past ``maxlen``."""

    def __init__(self, maxlen: int):
        self._d: OrderedDict[str, None] = OrderedDict()
        self.maxlen = maxlen

    def add(self, key: str) -> None:
        self._d[key] = None
        self._d.move_to_end(key)
        while len(self._d) > self.maxlen:
            self._d.popitem(last=False)

    def __contains__(self, key: object) -> bool:
        return key in self._d

    def __len__(self) -> int:
        return len(self._d)
