"""Requests nobody waits for: its own thread and connection, every orphan_check_interval.

For the gateways of the requests this engine holds it checks ``names.gateway_alive_key`` in one
pipelined EXISTS round; a gateway whose key is gone has died (a gateway SETs its key in the same
pipeline as, and before, every XADD), and its requests are handed to the loop to abort (freeing
their KV). Within ``2 * GATEWAY_ALIVE_TTL_S`` of an error on this watch's connection (Redis
restarted, or a Sentinel promotion, which may lose a gateway's last SET), a key must stay missing
for ``GATEWAY_ALIVE_TTL_S`` (a live gateway sets it three times as often) before its gateway is
judged dead. Requests past their ``deadline`` are handed over too."""
from __future__ import annotations

import logging
import threading
import time

import redis

from engine_worker.held import HeldRequests
from engine_worker.inbox import Inbox, Stop
from shared import names

log = logging.getLogger("kaiten.worker")


class OrphanWatch:
    def __init__(self, client: redis.Redis, inbox: Inbox, held: HeldRequests, interval: float):
        self.r, self.inbox, self.held, self.interval = client, inbox, held, interval
        self._reported: set[str] = set()
        self._missing_since: dict[str, float] = {}     # gateway -> monotonic time its key was first missed
        self._error_at = float("-inf")                 # monotonic time of the last Redis error
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, daemon=True, name="kaiten-orphan-watch")
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.inbox.put_stops(self.check())
            except Exception as e:     # Redis down: no verdicts meanwhile
                self._error_at = time.monotonic()
                log.debug("orphan watch: %s: %s", type(e).__name__, e)

    def check(self) -> list[Stop]:
        view = self.held.view
        if not view:
            self._reported.clear()
            return []
        gateways = sorted({h.reply_to for h in view})
        p = self.r.pipeline(transaction=False)
        for g in gateways:
            p.exists(names.gateway_alive_key(g))
        gone = self._gone({g for g, alive in zip(gateways, p.execute()) if not alive}, time.monotonic())
        now = time.time()
        stops = []
        for h in view:
            if h.request_id in self._reported:
                continue
            if h.reply_to in gone:
                stops.append(Stop(h.request_id, "gateway_gone"))
            elif h.deadline is not None and now > h.deadline:
                stops.append(Stop(h.request_id, "deadline"))
        self._reported = {s.request_id for s in stops} | (self._reported & {h.request_id for h in view})
        if gone and stops:
            log.info("gateway(s) %s gone: aborting %d requests", ", ".join(sorted(gone)), len(stops))
        return stops

    def _gone(self, missing: set[str], now: float) -> set[str]:
        self._missing_since = {g: self._missing_since.get(g, now) for g in missing}
        if now - self._error_at > 2 * names.GATEWAY_ALIVE_TTL_S:
            return missing
        return {g for g, t in self._missing_since.items() if now - t >= names.GATEWAY_ALIVE_TTL_S}

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
