"""The engine's side of Redis: a ``RequestSource`` fed by the request stream, plus token publishing.

One object owns every Redis interaction of an engine worker. The per-step round trip is ONE
pipeline (one network round trip) carrying, in order: the step's token messages (one PUBLISH per
gateway: a ``TokenBatch`` with every delta that gateway's requests got in the step), dead letters,
XACKs of finished requests, the heartbeat when due, a non-blocking XREAD of the abort stream and an
XREADGROUP for new requests (COUNT bounded by the engine's free capacity; BLOCK ~100 ms only when
the engine is idle). What it read is handed to the engine by ``poll()`` at the top of a step.

The loop (``engine_worker/worker.py``)::

    outputs = engine.step()          # round N-1 runs on the I/O thread meanwhile
    source.on_outputs(outputs)       # deltas, acks
    source.finish_round()            # collect round N-1 (normally long done): new requests, aborts
    source.start_round(capacity, block=idle)   # round N: this step's tokens + the next poll

so the network round trip overlaps the next forward pass instead of stalling it, while each step
still gets its own message per gateway (at most one round is in flight). Only Redis commands run
on the I/O thread; all state lives on the engine thread. ``io_thread=False`` runs rounds inline.

The janitor (every ``janitor_interval``, inside a round) takes over the pending entries of dead
consumers (no heartbeat key; idle > claim_idle_ms), re-claims this consumer's orphans (delivered by
a round whose reply was lost), dead-letters entries delivered more than max_deliveries times and
skips entries of aborted requests.

Failure handling: a connection error marks Redis down; the engine keeps stepping its in-flight
requests, their deltas accumulate (merged per request), and rounds are retried with exponential
backoff. Messages that may or may not have gone out are re-sent with the same ``seq`` numbers (a
gateway can drop a ``seq`` it has seen). NOGROUP (Redis restarted empty) recreates the group.
"""
from __future__ import annotations

import concurrent.futures
import logging
import os
import socket
import time
import uuid
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any, Iterable

import msgpack
import redis

from shared import names
from shared.config import WorkerConfig
from shared.protocol import PROTOCOL_VERSION, Abort, GenerateRequest, ProtocolError, TokenBatch, decode

from .request_source import NewRequest

log = logging.getLogger("kaiten.worker")

CONNECTION_ERRORS = (redis.ConnectionError, redis.TimeoutError, ConnectionError, OSError)
ABORT_READ_COUNT = 1000
RECENT_ABORTS_MAX = 20_000
JANITOR_CLAIM_COUNT = 100


def default_engine_id() -> str:
    return socket.gethostname() or "engine"


class BoundedSet:
    """An insertion-ordered set that forgets its oldest members past ``maxlen``."""

    def __init__(self, maxlen: int):
        self._d: OrderedDict[str, None] = OrderedDict()
        self.maxlen = maxlen

    def add(self, key: str) -> None:
        self._d[key] = None
        self._d.move_to_end(key)
        while len(self._d) > self.maxlen:
            self._d.popitem(last=False)

    def __contains__(self, key: object) -> bool:
        return key in self._d

    def __len__(self) -> int:
        return len(self._d)


@dataclass(slots=True)
class _Req:
    entry_id: bytes
    reply_to: str
    admitted: bool = False          # handed to the engine (else still in the local buffer)


@dataclass(slots=True)
class _Pending:
    """A delta being accumulated for the next publish (merged if Redis was down for a while)."""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list | None = None
    finish_reason: str | None = None
    error: str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_output_tokens: int = 0
    metrics: dict | None = None


@dataclass(eq=False)
class _Round:
    """One round trip: what it writes (kept for a retry if it fails) and what it read."""
    pub: list
    dead: list
    acks: list
    t0: float
    heartbeat: bool = False
    read_new: bool = False
    blocking: bool = False
    reread: bool = False
    janitor: bool = False
    held: set = field(default_factory=set)
    pipeline: Any = None
    future: Any = None
    results: list | None = None
    error: BaseException | None = None
    group_recreated: bool = False
    extra: list = field(default_factory=list)
    extra_error: BaseException | None = None
    stall: float = 0.0
    rtt: float = 0.0


