"""Where new requests and aborts come from. The Redis worker implements the same interface."""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Protocol

from engine_worker.sampling_params import SamplingParams


@dataclass(slots=True)
class NewRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams | dict      # a dict is validated with SamplingParams.from_dict


class RequestSource(Protocol):
    def poll(self, capacity: int) -> tuple[list[NewRequest], list[str]]:
        """New requests (at most `capacity`) and aborted request ids, without blocking for long."""


class QueueRequestSource:
    """In-memory source for the offline API and tests."""

    def __init__(self):
        self._requests: deque[NewRequest] = deque()
        self._aborts: list[str] = []

    def put(self, request: NewRequest) -> None:
        self._requests.append(request)

    def abort(self, request_id: str) -> None:
        self._aborts.append(request_id)

    def poll(self, capacity: int) -> tuple[list[NewRequest], list[str]]:
        new = [self._requests.popleft() for _ in range(min(capacity, len(self._requests)))]
        aborts, self._aborts = self._aborts, []
        return new, aborts

    def __len__(self) -> int:
        return len(self._requests)
