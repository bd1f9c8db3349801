"""Threads that read a Redis stream into the inbox, each on its own connection with a blocking read,
so what arrives during a step is in the inbox when the next step starts.

``RequestReader``: XREADGROUP on this engine's own stream (requests routed to it) first, then on
its model's shared stream ``names.request_stream(model)`` (as much as the engine has room for; when both are empty it waits on
both at once, one entry each, so a lone free slot may take two), creating the consumer groups when
they are missing (first start, or Redis restarted empty). ``AbortReader``:
XREAD of ``kaiten:aborts`` (every engine reads every abort). ``ControlReader``: XREAD of the model's
``names.control_stream`` from its start (adapters loaded and unloaded at run time, replayed by an
engine that starts later). While Redis is unreachable each retries with exponential backoff."""
from __future__ import annotations

import logging
import threading

import redis

from engine_worker.inbox import Inbox, StreamEntry
from engine_worker.worker_stats import Counters
from shared import names
from shared.config import WorkerConfig
from shared.protocol import Abort, Control, ProtocolError, decode

log = logging.getLogger("kaiten.worker")

ABORT_READ_COUNT = 1000


def ensure_group(r: redis.Redis, stream: str) -> bool:
    """Create the engines' consumer group (and the stream); True if it was missing."""
    try:
        r.xgroup_create(stream, names.ENGINE_GROUP, id="0", mkstream=True)
    except redis.ResponseError as e:
        if "BUSYGROUP" not in str(e):
            raise
        return False
    log.info("created consumer group %r on %s", names.ENGINE_GROUP, stream)
    return True


_DELETE_IF_EMPTY = "if redis.call('XLEN', KEYS[1]) == 0 then return redis.call('DEL', KEYS[1]) end return 0"


def delete_if_empty(r: redis.Redis, stream: str) -> bool:
    """Delete `stream` if it has no entries, atomically (an XADD racing it is never lost)."""
    return bool(r.eval(_DELETE_IF_EMPTY, 1, stream))


def read_entries(r: redis.Redis, consumer: str, streams: dict[str, str], count: int, block: int | None,
                 source: str, deliveries: int = 1) -> list[StreamEntry]:
    """XREADGROUP as `consumer` from `streams` ({stream: id}), as StreamEntries in the given order."""
    res = r.xreadgroup(names.ENGINE_GROUP, consumer, streams, count=count, block=block)
    got = {to_bytes(name).decode(): rows for name, rows in res or []}
    return [StreamEntry(to_bytes(e), f, deliveries, source, stream)
            for stream in streams for e, f in got.get(stream, [])]


def to_bytes(x) -> bytes:
    return x if isinstance(x, bytes) else str(x).encode()


def delivery_counts(r: redis.Redis, consumer: str, stream: str) -> dict[bytes, int]:
    counts: dict[bytes, int] = {}
    start = "-"
    while True:
        rows = r.xpending_range(stream, names.ENGINE_GROUP, start, "+", 1000, consumername=consumer)
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

    def __init__(self, client, inbox, cfg, counters, model: str):
        super().__init__(client, inbox, cfg, counters)
        self.engine_id = ""
        self.own_stream = ""
        self.model_stream = names.request_stream(model)
        self.accepting = True              # False once stopping: read nothing more

    @property
    def streams(self) -> tuple[str, str]:
        return self.own_stream, self.model_stream     # own first

    def prepare(self, engine_id: str) -> None:
        """Create the groups and hand the inbox this consumer's pending entries (then start_thread)."""
        self.engine_id, self.own_stream = engine_id, names.engine_stream(engine_id)
        for stream in self.streams:
            ensure_group(self.r, stream)
        own = [e for stream in self.streams for e in self._own_pending(stream)]
        if own:
            log.info("re-read %d pending entries of consumer %r", len(own), engine_id)
            self.inbox.put_entries(own)

    def _own_pending(self, stream: str) -> list[StreamEntry]:
        """The entries delivered to this consumer name and never acknowledged (a restart)."""
        last, entries = "0", []
        while True:
            batch = read_entries(self.r, self.engine_id, {stream: last}, 500, None, "pending", 0)
            if not batch:
                break
            entries.extend(batch)
            last = batch[-1].entry_id
        if entries:
            counts = delivery_counts(self.r, self.engine_id, stream)
            for e in entries:
                e.deliveries = counts.get(e.entry_id, 1)
        return entries

    def _read_once(self) -> None:
        room = self.inbox.wait_room(0.1) if self.accepting else 0
        if room <= 0:
            if not self.accepting:
                self._stop.wait(0.1)
            return
        got: list[StreamEntry] = []
        for stream in self.streams:
            if room > len(got):
                got += read_entries(self.r, self.engine_id, {stream: ">"}, room - len(got), None, "new")
        if not got:
            got = read_entries(self.r, self.engine_id, {s: ">" for s in self.streams}, 1, self.cfg.idle_block_ms,
                               "new")
        if got:
            self.inbox.put_entries(got)

    def drain_own(self) -> list[StreamEntry]:
        """(stopping) Every entry routed to this engine and not read yet: the loop hands them back."""
        entries: list[StreamEntry] = []
        while batch := read_entries(self.r, self.engine_id, {self.own_stream: ">"}, 500, None, "new"):
            entries += batch
        return entries

    def delete_own_if_empty(self) -> None:
        """(stopped) Redis holds only unfinished work: drop this engine's own stream when empty."""
        if self.own_stream:
            delete_if_empty(self.r, self.own_stream)

    def _recover(self, e: Exception) -> bool:
        if not (isinstance(e, redis.ResponseError) and "NOGROUP" in str(e)):
            return False
        log.warning("consumer group missing (Redis restarted empty?): recreating it")
        for stream in self.streams:
            ensure_group(self.r, stream)
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
        aborts = xread_messages(self, names.ABORT_STREAM, Abort, block)
        self.inbox.put_aborts([a.request_id for a in aborts])


def xread_messages(reader, stream: str, kind: type, block: int | None) -> list:
    """The next messages of `kind` on `stream` after ``reader.last_id`` (moved on past them); a
    malformed entry is logged and skipped."""
    res = reader.r.xread({stream: reader.last_id}, count=ABORT_READ_COUNT, block=block)
    out = []
    for entry_id, fields in res[0][1] if res else ():
        reader.last_id = entry_id
        try:
            msg = decode(fields.get(names.PAYLOAD_FIELD, b""))
            if not isinstance(msg, kind):
                raise ProtocolError(f"expected a {kind.T} message, got {msg.T!r}")
        except ProtocolError as e:
            log.warning("ignoring malformed %s entry %s: %s", kind.T, entry_id, e)
            continue
        out.append(msg)
    return out


class ControlReader(_Reader):
    """Every control message of this engine's model, in order, from the stream's start."""
    name = "control-reader"

    def __init__(self, client, inbox, cfg, counters, model: str):
        super().__init__(client, inbox, cfg, counters)
        self.stream = names.control_stream(model)
        self.last_id: bytes | str = "0-0"

    def _read_once(self) -> None:
        self.inbox.put_controls(xread_messages(self, self.stream, Control, self.cfg.idle_block_ms))
