"""Threads that read a Redis stream into the inbox, each on its own connection with a blocking read,
so what arrives during a step is in the inbox when the next step starts.

``RequestReader``: XREADGROUP on ``kaiten:requests`` (as much as the engine has room for), creating
the consumer group when it is missing (first start, or Redis restarted empty). ``AbortReader``:
XREAD of ``kaiten:aborts`` (every engine reads every abort). While Redis is unreachable both retry
with exponential backoff."""
from __future__ import annotations

import logging
import threading

import redis

from engine_worker.inbox import Inbox, StreamEntry
from engine_worker.worker_stats import Counters
from shared import names
from shared.config import WorkerConfig
from shared.protocol import Abort, ProtocolError, decode

log = logging.getLogger("kaiten.worker")

ABORT_READ_COUNT = 1000


def ensure_group(r: redis.Redis) -> bool:
    """Create the engines' consumer group (and the stream); True if it was missing."""
    try:
        r.xgroup_create(names.REQUEST_STREAM, names.ENGINE_GROUP, id="0", mkstream=True)
    except redis.ResponseError as e:
        if "BUSYGROUP" not in str(e):
            raise
        return False
    log.info("created consumer group %r on %s", names.ENGINE_GROUP, names.REQUEST_STREAM)
    return True


def to_bytes(x) -> bytes:
    return x if isinstance(x, bytes) else str(x).encode()


def delivery_counts(r: redis.Redis, consumer: str) -> dict[bytes, int]:
    counts: dict[bytes, int] = {}
    start = "-"
    while True:
        rows = r.xpending_range(names.REQUEST_STREAM, names.ENGINE_GROUP, start, "+", 1000, consumername=consumer)
        for row in rows:
            counts[to_bytes(row["message_id"])] = int(row["times_delivered"])
        if len(rows) < 1000:
            return counts
        start = "(" + to_bytes(rows[-1]["message_id"]).decode()


class _Reader:
    """A daemon thread calling ``_read_once()`` until stopped, backing off while Redis is down."""
    name = "reader"

    def __init__(self, client: redis.Redis, inbox: Inbox, cfg: WorkerConfig, counters: Counters):
        self.r, self.inbox, self.cfg, self.counters = client, inbox, cfg, counters
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start_thread(self) -> None:
        self._thread = threading.Thread(target=self._run, daemon=True, name=f"kaiten-{self.name}")
        self._thread.start()

    def _run(self) -> None:
        delay = 0.0
        while not self._stop.is_set():
            try:
                self._read_once()
                delay = 0.0
            except Exception as e:      # connection errors, a Redis still loading, NOGROUP, ...
                if not self._recover(e):
                    self.counters.add("redis_errors")
                    delay = min(self.cfg.redis_retry_max, max(0.1, delay * 2))
                    (log.warning if delay <= 0.1 else log.debug)("%s: %s: %s; retrying in %.1f s", self.name,
                                                                 type(e).__name__, e, delay)
                    self._stop.wait(delay)

    def _read_once(self) -> None:
        raise NotImplementedError

    def _recover(self, e: Exception) -> bool:
        return False

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)


class RequestReader(_Reader):
    name = "request-reader"

    def __init__(self, client, inbox, cfg, counters):
        super().__init__(client, inbox, cfg, counters)
        self.engine_id = ""
        self.accepting = True              # False once stopping: read nothing more

    def prepare(self, engine_id: str) -> None:
        """Create the group and hand the inbox this consumer's pending entries (then start_thread)."""
        self.engine_id = engine_id
        ensure_group(self.r)
        own = self._own_pending()
        if own:
            log.info("re-read %d pending entries of consumer %r", len(own), engine_id)
            self.inbox.put_entries(own)

    def _own_pending(self) -> list[StreamEntry]:
        """The entries delivered to this consumer name and never acknowledged (a restart)."""
        last, entries = "0", []
        while True:
            res = self.r.xreadgroup(names.ENGINE_GROUP, self.engine_id, {names.REQUEST_STREAM: last}, count=500)
            batch = res[0][1] if res else []
            if not batch:
                break
            entries.extend(batch)
            last = batch[-1][0]
        if not entries:
            return []
        counts = delivery_counts(self.r, self.engine_id)
        return [StreamEntry(to_bytes(e), f, counts.get(to_bytes(e), 1), "pending") for e, f in entries]

    def _read_once(self) -> None:
        room = self.inbox.wait_room(0.1) if self.accepting else 0
        if room <= 0:
            if not self.accepting:
                self._stop.wait(0.1)
            return
        res = self.r.xreadgroup(names.ENGINE_GROUP, self.engine_id, {names.REQUEST_STREAM: ">"}, count=room,
                                block=self.cfg.idle_block_ms)
        if res:
            self.inbox.put_entries([StreamEntry(to_bytes(e), f, 1, "new") for e, f in res[0][1]])

    def _recover(self, e: Exception) -> bool:
        if not (isinstance(e, redis.ResponseError) and "NOGROUP" in str(e)):
            return False
        log.warning("consumer group missing (Redis restarted empty?): recreating it")
        ensure_group(self.r)
        self.counters.add("group_recreated")
        return True


class AbortReader(_Reader):
    name = "abort-reader"

    def prepare(self) -> None:
        """Start after the aborts of the last abort_lookback seconds (server time): a restarted
        engine re-reading its pending entries must not run one that was aborted meanwhile."""
        sec, usec = self.r.time()
        now_ms = int(sec) * 1000 + int(usec) // 1000
        self.last_id: bytes | str = f"{max(0, now_ms - int(self.cfg.abort_lookback * 1000))}-0"
        self._read(block=None)

    def _read_once(self) -> None:
        self._read(block=self.cfg.idle_block_ms)

    def _read(self, block: int | None) -> None:
        res = self.r.xread({names.ABORT_STREAM: self.last_id}, count=ABORT_READ_COUNT, block=block)
        if not res:
            return
        ids = []
        for entry_id, fields in res[0][1]:
            self.last_id = entry_id
            try:
                msg = decode(fields.get(names.PAYLOAD_FIELD, b""))
                if not isinstance(msg, Abort):
                    raise ProtocolError(f"expected an abort, got {msg.T!r}")
            except ProtocolError as e:
                log.warning("ignoring malformed abort entry %s: %s", entry_id, e)
                continue
            ids.append(msg.request_id)
        self.inbox.put_aborts(ids)
