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

Moving is one pipeline: XADD a continuation under a new engine-side id (``<origin>~<n>``), and
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
"""
from __future__ import annotations

import asyncio
import logging
from typing import Any

from shared import names
from shared.protocol import Abort, GenerateRequest, encode

from .errors import GenerationError
from .output import Piece, RequestState
from .router import ReplyRouter

log = logging.getLogger("kaiten.gateway")


def continuation(s: RequestState, gateway_id: str, request_id: str) -> GenerateRequest:
    """The request that goes on where `s` stopped: prompt + delivered tokens, the rest of max_tokens."""
    params = dict(s.params)
    params["max_tokens"] = int(params.get("max_tokens", 16)) - len(s.token_ids)
    return GenerateRequest(request_id, gateway_id, list(s.prompt_ids) + s.token_ids, params,
                           deadline=s.wall_deadline, num_generated=len(s.token_ids), first_seq=s.next_seq)


class Failover:
    def __init__(self, client: Any, gateway_id: str, router: ReplyRouter, max_failovers: int, metrics: Any):
        self.r = client
        self.gateway_id = gateway_id
        self.router = router
        self.max_failovers = max_failovers
        self.metrics = metrics
        self._bg: set[asyncio.Task] = set()

    def move(self, states: list[RequestState], why: str, abort_old: bool) -> None:
        """Continue each request elsewhere (the XADD runs in the background), or fail those that
        were moved max_failovers times already."""
        moved: list[tuple[RequestState, str]] = []
        for s in states:
            if s.done:
                continue
            if s.failovers >= self.max_failovers:
                self.router.fail(s, GenerationError(
                    503, f"{why}; the request was moved to another engine {s.failovers} times "
                         f"(max_failovers={self.max_failovers}): giving up", code="engine_lost"))
                continue
            if int(s.params.get("max_tokens", 16)) <= len(s.token_ids):
                self._finish_length(s)
                continue
            old = s.request_id
            s.failovers += 1
            self.router.rekey(s, f"{s.origin_id or old}~{s.failovers}")
            moved.append((s, old))
        if not moved:
            return
        self.router.counters["failovers"] += len(moved)
        self.metrics.failovers.inc(len(moved))
        log.info("moving %d requests to another engine: %s", len(moved), why)
        task = asyncio.get_running_loop().create_task(self._submit(moved, abort_old))
        self._bg.add(task)
        task.add_done_callback(self._bg.discard)

    def _finish_length(self, s: RequestState) -> None:
        """Every token was delivered but not the finish (the engine died between): finish here."""
        out = s.stop.feed(s.detokenizer.finish())[0] + s.stop.flush()
        s.engine_finished, s.finish_reason = True, "length"
        self.router.unregister(s.request_id)
        s.queue.put_nowait(Piece(s.index, out, [], None, "length"))

    async def _submit(self, moved: list[tuple[RequestState, str]], abort_old: bool) -> None:
        pipe = self.r.pipeline(transaction=False)
        pipe.set(names.gateway_alive_key(self.gateway_id), self.gateway_id,
                 px=int(names.GATEWAY_ALIVE_TTL_S * 1000))
        for s, _ in moved:
            pipe.xadd(names.REQUEST_STREAM,
                      {names.PAYLOAD_FIELD: encode(continuation(s, self.gateway_id, s.request_id))})
        for _, old in moved if abort_old else ():
            pipe.xadd(names.ABORT_STREAM, {names.PAYLOAD_FIELD: encode(Abort(old, self.gateway_id))},
                      maxlen=names.ABORT_STREAM_MAXLEN, approximate=True)
        try:
            await pipe.execute()
        except Exception as e:          # Redis down: the clients get the error they get today
            log.warning("failover XADD failed: %s: %s", type(e).__name__, e)
            for s, _ in moved:
                self.router.fail(s, GenerationError(503, "the request's engine was lost and Redis is "
                                                    f"unavailable to move it ({type(e).__name__})",
                                                    code="redis_unavailable"))

    async def wait_idle(self, timeout: float) -> None:
        if self._bg:
            await asyncio.wait(list(self._bg), timeout=timeout)
