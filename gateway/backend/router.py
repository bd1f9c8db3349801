"""Routing token deltas from the engines to the requests waiting for them.

ONE pub/sub connection per gateway, subscribed to ``names.reply_channel(gateway_id)`` before the
first request is XADDed. A single reader task decodes every ``TokenBatch`` and hands it to the
output processor (output.py), which checks each delta's ``seq`` (a repeat is dropped: the engine
re-sends messages it is not sure went out; a gap ends the request with an error), detokenizes and
puts text pieces on the requests' queues. A ``Handoff`` (an engine giving requests back) goes to
``on_move`` (failover.py).

redis-py reconnects a broken pub/sub connection and re-subscribes by itself. Messages published
meanwhile are lost, so when the subscribe confirmation arrives again (or the connection errors),
every request in flight at that moment goes to ``on_suspend`` (failover.py: continued once the
channel is back within a grace period, else failed) instead of waiting forever. A
watchdog moves requests whose engine stopped heartbeating (``on_move``), and fails requests
waiting while no engine is alive and requests past their deadline.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Callable

from redis.exceptions import ConnectionError as RedisConnectionError

from shared import names
from shared.protocol import Handoff, ProtocolError, TokenBatch, decode

from ..api.errors import GenerationError
from .engines import EngineMonitor
from .output import OutputProcessor, RequestState

log = logging.getLogger("kaiten.gateway")

PING_AFTER_S = 2.0       # a reply channel silent this long is PINGed
PONG_TIMEOUT_S = 5.0     # ... and lost when nothing comes back this long after


class ReplyRouter:
    def __init__(self, client, gateway_id: str, monitor: EngineMonitor, engine_timeout: float,
                 subscribe_timeout: float = 5.0, failover_timeout: float = 2.0, spill_timeout: float = 5.0):
        self.r = client
        self.gateway_id = gateway_id
        self.channel = names.reply_channel(gateway_id)
        self.monitor = monitor
        self.engine_timeout = engine_timeout
        self.failover_timeout = failover_timeout
        self.spill_timeout = spill_timeout
        self.subscribe_timeout = subscribe_timeout
        self.streams: dict[str, RequestState] = {}
        self.subscribed = asyncio.Event()
        self.pubsub = None
        self.counters = {"messages": 0, "deltas": 0, "bad_messages": 0, "unknown_request": 0, "duplicates": 0,
                         "gaps": 0, "resubscribed": 0, "connection_errors": 0, "engine_lost": 0, "timeouts": 0,
                         "foreign_engine": 0, "failovers": 0, "handoffs": 0, "stale_handoffs": 0,
                         "routed_respilled": 0}
        self._confirmations = 0
        self.on_abort_needed: Callable[[list[str]], None] | None = None   # set by the gateway
        self.processor: OutputProcessor | None = None                     # set by the gateway
        # (states, why, abort_old): continue these requests on another engine (set by the gateway)
        self.on_move: Callable[[list[RequestState], str, bool], None] | None = None
        # (states, why): the reply channel is lost; continue them once it is back (set by the gateway)
        self.on_suspend: Callable[[list[RequestState], str], None] | None = None

    # ------------------------------------------------------------------ registry
    def register(self, stream: RequestState) -> None:
        self.streams[stream.request_id] = stream

    def unregister(self, request_id: str) -> None:
        s = self.streams.pop(request_id, None)
        if s is not None:
            s.done = True

    def rekey(self, stream: RequestState, request_id: str) -> None:
        """The request continues under a new engine-side id (failover): expect it from any engine."""
        self.streams.pop(stream.request_id, None)
        stream.origin_id = stream.origin_id or stream.request_id
        stream.request_id, stream.engine_id, stream.routed_to = request_id, None, None
        stream.engine_finished = stream.abort_sent = False
        self.streams[request_id] = stream

    def fail(self, stream: RequestState, error: GenerationError, abort: bool = True) -> None:
        """End a request with an error; abort it on the engine unless that is known to be moot."""
        if stream.done:
            return
        self.unregister(stream.request_id)
        stream.queue.put_nowait(error)
        if abort and not stream.engine_finished and not stream.abort_sent and self.on_abort_needed is not None:
            stream.abort_sent = True
            self.on_abort_needed([stream.request_id])

    def fail_all(self, error_factory: Callable[[], GenerationError]) -> int:
        streams = list(self.streams.values())
        for s in streams:
            self.fail(s, error_factory(), abort=False)
        ids = [s.request_id for s in streams if not s.engine_finished and not s.abort_sent]
        for s in streams:
            s.abort_sent = True
        if ids and self.on_abort_needed is not None:
            self.on_abort_needed(ids)
        return len(streams)

    # ------------------------------------------------------------------ subscription
    async def wait_subscribed(self, timeout: float | None = None) -> bool:
        if self.subscribed.is_set():
            return True
        try:
            await asyncio.wait_for(self.subscribed.wait(), self.subscribe_timeout if timeout is None else timeout)
            return True
        except asyncio.TimeoutError:
            return False

    async def _open(self) -> None:
        await self.close()
        self.pubsub = self.r.pubsub()
        self._confirmations = 0
        await self.pubsub.subscribe(self.channel)

    def _connection_lost(self, why: str) -> None:
        was = self.subscribed.is_set()
        self.subscribed.clear()
        states = [s for s in self.streams.values() if not s.done]
        if self.on_suspend is not None:
            self.on_suspend(states, f"the gateway lost its reply channel ({why})")
        else:
            self.fail_all(lambda: GenerationError(
                503, f"the gateway lost its reply channel ({why}); tokens may have been lost",
                code="reply_channel_lost"))
        if was:
            log.warning("reply channel %s: %s; %d requests in flight", self.channel, why, len(states))

    async def run(self) -> None:
        """The reader task: (re)subscribe, then route messages until cancelled."""
        backoff = 0.05
        while True:
            try:
                if self.pubsub is None:
                    await self._open()
                heard, pinged = time.monotonic(), False
                while True:
                    msg = await self.pubsub.get_message(timeout=1.0)
                    now = time.monotonic()
                    if msg is None:
                        heard, pinged = await self._check_silence(now, heard, pinged)
                        continue
                    heard, pinged, backoff = now, False, 0.05
                    kind = msg.get("type")
                    if kind == "message":
                        self._on_message(msg.get("data"))
                    elif kind == "subscribe":
                        self._confirmations += 1
                        if self._confirmations > 1:
                            # redis-py reconnected and re-subscribed on its own: messages published
                            # while we were away are gone.
                            self.counters["resubscribed"] += 1
                            self._connection_lost("the subscription was re-established")
                        self.subscribed.set()
                    elif kind == "unsubscribe":
                        self._connection_lost("unsubscribed")
            except asyncio.CancelledError:
                raise
            except Exception as e:
                self.counters["connection_errors"] += 1
                self._connection_lost(f"{type(e).__name__}: {e}")
                await self.close()
                await asyncio.sleep(backoff)
                backoff = min(2.0, backoff * 2)

    async def _check_silence(self, now: float, heard: float, pinged: bool) -> tuple[float, bool]:
        """A quiet channel is PINGed (its pong is a message too); one that stays silent past
        PONG_TIMEOUT_S is lost: a partition that drops packets breaks no connection."""
        if now - heard > PING_AFTER_S + PONG_TIMEOUT_S:
            raise RedisConnectionError(f"no answer on the reply channel for {now - heard:.0f} s")
        if now - heard > PING_AFTER_S and not pinged:
            await self.pubsub.ping()
            pinged = True
        return heard, pinged

    async def close(self) -> None:
        """Close the pub/sub connection, if any; errors on the way out are ignored."""
        if self.pubsub is not None:
            try:
                await self.pubsub.aclose()
            except Exception:
                pass
            self.pubsub = None

    # ------------------------------------------------------------------ routing
    def _on_message(self, data: Any) -> None:
        self.counters["messages"] += 1
        try:
            msg = decode(data)
            if not isinstance(msg, (TokenBatch, Handoff)):
                raise ProtocolError(f"expected a tokens or handoff message, got {msg.T!r}")
        except ProtocolError as e:
            self.counters["bad_messages"] += 1
            log.warning("dropping a malformed message on %s: %s", self.channel, e)
            return
        engine_id = msg.engine_id if isinstance(msg.engine_id, str) else str(msg.engine_id)
        if isinstance(msg, Handoff):
            self._on_handoff(msg)
            return
        if engine_id:
            self.monitor.touch(engine_id)
        self.processor.process(engine_id, msg.deltas, self.streams, msg.admitted)

    def _on_handoff(self, msg: Handoff) -> None:
        """Move the requests an engine gives back. Fenced: an id moved meanwhile (a late handoff
        of an old id) is stale, and so is an engine's shutdown or restart that names a request
        another engine holds now (a handoff delayed across a partition)."""
        own_only = msg.reason in ("shutdown", "restarted")
        states = [s for rid in msg.request_ids if (s := self.streams.get(rid)) is not None and not s.done
                  and not (own_only and s.engine_id is not None and s.engine_id != msg.engine_id)]
        self.counters["handoffs"] += len(states)
        self.counters["stale_handoffs"] += len(msg.request_ids) - len(states)   # moved already
        why = {"shutdown": f"engine {msg.engine_id} is shutting down",
               "restarted": f"engine {msg.engine_id} restarted",
               "engine_lost": "the engine that took the request died"}.get(msg.reason, msg.reason)
        if states:
            self.on_move(states, why, False)

    # ------------------------------------------------------------------ watchdog
    def check(self, now: float | None = None) -> None:
        """Fail requests past their deadline or waiting while no engine of their model lives; move
        the requests of an engine that stopped heartbeating. Called periodically."""
        now = time.monotonic() if now is None else now
        # Cut off from Redis, the gateway cannot tell whether engines live: its requests wait for
        # the reply channel (failover.py: redis_grace), not for an engine.
        reads_redis = self._reads_redis(now)
        no_engine_since: dict[int, float | None] = {}       # per model (id of its ServedModel)
        lost: dict[str, list[RequestState]] = {}
        unserved: list[RequestState] = []
        for s in list(self.streams.values()):
            if now > s.deadline:
                self.counters["timeouts"] += 1
                self.fail(s, GenerationError(504, "the request did not finish before its deadline",
                                             code="timeout"))
            elif s.engine_id is not None:
                if self._engine_lost(s.engine_id, now):
                    lost.setdefault(s.engine_id, []).append(s)
            elif s.routed_to is not None and s.first_delta is None:
                # Routed to an engine's own stream and not admitted: that engine died, drains or is
                # too busy; another engine gets it from the shared stream (judged only while the
                # gateway reads Redis: cut off, it could not move it anyway).
                if self._reads_redis(now) and (self._engine_lost(s.routed_to, now) or not self._accepting(s.routed_to)
                                               or now - s.submitted > self.spill_timeout):
                    unserved.append(s)
            elif reads_redis:
                key = id(s.model)
                if key not in no_engine_since:
                    view = s.model.view
                    no_engine_since[key] = None if view.live else max(view.last_alive, self.monitor.started)
                since = no_engine_since[key]
                if since is not None and now - max(since, s.submitted) > self.engine_timeout:
                    self.counters["engine_lost"] += 1
                    self.fail(s, GenerationError(503, "no engine is alive to serve this request",
                                                 code="engine_lost"))
        for engine_id, states in lost.items():
            self.counters["engine_lost"] += len(states)
            self.on_move(states, f"engine {engine_id} stopped responding while serving this request", True)
        if unserved:
            self.counters["routed_respilled"] += len(unserved)
            self.on_move(unserved, "the engine it was routed to did not take it in time", True)

    def _reads_redis(self, now: float) -> bool:
        """The monitor read the heartbeats lately: a poll that hangs (a partition that drops
        packets) is no verdict on the engines, no more than one that fails."""
        m = self.monitor
        return m.redis_ok and now - m.last_poll_ok <= max(1.0, 4 * m.poll_interval)

    def _engine_lost(self, engine_id: str, now: float) -> bool:
        """Silent for failover_timeout (or 2.5 of its heartbeat intervals, if longer), judged only
        while the monitor reads Redis (an outage or a partition is not the engines' death)."""
        if not self._reads_redis(now):
            return False
        info = self.monitor.engines.get(engine_id)
        interval = float(info.get("heartbeat_interval", 0.0)) if info is not None else 0.0
        return not self.monitor.is_alive(engine_id, now, max(self.failover_timeout, 2.5 * interval))

    def _accepting(self, engine_id: str) -> bool:
        info = self.monitor.engines.get(engine_id)
        return info is None or bool(info.get("accepting", True))

    async def watchdog(self, interval: float = 0.2) -> None:
        while True:
            await asyncio.sleep(interval)
            try:
                self.check()
            except Exception:
                log.exception("watchdog")