@dataclass
class SyncStats:
    """Time spent in ``sync()`` round trips that did not block waiting for work."""
    count: int = 0
    total_s: float = 0.0
    max_s: float = 0.0
    recent: deque = field(default_factory=lambda: deque(maxlen=4096))

    def add(self, dt: float) -> None:
        self.count += 1
        self.total_s += dt
        self.max_s = max(self.max_s, dt)
        self.recent.append(dt)

    def summary(self) -> dict[str, float]:
        xs = sorted(self.recent)
        pct = (lambda q: xs[min(len(xs) - 1, int(q * len(xs)))] * 1e6) if xs else (lambda q: 0.0)
        return {"count": self.count, "mean_us": (self.total_s / self.count * 1e6) if self.count else 0.0,
                "p50_us": pct(0.5), "p99_us": pct(0.99), "max_us": self.max_s * 1e6}


def _logprobs_wire(lps) -> list | None:
    if lps is None:
        return None
    out = []
    for lp in lps:
        if isinstance(lp, dict):
            out.append({"token_id": lp["token_id"], "logprob": lp["logprob"], "top": [list(x) for x in lp.get("top", [])]})
        else:
            out.append({"token_id": lp.token_id, "logprob": float(lp.logprob), "top": [list(x) for x in lp.top]})
    return out


