"""One engine request's output as text: detokenize, apply stop strings, keep usage and timings."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, AsyncIterator

from shared.protocol import Delta, TokenLogprob

from .errors import GenerationError
from .router import RequestStream

if TYPE_CHECKING:
    from .core import Gateway


class StopChecker:
    """Finds stop strings in streamed text.

    Text that could still be the start of a stop string is held back, so a client never sees a
    piece of a stop string. ``feed`` returns what may be emitted now and whether a stop string
    ended the text (which is then truncated before it).
    """

    def __init__(self, stops: list[str]):
        self.stops = stops
        self.max_len = max((len(s) for s in stops), default=0)
        self.text = ""
        self.emitted = 0
        self.stopped: str | None = None

    def feed(self, piece: str) -> tuple[str, bool]:
        if self.stopped is not None:
            return "", True
        old_len = len(self.text)
        self.text += piece
        if not self.stops:
            out = self.text[self.emitted:]
            self.emitted = len(self.text)
            return out, False
        start = max(0, old_len - self.max_len + 1)
        best = -1
        for s in self.stops:
            i = self.text.find(s, start)
            if i != -1 and (best == -1 or i < best):
                best, self.stopped = i, s
        if best != -1:
            self.text = self.text[:best]
            out = self.text[self.emitted:]
            self.emitted = len(self.text)
            return out, True
        safe = len(self.text) - (self.max_len - 1)
        if safe > self.emitted:
            out = self.text[self.emitted:safe]
            self.emitted = safe
            return out, False
        return "", False

    def flush(self) -> str:
        out = self.text[self.emitted:]
        self.emitted = len(self.text)
        return out


@dataclass(slots=True)
class Piece:
    """What one choice got from one step: text, the tokens behind it, and maybe the finish."""
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None
    finish_reason: str | None = None


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
    gw: "Gateway"
    sub: SubRequest
    stream: RequestStream
    arrival: float = field(default_factory=time.monotonic)
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    num_cached_tokens: int = 0
    engine_finished: bool = False    # the engine sent the terminal delta
    first_token_at: float | None = None
    last_token_at: float | None = None
    finished_at: float | None = None
    error: GenerationError | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.sub.prompt_ids)

    @property
    def completion_tokens(self) -> int:
        return len(self.token_ids)

    async def pieces(self) -> AsyncIterator[Piece]:
        gw, m = self.gw, self.gw.metrics
        det = gw.tokenizer.detokenizer(self.sub.prompt_ids)
        stopper = StopChecker(self.sub.stop)
        want_lp = self.sub.params.get("logprobs") is not None
        try:
            while True:
                item = await self.stream.queue.get()
                if isinstance(item, GenerationError):
                    raise item
                d: Delta = item
                now = time.monotonic()
                if d.token_ids:
                    if self.first_token_at is None:
                        self.first_token_at = now
                        m.ttft.observe(now - self.arrival)
                    elif self.last_token_at is not None:
                        m.itl.observe(now - self.last_token_at)
                    self.last_token_at = now
                    self.token_ids.extend(d.token_ids)
                    m.generation_tokens.inc(len(d.token_ids))
                lps = list(d.logprobs) if (want_lp and d.logprobs) else ([] if want_lp else None)
                if lps:
                    await gw.token_strings([lp.token_id for lp in lps] +
                                           [t for lp in lps for t, _ in lp.top])
                if d.finish_reason in ("error", "abort"):
                    self.engine_finished = True
                    if d.finish_reason == "abort":
                        raise GenerationError(503, d.error or "the engine aborted the request", code="aborted")
                    # An invalid request is refused by the engine before it produces anything.
                    refused = d.seq == 0 and not self.token_ids
                    raise GenerationError(400 if refused else 500, d.error or "the engine failed the request",
                                          code="engine_rejected" if refused else "engine_error")
                if d.finish_reason is not None:
                    self.engine_finished = True
                    self.num_cached_tokens = int(d.num_cached_tokens or 0)
                try:
                    text = await det.add(list(d.token_ids)) if d.token_ids else ""
                    if d.finish_reason is not None:
                        text += await det.finish()
                except Exception as e:      # tokenizer service down, undecodable ids
                    raise GenerationError(503, f"cannot detokenize the output: {type(e).__name__}: {e}",
                                          code="tokenizer_unavailable") from None
                out, stopped = stopper.feed(text)
                finish = None
                if stopped:
                    finish = "stop"
                elif d.finish_reason is not None:
                    out += stopper.flush()
                    finish = d.finish_reason if d.finish_reason in ("stop", "length") else "stop"
                self.text += out
                if finish is not None:
                    self.finish_reason = finish
                    self.finished_at = now
                yield Piece(self.sub.index, out, list(d.token_ids), lps, finish)
                if finish is not None:
                    return
        except GenerationError as e:
            self.error = e
            raise

    @property
    def needs_abort(self) -> bool:
        """The engine may still be working on it (cancelled, stopped by a stop string, failed)."""
        return not self.engine_finished

    def metrics_summary(self) -> dict[str, float]:
        end = self.finished_at or time.monotonic()
        ttft = (self.first_token_at - self.arrival) if self.first_token_at else 0.0
        decode_time = (end - self.first_token_at) if self.first_token_at else 0.0
        n = self.completion_tokens
        tps = (n - 1) / decode_time if n > 1 and decode_time > 0 else 0.0
        return {"ttft_s": round(ttft, 6), "tokens_per_second": round(tps, 3), "e2e_s": round(end - self.arrival, 6)}
