"""The janitor: its own thread and connection, every janitor_interval, never in a step's way.

It takes over the pending entries of dead consumers (no heartbeat key; idle > claim_idle_ms) and
re-claims this consumer's orphans (entries delivered to it by a read whose reply was lost), handing
them to the loop through the inbox. The loop dead-letters entries delivered too often and skips
aborted ones. A live engine's long generations are never taken from it, however old."""
from __future__ import annotations

import logging
import threading

import redis

from engine_worker.held import HeldRequests
from engine_worker.inbox import Inbox, StreamEntry
from engine_worker.stream_reader import to_bytes
from engine_worker.worker_stats import Counters
from shared import names
from shared.config import WorkerConfig

log = logging.getLogger("kaiten.worker")

CLAIM_COUNT = 100


class Janitor:
    def __init__(self, client: redis.Redis, inbox: Inbox, held: HeldRequests, cfg: WorkerConfig,
                 counters: Counters):
        self.r, self.inbox, self.held, self.cfg, self.counters = client, inbox, held, cfg, counters
        self.engine_id = ""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self, engine_id: str) -> None:
        self.engine_id = engine_id
        self._thread = threading.Thread(target=self._run, daemon=True, name="kaiten-janitor")
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.cfg.janitor_interval):
            try:
                claimed = self.run_once()
            except Exception as e:     # Redis down, or restarted without the group: next time
                log.debug("janitor: %s: %s", type(e).__name__, e)
                continue
            if claimed:
                self.counters.add("claimed", sum(1 for c in claimed if c.source != "orphan"))
                self.inbox.put_entries(claimed)

    def run_once(self) -> list[StreamEntry]:
        consumers = self.r.xinfo_consumers(names.REQUEST_STREAM, names.ENGINE_GROUP)
        others = [c for c in consumers if to_bytes(c["name"]).decode() != self.engine_id]
        alive: list = []
        if others:
            p = self.r.pipeline(transaction=False)
            for c in others:
                p.exists(names.heartbeat_key(to_bytes(c["name"]).decode()))
            alive = p.execute()
        claimed: list[StreamEntry] = []
        for c, live in zip(others, alive):
            name = to_bytes(c["name"]).decode()
            if live:
                continue
            if int(c["pending"]) > 0:
                claimed += self._claim(name, set())
            elif int(c.get("idle", 0)) > 100 * self.cfg.claim_idle_ms:
                self.r.xgroup_delconsumer(names.REQUEST_STREAM, names.ENGINE_GROUP, name)   # long gone
        mine = {h.entry_id for h in self.held.view} | self.inbox.entry_ids()
        return claimed + self._claim(self.engine_id, mine)

    def _claim(self, consumer: str, skip: set[bytes]) -> list[StreamEntry]:
        rows = self.r.xpending_range(names.REQUEST_STREAM, names.ENGINE_GROUP, "-", "+", CLAIM_COUNT,
                                     consumername=consumer, idle=self.cfg.claim_idle_ms)
        counts = {to_bytes(r["message_id"]): int(r["times_delivered"]) for r in rows}
        for e in skip & counts.keys():
            del counts[e]
        if not counts:
            return []
        entries = self.r.xclaim(names.REQUEST_STREAM, names.ENGINE_GROUP, self.engine_id,
                                self.cfg.claim_idle_ms, list(counts))
        source = f"claimed from {consumer}" if consumer != self.engine_id else "orphan"
        # XCLAIM counted one more delivery.
        return [StreamEntry(to_bytes(e), f, counts.get(to_bytes(e), 0) + 1, source) for e, f in entries]

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
