"""The per-step Redis round: ONE pipeline with a step's writes, run on an I/O thread.

The loop ``start()``s a round after a step and it runs while the next step computes; ``poll()``
collects it without waiting. At most one round is in flight: while one is (a slow Redis), a
step's deltas stay in the publisher and are merged into the next round. The pipeline, in order:
one PUBLISH per gateway (its ``TokenBatch``), XADD of dead letters (MAXLEN-bounded), then XACK and
XDEL of finished entries (per stream: the shared one and this engine's own), so the request stream holds only unfinished work."""
from __future__ import annotations

import concurrent.futures
import time
from dataclasses import dataclass, field

import redis

from engine_worker.publisher import Outgoing
from shared import names


@dataclass(slots=True)
class RoundResult:
    sent: Outgoing
    error: BaseException | None = None        # the round failed as a whole (connection, timeout)
    command_errors: list[str] = field(default_factory=list)   # single commands that failed
    receivers: int = 0                        # subscribers that got a message (sum of PUBLISH)
    rtt: float = 0.0


def by_stream(entries: list[tuple[str, bytes]]) -> dict[str, list[bytes]]:
    grouped: dict[str, list[bytes]] = {}
    for stream, entry_id in entries:
        grouped.setdefault(stream, []).append(entry_id)
    return grouped


class IoRound:
    def __init__(self, client: redis.Redis, use_thread: bool = True):
        self.r = client
        self._executor = (concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kaiten-io-round")
                          if use_thread else None)
        self._future: concurrent.futures.Future | None = None
        self._inline: RoundResult | None = None

    def in_flight(self) -> bool:
        return self._future is not None or self._inline is not None

    def start(self, out: Outgoing) -> None:
        assert not self.in_flight(), "poll() the round in flight first"
        if self._executor is None:
            self._inline = self._run(out)
        else:
            self._future = self._executor.submit(self._run, out)

    def poll(self, timeout: float | None = 0.0) -> RoundResult | None:
        """The finished round (once), else None; waits up to `timeout` (None: until done)."""
        if self._inline is not None:
            res, self._inline = self._inline, None
            return res
        if self._future is None:
            return None
        try:
            res = self._future.result(timeout)
        except concurrent.futures.TimeoutError:
            return None
        self._future = None
        return res

    def _run(self, out: Outgoing) -> RoundResult:
        t0 = time.perf_counter()
        res = RoundResult(out)
        p = self.r.pipeline(transaction=False)
        for channel, data in out.messages:
            p.publish(channel, data)
        for dead in out.dead_letters:
            p.xadd(names.DEAD_LETTER_STREAM, dead, maxlen=names.DEAD_LETTER_MAXLEN, approximate=True)
        done = by_stream(out.done_entries)
        for stream, ids in done.items():
            p.xack(stream, names.ENGINE_GROUP, *ids)
            p.xdel(stream, *ids)
        kinds = (["publish"] * len(out.messages) + ["dead letter"] * len(out.dead_letters)
                 + ["xack", "xdel"] * len(done))
        try:
            replies = p.execute(raise_on_error=False)
        except Exception as e:      # connection/timeout errors, a Redis still loading, ...
            res.error = e
            return res
        finally:
            res.rtt = time.perf_counter() - t0
        for kind, reply in zip(kinds, replies):
            if isinstance(reply, Exception):
                res.command_errors.append(f"{kind}: {reply}")
            elif kind == "publish":
                res.receivers += int(reply)
        return res

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
