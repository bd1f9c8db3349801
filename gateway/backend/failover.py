"""Failover: a request whose engine is gone goes on, as a continuation, on another engine.

Which engine holds a request: an engine lists the requests it admitted in its next TokenBatch
(``admitted``), and every batch names its engine, so the gateway knows a request's engine from
admission on (``RequestState.engine_id``). A request not yet admitted is still in the stream,
where any engine can take it.

When the gateway moves a request:
- its engine's heartbeat has not changed for ``failover_timeout`` seconds (SIGKILL, a lost host;
  the watchdog in router.py), or
- a ``Handoff`` names it: its engine is shutting down (SIGTERM), or a janitor found its entry
  pending at a dead engine before the gateway heard it was admitted, or an engine restarted.

Moving is one pipeline: XADD a continuation under a new engine-side id (``<origin>~<n>``) to the
request's model's stream (for a LoRA adapter: an engine that holds it, ``target``), and
for a silent engine an abort of the old id (in case it was only slow). The continuation's prompt
is the original prompt plus every token delivered; ``max_tokens`` is what remains;
``num_generated`` tells the engine which prompt tokens are output (penalties; the seeded
generator's position, so a seeded request draws what it would have drawn); ``first_seq``
continues the sequence numbers. The detokenizer, stop strings, logprobs and usage live in the
``RequestState``, which simply carries on: the client sees a pause, no repeat and no gap.

Who owns the original entry: the gateway. A survivor's janitor still claims a dead engine's
entries (so the stream holds live work only), but engines ACK and delete claimed entries instead
of running them, and send a ``Handoff`` (``handed_back`` in their counters). So a request is
computed once, wherever it continues. A request is moved at most ``max_failovers`` times; then
the client gets the ``engine_lost`` error.

Redis restarts: when the reply channel is lost (router.py), the requests in flight are
``suspend``ed at once -- re-keyed, so a late delta of the old id cannot be mistaken for theirs --
and resubmitted as continuations once the channel is back, if that is within ``redis_grace``
seconds (with an abort of each old id: the engines drop the work the restart orphaned). Past the
grace period the clients get the ``reply_channel_lost`` error they got before.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Callable

from shared import names
from shared.protocol import Abort, GenerateRequest, encode

from ..api.errors import GenerationError
from .output import Piece, RequestState
from .router import ReplyRouter

log = logging.getLogger("kaiten.gateway")


def continuation(s: RequestState, gateway_id: str, request_id: str) -> GenerateRequest:
    """The request that goes on where `s` stopped: prompt + delivered tokens, the rest of max_tokens."""
    params, done = dict(s.params), len(s.token_ids)
    params["max_tokens"] = int(params.get("max_tokens", 16)) - done
    if params.get("min_tokens"):
        params["min_tokens"] = max(0, int(params["min_tokens"]) - done)
    if s.prompt_logprobs is not None:
        params["prompt_logprobs"] = None         # came with the first delta already
    return GenerateRequest(request_id, gateway_id, list(s.prompt_ids) + s.token_ids, params,
                           deadline=s.wall_deadline, num_generated=len(s.token_ids), first_seq=s.next_seq,
                           lora_name=s.lora_name)


class Failover:
    def __init__(self, client: Any, gateway_id: str, router: ReplyRouter, max_failovers: int,
                 redis_grace: float = 10.0, target: Callable[[RequestState], str] = lambda s: s.model.stream):
        self.r = client
        self.gateway_id = gateway_id
        self.router = router
        self.max_failovers = max_failovers
        self.target = target                 # the stream a moved request goes to ("": none can take it)
        self.redis_grace = redis_grace
        self._bg: set[asyncio.Task] = set()
        self._suspended: dict[str, tuple[RequestState, str]] = {}   # new id -> (state, old id)
        self._resumer: asyncio.Task | None = None

    def move(self, states: list[RequestState], why: str, abort_old: bool) -> None:
        """Continue each request elsewhere (the XADD runs in the background), or fail those that
        were moved max_failovers times already."""
        moved = self._rekey(states, why, "engine_lost")
        if moved:
            log.info("moving %d requests to another engine: %s", len(moved), why)
            self._background(self._submit(moved, abort_old))

    def suspend(self, states: list[RequestState], why: str) -> None:
        """The reply channel is lost: re-key the requests now, resubmit them once it is back."""
        fresh = [s for s in states if s.request_id not in self._suspended]
        for s, old in self._rekey(fresh, why, "reply_channel_lost"):
            self._suspended[s.request_id] = (s, old)
        if self._suspended and self._resumer is None:
            log.warning("%s: holding %d requests for up to %.0f s", why, len(self._suspended), self.redis_grace)
            self._resumer = self._background(self._resume_when_subscribed(time.monotonic() + self.redis_grace))

    def _rekey(self, states: list[RequestState], why: str, code: str) -> list[tuple[RequestState, str]]:
        moved = []
        for s in states:
            if s.done:
                continue
            if s.failovers >= self.max_failovers:
                self.router.fail(s, GenerationError(
                    503, f"{why}; the request was moved to another engine {s.failovers} times "
                         f"(max_failovers={self.max_failovers}): giving up", code=code))
                continue
            if int(s.params.get("max_tokens", 16)) <= len(s.token_ids):
                self._finish_length(s)
                continue
            old = s.request_id
            s.failovers += 1
            self.router.rekey(s, f"{s.origin_id or old}~{s.failovers}")
            moved.append((s, old))
            s.model.metrics.failovers.inc()
        self.router.counters["failovers"] += len(moved)
        return moved

    def _background(self, coro) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro)
        self._bg.add(task)
        task.add_done_callback(self._bg.discard)
        return task

    async def _resume_when_subscribed(self, deadline: float) -> None:
        back = await self.router.wait_subscribed(max(0.0, deadline - time.monotonic()))
        held, self._suspended, self._resumer = list(self._suspended.values()), {}, None
        held = [(s, old) for s, old in held if not s.done]
        if not back:
            for s, _ in held:
                self.router.fail(s, GenerationError(
                    503, f"the gateway lost its reply channel for more than {self.redis_grace:.0f} s; "
                         "tokens may have been lost", code="reply_channel_lost"), abort=False)
            return
        if held:
            log.info("reply channel back: resubmitting %d requests as continuations", len(held))
            await self._submit(held, abort_old=True, retry_until=deadline)

    def _finish_length(self, s: RequestState) -> None:
        """Every token was delivered but not the finish (the engine died between): finish here."""
        out = s.stop.feed(s.detokenizer.finish())[0] + s.stop.flush()
        s.engine_finished, s.finish_reason, s.finished_at = True, "length", time.monotonic()
        self.router.unregister(s.request_id)
        s.queue.put_nowait(Piece(s.index, out, [], None, "length"))

    async def _submit(self, moved: list[tuple[RequestState, str]], abort_old: bool,
                      retry_until: float = 0.0) -> None:
        delay = 0.1
        while True:
            try:
                await self._xadd(moved, abort_old)
                return
            except Exception as e:      # Redis down (or still loading after a restart)
                if time.monotonic() + delay < retry_until:
                    await asyncio.sleep(delay)
                    delay = min(1.0, delay * 2)
                    continue
                log.warning("failover XADD failed: %s: %s", type(e).__name__, e)
                for s, _ in moved:
                    self.router.fail(s, GenerationError(
                        503, f"the request's engine was lost and Redis is unavailable to move it ({type(e).__name__})",
                        code="redis_unavailable"))
                return

    async def _xadd(self, moved: list[tuple[RequestState, str]], abort_old: bool) -> None:
        live = [(s, old) for s, old in moved if not s.done]
        pipe = self.r.pipeline(transaction=False)
        pipe.set(names.gateway_alive_key(self.gateway_id), self.gateway_id,
                 px=int(names.GATEWAY_ALIVE_TTL_S * 1000))
        for s, _ in live:
            stream = self.target(s)
            if not stream:
                self.router.fail(s, GenerationError(503, f"no live engine holds the adapter '{s.lora_name}' to "
                                                         "continue the request", code="engine_lost"), abort=False)
                continue
            pipe.xadd(stream, {names.PAYLOAD_FIELD: encode(continuation(s, self.gateway_id, s.request_id))})
        for _, old in live if abort_old else ():
            pipe.xadd(names.ABORT_STREAM, {names.PAYLOAD_FIELD: encode(Abort(old, self.gateway_id))},
                      maxlen=names.ABORT_STREAM_MAXLEN, approximate=True)
        await pipe.execute()

    async def wait_idle(self, timeout: float) -> None:
        if self._bg:
            await asyncio.wait(list(self._bg), timeout=timeout)
