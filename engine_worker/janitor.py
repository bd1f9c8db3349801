"""The janitor: its own thread and connection, every janitor_interval, never in a step's way.

It takes over the pending entries of dead consumers (no heartbeat key; idle > claim_idle_ms) and
re-claims this consumer's orphans (entries delivered to it by a read whose reply was lost), handing
them to the loop through the inbox. A dead engine's own stream (requests routed to it) is emptied
the same way, its unread entries too, and deleted once empty. The loop hands every taken-over entry
back to its gateway, dead-letters entries delivered too often and skips aborted ones. A live
engine's long generations are never taken from it, however old. Claims cover this engine's model's
shared stream; a dead engine's own stream is emptied whatever its model (its entries are only
handed back, never run, so the gateway resubmits them to their model's stream)."""
from __future__ import annotations

import logging
import threading

import redis

from engine_worker.inbox import Inbox, StreamEntry
from engine_worker.stream_reader import delete_if_empty, ensure_group, read_entries, to_bytes
from engine_worker.worker_stats import Counters
from shared import names
from shared.config import WorkerConfig

log = logging.getLogger("kaiten.worker")

CLAIM_COUNT = 100


class Janitor:
    def __init__(self, client: redis.Redis, inbox: Inbox, cfg: WorkerConfig, counters: Counters, model: str):
        self.r, self.inbox, self.cfg, self.counters = client, inbox, cfg, counters
        self.model_stream = names.request_stream(model)
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
        streams = [self.model_stream, names.engine_stream(self.engine_id)]
        dead = self._dead_engine_streams()
        claimed: list[StreamEntry] = []
        for stream in streams + list(dead):
            claimed += self._claim_dead_consumers(stream)
        for stream, engine_id in dead.items():
            claimed += self._take_unread(stream, engine_id)
        mine = self.inbox.in_hand()
        for stream in streams:
            claimed += self._claim(stream, self.engine_id, mine)
        return claimed

    def _alive(self, engine_ids: list[str]) -> list[bool]:
        p = self.r.pipeline(transaction=False)
        for engine_id in engine_ids:
            p.exists(names.heartbeat_key(engine_id))
        return [bool(x) for x in p.execute()] if engine_ids else []

    def _dead_engine_streams(self) -> dict[str, str]:
        """{stream: engine id} of the own streams of engines without a heartbeat."""
        prefix = names.engine_stream("")
        streams = [to_bytes(k).decode() for k in self.r.scan_iter(match=names.ENGINE_STREAM_PATTERN, count=1000)]
        others = {k: k[len(prefix):] for k in streams if k != names.engine_stream(self.engine_id)}
        alive = self._alive(list(others.values()))
        return {k: e for (k, e), live in zip(others.items(), alive) if not live}

    def _claim_dead_consumers(self, stream: str) -> list[StreamEntry]:
        try:
            consumers = self.r.xinfo_consumers(stream, names.ENGINE_GROUP)
        except redis.ResponseError:       # no such stream or group (deleted meanwhile)
            return []
        others = [c for c in consumers if to_bytes(c["name"]).decode() != self.engine_id]
        claimed: list[StreamEntry] = []
        for c, live in zip(others, self._alive([to_bytes(c["name"]).decode() for c in others])):
            name = to_bytes(c["name"]).decode()
            if live:
                continue
            if int(c["pending"]) > 0:
                claimed += self._claim(stream, name, set())
            elif int(c.get("idle", 0)) > 100 * self.cfg.claim_idle_ms:
                self.r.xgroup_delconsumer(stream, names.ENGINE_GROUP, name)   # long gone
        return claimed

    def _take_unread(self, stream: str, engine_id: str) -> list[StreamEntry]:
        """Entries routed to a dead engine that it never read; the stream goes once empty (a
        gateway that XADDs to it later recreates it, and the next pass finds that entry)."""
        if delete_if_empty(self.r, stream):
            return []
        ensure_group(self.r, stream)
        return read_entries(self.r, self.engine_id, {stream: ">"}, CLAIM_COUNT, None, f"claimed from {engine_id}")

    def _claim(self, stream: str, consumer: str, skip: set[tuple[str, bytes]]) -> list[StreamEntry]:
        rows = self.r.xpending_range(stream, names.ENGINE_GROUP, "-", "+", CLAIM_COUNT,
                                     consumername=consumer, idle=self.cfg.claim_idle_ms)
        counts = {to_bytes(r["message_id"]): int(r["times_delivered"]) for r in rows}
        for e in [e for e in counts if (stream, e) in skip]:
            del counts[e]
        if not counts:
            return []
        entries = self.r.xclaim(stream, names.ENGINE_GROUP, self.engine_id, self.cfg.claim_idle_ms, list(counts))
        source = f"claimed from {consumer}" if consumer != self.engine_id else "orphan"
        # XCLAIM counted one more delivery.
        return [StreamEntry(to_bytes(e), f, counts.get(to_bytes(e), 0) + 1, source, stream) for e, f in entries]

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