class RedisRequestSource:
    """RequestSource over ``kaiten:requests`` / ``kaiten:aborts``, and the engine's token publisher."""

    def __init__(self, client: redis.Redis, config: WorkerConfig, engine_id: str = "", *,
                 idle_block_ms: int = 100, io_thread: bool = True):
        self.r = client
        self.cfg = config
        self.explicit_id = bool(engine_id or config.engine_id)
        self.engine_id = engine_id or config.engine_id or default_engine_id()
        self.instance = uuid.uuid4().hex[:12]
        self.idle_block_ms = idle_block_ms
        self.heartbeat_fields: dict[str, Any] = {}     # engine facts the worker fills in (model, ...)

        self._new: deque[NewRequest] = deque()          # read, not yet handed to the engine
        self._engine_aborts: list[str] = []             # abort ids for the engine's next step
        self._reqs: dict[str, _Req] = {}                # every request this worker holds
        self._out: dict[str, dict[str, _Pending]] = {}  # reply_to -> request_id -> pending delta
        self._seq: dict[str, int] = {}                  # next seq per request that has published
        self._unsent: list[tuple[str, bytes]] = []      # encoded messages not yet confirmed sent
        self._acks: list[bytes] = []
        self._dead: list[dict] = []
        self.recent_aborts = BoundedSet(RECENT_ABORTS_MAX)
        self._abort_last_id: bytes | str = "$"

        self.redis_up = True
        self._retry_at = 0.0
        self._backoff = 0.0
        self._last_heartbeat = 0.0
        self._last_janitor = time.monotonic()
        self._need_reread = False
        self.accepting = True                           # False while draining for shutdown
        self.stats = SyncStats()         # time the engine loop spends on Redis per step (its stall)
        self.rtt_stats = SyncStats()     # round-trip time of the pipeline itself
        self._round: _Round | None = None
        self._executor = (concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kaiten-redis-io")
                          if io_thread else None)
        self.counters = {"requests": 0, "dead_lettered": 0, "claimed": 0, "aborts": 0,
                         "redis_errors": 0, "group_recreated": 0, "messages": 0}

    # ------------------------------------------------------------------ RequestSource
    def poll(self, capacity: int) -> tuple[list[NewRequest], list[str]]:
        n = max(0, min(capacity, len(self._new)))
        reqs = [self._new.popleft() for _ in range(n)]
        for req in reqs:
            self._reqs[req.request_id].admitted = True
        aborts, self._engine_aborts = self._engine_aborts, []
        return reqs, aborts

    # ------------------------------------------------------------------ state queries
    def __len__(self) -> int:
        return len(self._new)

    def has_buffered(self) -> bool:
        return bool(self._new) or bool(self._engine_aborts)

    def has_outgoing(self) -> bool:
        return bool(self._out or self._unsent or self._acks or self._dead)

    def num_held(self) -> int:
        return len(self._reqs)

    # ------------------------------------------------------------------ startup
    def start(self) -> None:
        """Pick/validate the consumer name, create the group, re-read own pending entries."""
        self._choose_engine_id()
        self._ensure_group()
        now_ms = self._redis_time_ms()
        lookback_ms = int(self.cfg.abort_lookback * 1000)
        self._abort_last_id = f"{max(0, now_ms - lookback_ms)}-0"
        self._read_aborts_blocking_free()
        claimed = self._q_own_pending({r.entry_id for r in self._reqs.values()})
        for entry_id, fields, deliveries, source in claimed:
            self._ingest(entry_id, fields, deliveries, source)
        if claimed:
            log.info("re-read %d pending entries of consumer %r", len(claimed), self.engine_id)
        log.info("engine %s: consuming %s as %r in group %r", self.instance, names.REQUEST_STREAM,
                 self.engine_id, names.ENGINE_GROUP)

    def _redis_time_ms(self) -> int:
        sec, usec = self.r.time()
        return int(sec) * 1000 + int(usec) // 1000

    def _read_heartbeat(self, engine_id: str) -> dict | None:
        raw = self.r.get(names.heartbeat_key(engine_id))
        if raw is None:
            return None
        try:
            hb = msgpack.unpackb(raw, raw=False)
            return hb if isinstance(hb, dict) else {}
        except Exception:
            return {}

    def _live_other(self, engine_id: str) -> str | None:
        """The instance of another live engine heartbeating under ``engine_id``, else None.

        A heartbeat left by a process that just died (a quick restart under the same name) is
        waited out: live means refreshed within a couple of heartbeat intervals."""
        stale_after = 2 * self.cfg.heartbeat_interval + 0.5
        deadline = time.monotonic() + stale_after + 0.5
        first_time = None
        while True:
            hb = self._read_heartbeat(engine_id)
            if hb is None or hb.get("instance") == self.instance:
                return None
            t = float(hb.get("time", 0) or 0)
            if time.time() - t > stale_after:
                return None                                  # left behind by a dead process
            if first_time is None:
                first_time = t
            elif t > first_time or time.monotonic() > deadline:
                return str(hb.get("instance", "?"))          # refreshed: a live engine
            time.sleep(min(0.2, self.cfg.heartbeat_interval / 2))

    def _choose_engine_id(self) -> None:
        """The consumer name must be stable per deployment and unique among live engines.

        An explicit id is used as given (a warning if another live engine heartbeats under it).
        The default (hostname) gets a numeric suffix when a live engine already uses it, so two
        engines on one host do not share a consumer.
        """
        base = self.engine_id
        for n in range(1, 64):
            candidate = base if n == 1 else f"{base}-{n}"
            other = self._live_other(candidate)
            if other is None:
                self.engine_id = candidate
                break
            if self.explicit_id:
                log.warning("engine id %r has a live heartbeat from another process (instance %s); "
                            "two engines sharing a consumer name may both serve its pending entries",
                            candidate, other)
                break
        # Register at once, so a concurrently starting engine on this host picks another name.
        self.r.set(names.heartbeat_key(self.engine_id), self._heartbeat_payload({}),
                   px=int(self.cfg.heartbeat_ttl * 1000))

    def _ensure_group(self) -> None:
        try:
            self.r.xgroup_create(names.REQUEST_STREAM, names.ENGINE_GROUP, id="0", mkstream=True)
            log.info("created consumer group %r on %s", names.ENGINE_GROUP, names.REQUEST_STREAM)
        except redis.ResponseError as e:
            if "BUSYGROUP" not in str(e):
                raise

    def _read_aborts_blocking_free(self) -> None:
        res = self.r.xread({names.ABORT_STREAM: self._abort_last_id}, count=ABORT_READ_COUNT)
        self._handle_aborts(res)

    def _q_own_pending(self, held: set[bytes]) -> list[tuple[bytes, dict | None, int, str]]:
        """(Redis only) The entries delivered to this consumer and never acknowledged, minus held."""
        last = "0"
        entries: list[tuple[bytes, dict | None]] = []
        while True:
            res = self.r.xreadgroup(names.ENGINE_GROUP, self.engine_id, {names.REQUEST_STREAM: last}, count=500)
            batch = res[0][1] if res else []
            if not batch:
                break
            entries.extend(batch)
            last = batch[-1][0]
        entries = [(_b(e), f) for e, f in entries if _b(e) not in held]
        if not entries:
            return []
        counts = self._delivery_counts(self.engine_id)
        return [(e, f, counts.get(e, 1), "pending") for e, f in entries]

    def _delivery_counts(self, consumer: str) -> dict[bytes, int]:
        counts: dict[bytes, int] = {}
        start = "-"
        while True:
            rows = self.r.xpending_range(names.REQUEST_STREAM, names.ENGINE_GROUP, start, "+", 1000,
                                         consumername=consumer)
            for row in rows:
                counts[_b(row["message_id"])] = int(row["times_delivered"])
            if len(rows) < 1000:
                return counts
            start = "(" + _s(rows[-1]["message_id"])

    # ------------------------------------------------------------------ ingest
    def _ingest(self, entry_id: bytes, fields: dict | None, deliveries: int, source: str) -> None:
        """Take one stream entry: queue it for the engine, or dead-letter/answer it. Never raises."""
        entry_id = _b(entry_id)
        try:
            self._ingest_entry(entry_id, fields, deliveries, source)
        except Exception as e:   # a bug or an input nobody foresaw must not stop the loop
            log.exception("entry %s could not be handled", entry_id.decode(errors="replace"))
            rid, reply_to = _salvage_ids(fields.get(names.PAYLOAD_FIELD) if isinstance(fields, dict) else None)
            if rid in self._reqs:
                rid = reply_to = None        # already held: leave that request alone
            self._dead_letter(entry_id, fields if isinstance(fields, dict) else {},
                              f"could not be handled: {type(e).__name__}: {e}", deliveries, rid, reply_to)

    def _ingest_entry(self, entry_id: bytes, fields: dict | None, deliveries: int, source: str) -> None:
        if fields is None:       # the entry was trimmed away while pending
            self._acks.append(entry_id)
            return
        payload = fields.get(names.PAYLOAD_FIELD)
        try:
            if payload is None:
                raise ProtocolError(f"entry has no {names.PAYLOAD_FIELD.decode()!r} field")
            msg = decode(payload)
            if not isinstance(msg, GenerateRequest):
                raise ProtocolError(f"expected a request message on {names.REQUEST_STREAM}, got {msg.T!r}")
            if msg.deadline is not None and (not isinstance(msg.deadline, (int, float)) or isinstance(msg.deadline, bool)):
                raise ProtocolError("request: deadline must be a number or nil")
        except ProtocolError as e:
            rid, reply_to = _salvage_ids(payload)
            self._dead_letter(entry_id, fields, f"malformed request: {e}", deliveries, rid, reply_to)
            return
        rid = msg.request_id
        if rid in self._reqs:
            if self._reqs[rid].entry_id != entry_id:
                self._dead_letter(entry_id, fields, f"duplicate request_id {rid!r} already in progress",
                                  deliveries, None, None)
            return
        if deliveries > self.cfg.max_deliveries:
            self._dead_letter(entry_id, fields, f"delivered {deliveries} times (max_deliveries="
                              f"{self.cfg.max_deliveries}); the engines that took it died", deliveries,
                              rid, msg.reply_to)
            return
        if rid in self.recent_aborts:
            self._acks.append(entry_id)
            self._emit_terminal(msg.reply_to, rid, "abort", None)
            return
        if msg.deadline is not None and time.time() > msg.deadline:
            self._acks.append(entry_id)
            self._emit_terminal(msg.reply_to, rid, "error", "the request's deadline passed before an engine started it")
            return
        self._reqs[rid] = _Req(entry_id, msg.reply_to)
        self._new.append(NewRequest(rid, msg.prompt_token_ids, msg.params))
        self.counters["requests"] += 1
        if source != "new":
            log.info("took over request %s (entry %s, %s, delivery %d)", rid, entry_id.decode(), source, deliveries)

    def _dead_letter(self, entry_id: bytes, fields: dict, reason: str, deliveries: int,
                     rid: str | None, reply_to: str | None) -> None:
        log.warning("dead-lettering entry %s: %s", entry_id.decode(errors="replace"), reason)
        dead = {"m": fields.get(names.PAYLOAD_FIELD, b""), "error": reason, "source_id": entry_id,
                "engine_id": self.engine_id, "deliveries": deliveries, "time": repr(time.time())}
        others = {k: v for k, v in fields.items() if k != names.PAYLOAD_FIELD}
        if others:
            dead["fields"] = msgpack.packb(others, use_bin_type=True)
        if rid is not None:
            dead["request_id"] = rid
        self._dead.append(dead)
        self._acks.append(entry_id)
        self.counters["dead_lettered"] += 1
        if rid and reply_to:
            self._emit_terminal(reply_to, rid, "error", reason)

    def _emit_terminal(self, reply_to: str, rid: str, reason: str, error: str | None) -> None:
        p = self._out.setdefault(reply_to, {}).setdefault(rid, _Pending())
        p.finish_reason = reason
        p.error = error

    # ------------------------------------------------------------------ aborts
    def _handle_aborts(self, res) -> None:
        if not res:
            return
        for entry_id, fields in res[0][1]:
            self._abort_last_id = entry_id
            try:
                msg = decode(fields.get(names.PAYLOAD_FIELD, b""))
                if not isinstance(msg, Abort):
                    raise ProtocolError(f"expected an abort, got {msg.T!r}")
            except ProtocolError as e:
                log.warning("ignoring malformed abort entry %s: %s", _s(entry_id), e)
                continue
            self._abort(msg.request_id)

    def _abort(self, rid: str) -> None:
        self.recent_aborts.add(rid)
        req = self._reqs.get(rid)
        if req is None:
            return
        self.counters["aborts"] += 1
        if req.admitted:
            self._engine_aborts.append(rid)   # the engine frees its blocks and reports "abort"
            return
        for i, nr in enumerate(self._new):
            if nr.request_id == rid:
                del self._new[i]
                break
        del self._reqs[rid]
        self._acks.append(req.entry_id)
        self._emit_terminal(req.reply_to, rid, "abort", None)

    # ------------------------------------------------------------------ engine outputs
    def on_outputs(self, outputs: Iterable[Any]) -> None:
        for o in outputs:
            rid = o.request_id
            req = self._reqs.get(rid)
            if req is None:
                log.error("engine output for unknown request %r", rid)
                continue
            per = self._out.get(req.reply_to)
            if per is None:
                per = self._out[req.reply_to] = {}
            p = per.get(rid)
            if p is None:
                p = per[rid] = _Pending()
            if o.new_token_ids:
                p.token_ids.extend(o.new_token_ids)
            if o.new_logprobs:
                if p.logprobs is None:
                    p.logprobs = []
                p.logprobs.extend(_logprobs_wire(o.new_logprobs))
            if o.finish_reason is not None:
                p.finish_reason = o.finish_reason
                p.error = o.error
                p.num_prompt_tokens = o.num_prompt_tokens
                p.num_cached_tokens = o.num_cached_tokens
                p.num_output_tokens = o.num_output_tokens
                p.metrics = dict(o.metrics) if o.metrics else None
                self._acks.append(req.entry_id)
                del self._reqs[rid]

    def started_requests(self) -> list[str]:
        """Held requests that already streamed something to their gateway.

        At shutdown the worker ends these with an error delta; the others stay pending in the
        stream for another engine (or this one, restarted) to take over from the start."""
        started = []
        for rid, req in list(self._reqs.items()):
            if rid in self._seq or rid in self._out.get(req.reply_to, {}):
                started.append(rid)
        return started

    def error_request(self, rid: str, error: str) -> None:
        req = self._reqs.pop(rid, None)
        if req is None:
            return
        self._acks.append(req.entry_id)
        self._emit_terminal(req.reply_to, rid, "error", error)

    # ------------------------------------------------------------------ the round trip
    def _encode_out(self) -> None:
        if not self._out:
            return
        for reply_to, per in self._out.items():
            deltas = []
            for rid, p in per.items():
                seq = self._seq.get(rid, 0)
                d: dict[str, Any] = {"request_id": rid, "seq": seq, "token_ids": p.token_ids}
                if p.logprobs is not None:
                    d["logprobs"] = p.logprobs
                if p.finish_reason is not None:
                    self._seq.pop(rid, None)
                    d["finish_reason"] = p.finish_reason
                    if p.error is not None:
                        d["error"] = p.error
                    d["num_prompt_tokens"] = p.num_prompt_tokens
                    d["num_cached_tokens"] = p.num_cached_tokens
                    d["num_output_tokens"] = p.num_output_tokens
                    d["metrics"] = p.metrics
                else:
                    self._seq[rid] = seq + 1
                deltas.append(d)
            body = {"engine_id": self.engine_id, "deltas": deltas, "v": PROTOCOL_VERSION, "t": TokenBatch.T}
            self._unsent.append((names.reply_channel(reply_to), msgpack.packb(body, use_bin_type=True)))
        self._out = {}

    def start_round(self, capacity: int, block: bool, engine_stats: Any = None) -> bool:
        """Start one round trip: publish, dead-letter, ack, heartbeat, read aborts and new requests.

        ``capacity``: how many new requests to read (0: none). ``block``: the engine is idle, so
        the read may wait up to ``idle_block_ms`` for a request. With the I/O thread the round runs
        while the engine computes its next step; ``finish_round()`` collects it. Returns False
        (nothing started) while Redis is down and the next retry is not due yet.
        """
        assert self._round is None, "finish_round() first"
        t0 = time.perf_counter()
        now = time.monotonic()
        if not self.redis_up and now < self._retry_at:
            return False
        self._encode_out()
        rnd = _Round(self._unsent, self._dead, self._acks, t0)
        self._unsent, self._dead, self._acks = [], [], []
        p = self.r.pipeline(transaction=False)
        for channel, data in rnd.pub:
            p.publish(channel, data)
        for dead in rnd.dead:
            p.xadd(names.DEAD_LETTER_STREAM, dead, maxlen=names.DEAD_LETTER_MAXLEN, approximate=True)
        if rnd.acks:
            p.xack(names.REQUEST_STREAM, names.ENGINE_GROUP, *rnd.acks)
        if engine_stats is not None and now - self._last_heartbeat >= self.cfg.heartbeat_interval:
            rnd.heartbeat = True
            p.set(names.heartbeat_key(self.engine_id), self._heartbeat_payload(engine_stats),
                  px=int(self.cfg.heartbeat_ttl * 1000))
        p.xread({names.ABORT_STREAM: self._abort_last_id}, count=ABORT_READ_COUNT)
        rnd.read_new = capacity > 0 and self.accepting
        rnd.blocking = block and rnd.read_new
        if rnd.read_new:
            p.xreadgroup(names.ENGINE_GROUP, self.engine_id, {names.REQUEST_STREAM: ">"}, count=capacity,
                         block=self.idle_block_ms if rnd.blocking else None)
        if self._need_reread or now - self._last_janitor >= self.cfg.janitor_interval:
            rnd.held = {r.entry_id for r in self._reqs.values()}
            rnd.reread, self._need_reread = self._need_reread, False
            rnd.janitor = now - self._last_janitor >= self.cfg.janitor_interval
            if rnd.janitor:
                self._last_janitor = now
        rnd.pipeline = p
        if self._executor is not None:
            rnd.future = self._executor.submit(self._run_round, rnd)
        else:
            self._run_round(rnd)
        self._round = rnd
        rnd.stall = time.perf_counter() - t0
        return True

    def round_in_flight(self) -> bool:
        return self._round is not None

    def _run_round(self, rnd: "_Round") -> None:
        """(I/O thread) Execute the round's pipeline, then any janitor/re-read work. Redis only."""
        t0 = time.perf_counter()
        try:
            rnd.results = rnd.pipeline.execute(raise_on_error=False)
        except Exception as e:      # connection/timeout errors, a Redis still loading, ...
            rnd.error = e
            return
        finally:
            rnd.rtt = time.perf_counter() - t0
        if rnd.read_new and _is_nogroup(rnd.results[-1]):
            try:
                self._ensure_group()
                rnd.group_recreated = True
            except Exception as e:
                rnd.extra_error = e
        try:
            if rnd.reread:
                rnd.extra = self._q_own_pending(rnd.held)
            if rnd.janitor:
                rnd.extra = rnd.extra + self._q_janitor(rnd.held | {e for e, *_ in rnd.extra})
        except Exception as e:
            rnd.extra_error = e

    def finish_round(self, wait: bool = True) -> bool:
        """Collect the round trip in flight (waiting for it if ``wait``) and ingest what it read.

        Returns True when no round is in flight any more."""
        rnd = self._round
        if rnd is None:
            return True
        t0 = time.perf_counter()
        if rnd.future is not None:
            if not wait and not rnd.future.done():
                return False
            rnd.future.result()
        self._round = None
        if rnd.error is not None:
            # Nothing is known to have gone out: keep every write for the next round, in order
            # (a message that did go out is re-sent with the same seq; the gateway drops it).
            self._unsent = rnd.pub + self._unsent
            self._dead = rnd.dead + self._dead
            self._acks = rnd.acks + self._acks
            self._mark_down(rnd.error)
            return True
        if not self.redis_up:
            log.warning("Redis is reachable again")
            self.redis_up = True
            self._backoff = 0.0
            self._need_reread = True
        res = rnd.results
        n_pub, n_dead = len(rnd.pub), len(rnd.dead)
        self.counters["messages"] += n_pub
        for r in res[:n_pub + n_dead]:
            if isinstance(r, Exception):
                log.warning("publish/dead-letter failed: %s", r)
        if rnd.heartbeat:
            self._last_heartbeat = time.monotonic()
        i = n_pub + n_dead + (1 if rnd.acks else 0) + (1 if rnd.heartbeat else 0)
        if isinstance(res[i], Exception):
            log.warning("XREAD %s failed: %s", names.ABORT_STREAM, res[i])
        else:
            self._handle_aborts(res[i])
        if rnd.read_new:
            new_res = res[i + 1]
            if isinstance(new_res, Exception):
                if _is_nogroup(new_res):
                    log.warning("consumer group missing (Redis restarted empty?): %s",
                                "recreated it" if rnd.group_recreated else "will recreate it")
                    self.counters["group_recreated"] += int(rnd.group_recreated)
                    self._abort_last_id = "0-0"
                else:
                    log.warning("XREADGROUP failed: %s", new_res)
            elif new_res:
                for entry_id, fields in new_res[0][1]:
                    self._ingest(entry_id, fields, 1, source="new")
        for entry_id, fields, deliveries, source in rnd.extra:
            self._ingest(entry_id, fields, deliveries, source)
        if rnd.extra:
            self.counters["claimed"] += sum(1 for *_, src in rnd.extra if src != "pending")
        if rnd.extra_error is not None:
            log.warning("janitor/recovery failed: %s: %s", type(rnd.extra_error).__name__, rnd.extra_error)
            if isinstance(rnd.extra_error, CONNECTION_ERRORS):
                self._need_reread = self._need_reread or rnd.reread
        if not rnd.blocking:
            self.stats.add(rnd.stall + (time.perf_counter() - t0))
            self.rtt_stats.add(rnd.rtt)
        return True

    def sync(self, capacity: int, block: bool, engine_stats: Any = None) -> bool:
        """A whole round trip, synchronously (startup, shutdown, tests). False if Redis is down."""
        self.finish_round()
        if not self.start_round(capacity, block, engine_stats):
            return False
        self.finish_round()
        return self.redis_up

    def close(self) -> None:
        self.finish_round()
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None

    def _mark_down(self, err: Exception) -> None:
        self.counters["redis_errors"] += 1
        self._backoff = min(self.cfg.redis_retry_max, max(0.1, self._backoff * 2))
        self._retry_at = time.monotonic() + self._backoff
        if self.redis_up:
            log.warning("Redis unavailable (%s: %s); the engine keeps its in-flight work, retrying",
                        type(err).__name__, err)
        else:
            log.debug("Redis still unavailable: %s", err)
        self.redis_up = False

    def retry_delay(self) -> float:
        return max(0.0, self._retry_at - time.monotonic()) if not self.redis_up else 0.0

    # ------------------------------------------------------------------ heartbeat
    def _heartbeat_payload(self, stats: Any) -> bytes:
        def g(name, default=0):
            if isinstance(stats, dict):
                return stats.get(name, default)
            return getattr(stats, name, default)
        hb = {
            "engine_id": self.engine_id,
            "instance": self.instance,
            "pid": os.getpid(),
            "time": time.time(),
            "num_running": int(g("num_running")),
            "num_waiting": int(g("num_waiting")),
            "num_waiting_tokens": int(g("num_waiting_tokens")),
            "kv_cache_usage": float(g("kv_cache_usage", 0.0)),
            "prefix_cache_hit_rate": float(g("prefix_cache_hit_rate", 0.0)),
            "num_free_blocks": int(g("num_free_blocks")),
            "num_blocks": int(g("num_blocks")),
            "max_num_seqs": int(g("max_num_seqs")),
            "accepting": self.accepting,
        }
        hb.update(self.heartbeat_fields)   # model, max_model_len, capacity, ... (set by the worker)
        return msgpack.packb(hb, use_bin_type=True)

    def write_heartbeat(self, engine_stats: Any) -> None:
        self.r.set(names.heartbeat_key(self.engine_id), self._heartbeat_payload(engine_stats),
                   px=int(self.cfg.heartbeat_ttl * 1000))
        self._last_heartbeat = time.monotonic()

    def delete_heartbeat(self) -> None:
        self.r.delete(names.heartbeat_key(self.engine_id))

    # ------------------------------------------------------------------ janitor (Redis only)
    def _q_janitor(self, held: set[bytes]) -> list[tuple[bytes, dict | None, int, str]]:
        """Claim dead consumers' stale entries and this consumer's orphans; return them to ingest.

        A consumer is dead when its heartbeat key is gone: a live engine's long generations are
        never taken from it, however long ago they were delivered. An orphan is an entry pending
        on this consumer that it does not hold (a round trip whose reply was lost)."""
        consumers = self.r.xinfo_consumers(names.REQUEST_STREAM, names.ENGINE_GROUP)
        others = [c for c in consumers if _s(c["name"]) != self.engine_id]
        alive: list = []
        if others:
            p = self.r.pipeline(transaction=False)
            for c in others:
                p.exists(names.heartbeat_key(_s(c["name"])))
            alive = p.execute()
        claimed = []
        for c, live in zip(others, alive):
            name = _s(c["name"])
            if live:
                continue
            if int(c["pending"]) > 0:
                claimed += self._q_claim(name)
            elif int(c.get("idle", 0)) > 100 * self.cfg.claim_idle_ms:
                self.r.xgroup_delconsumer(names.REQUEST_STREAM, names.ENGINE_GROUP, name)  # long gone
        claimed += self._q_claim(self.engine_id, skip=held)
        return claimed

    def _q_claim(self, consumer: str, skip: set[bytes] | None = None) -> list[tuple[bytes, dict | None, int, str]]:
        rows = self.r.xpending_range(names.REQUEST_STREAM, names.ENGINE_GROUP, "-", "+", JANITOR_CLAIM_COUNT,
                                     consumername=consumer, idle=self.cfg.claim_idle_ms)
        rows = [r for r in rows if skip is None or _b(r["message_id"]) not in skip]
        if not rows:
            return []
        counts = {_b(r["message_id"]): int(r["times_delivered"]) for r in rows}
        entries = self.r.xclaim(names.REQUEST_STREAM, names.ENGINE_GROUP, self.engine_id,
                                self.cfg.claim_idle_ms, list(counts))
        source = f"claimed from {consumer}" if consumer != self.engine_id else "orphan"
        # XCLAIM counted one more delivery.
        return [(_b(e), f, counts.get(_b(e), 0) + 1, source) for e, f in entries]


def _is_nogroup(x) -> bool:
    return isinstance(x, redis.ResponseError) and "NOGROUP" in str(x)


def _b(x) -> bytes:
    return x if isinstance(x, bytes) else str(x).encode()


def _s(x) -> str:
    return x.decode() if isinstance(x, bytes) else str(x)


def _salvage_ids(payload) -> tuple[str | None, str | None]:
    """request_id and reply_to from a malformed request, when they are usable strings."""
    if not isinstance(payload, (bytes, bytearray)):
        return None, None
    try:
        body = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except Exception:
        return None, None
    if not isinstance(body, dict):
        return None, None
    rid, reply_to = body.get("request_id"), body.get("reply_to")
    if isinstance(rid, str) and rid and isinstance(reply_to, str) and reply_to:
        return rid, reply_to
    return None, None
