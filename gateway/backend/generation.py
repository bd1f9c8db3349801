"""One choice of a response: reads the text pieces the output processor puts on its request's queue."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import AsyncIterator

from ..api.errors import GenerationError
from .output import Piece, RequestState


@dataclass(slots=True)
class SubRequest:
    index: int                       # choice index in the response
    request_id: str
    prompt_ids: list[int]
    params: dict
    stop: list[str]
    prompt_text: str | None = None


@dataclass(slots=True, eq=False)
class SubGeneration:
    sub: SubRequest
    state: RequestState              # the request's output state (output.py)
    error: GenerationError | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.sub.prompt_ids)

    @property
    def completion_tokens(self) -> int:
        return len(self.state.token_ids)

    @property
    def finish_reason(self) -> str | None:
        return self.state.finish_reason

    @property
    def stop_reason(self) -> str | int | None:
        return self.state.stop_reason

    @property
    def num_cached_tokens(self) -> int:
        return self.state.num_cached_tokens

    @property
    def arrival(self) -> float:
        return self.state.submitted

    @property
    def finished_at(self) -> float | None:
        return self.state.finished_at

    async def pieces(self) -> AsyncIterator[Piece]:
        """The pieces up to the finished one; an error raises GenerationError."""
        while True:
            item = await self.state.queue.get()
            if isinstance(item, GenerationError):
                self.error = item
                raise item
            yield item
            if item.finish_reason is not None:
                return

    @property
    def needs_abort(self) -> bool:
        """The engine may still be working on it (the client went away, a failure)."""
        s = self.state
        return not s.engine_finished and not s.abort_sent

    def metrics_summary(self) -> dict[str, float]:
        s = self.state
        end = s.finished_at or time.monotonic()
        ttft = (s.first_token_at - s.submitted) if s.first_token_at else 0.0
        decode_time = (end - s.first_token_at) if s.first_token_at else 0.0
        n = self.completion_tokens
        tps = (n - 1) / decode_time if n > 1 and decode_time > 0 else 0.0
        return {"ttft_s": round(ttft, 6), "tokens_per_second": round(tps, 3), "e2e_s": round(end - s.submitted, 6)}
