"""EngineWorker: one engine worker serving the Redis request stream (its CLI, `kaiten engine`, is
engine_worker/cli.py).

The loop (``EngineWorker.run``)::

    while running:
        arrivals = inbox.take()          # what the reader threads got during the last step
        apply(arrivals)                  # engine.add_request / engine.abort_request
        outputs = engine.step()          # schedule -> run -> postprocess
        publisher.add(outputs)           # deltas, finished entries
        round.start(publisher.take())    # ONE pipeline on the I/O thread, during the next step

Around it, each thread with its own Redis connection (none ever waits for a step):
``stream_reader`` (new requests, aborts), ``heartbeat``, ``janitor`` (dead consumers' entries),
``orphan_watch`` (dead gateways, deadlines). A request read during step k is admitted in step k+1.

Failover (see gateway/backend/failover.py): the gateway alone resubmits a request whose engine is gone, so
this loop never runs an entry that another consumer read -- one a janitor claimed from a dead
engine, or one an earlier process of this consumer name left pending. It ACKs and deletes such an
entry and sends its gateway a ``Handoff`` (counted as ``handed_back``). On SIGTERM the loop stops
reading, hands every request it holds to its gateway the same way (after the tokens already
computed) and exits: the gateways move them to the other engines.
"""
from __future__ import annotations

import dataclasses
import logging
import signal
import threading
import time
import uuid

from engine_worker.consumer_id import choose_engine_id, default_engine_id
from engine_worker.control import Controls
from engine_worker.held import BoundedSet, HeldRequest, HeldRequests
from engine_worker.heartbeat import Heartbeat
from engine_worker.inbox import Arrivals, Inbox, StreamEntry
from engine_worker.intake import RejectedEntry, dead_letter_fields, decode_entry, salvage_ids
from engine_worker.io_round import IoRound, RoundResult
from engine_worker.janitor import Janitor
from engine_worker.kv_store.redis_store import attach_kv_store
from engine_worker.metrics import EngineMetrics
from engine_worker.orphan_watch import OrphanWatch
from engine_worker.publisher import Outgoing, Publisher
from engine_worker.engine.sampling_params import SamplingParams
from engine_worker.startup_report import StartupReport
from engine_worker.stream_reader import AbortReader, ControlReader, RequestReader
from engine_worker.worker_stats import Counters, LatencyStats
from shared import names
from shared.config import EngineConfig, WorkerConfig
from shared.redis_conn import min_socket_timeout_for_block, redis_client

log = logging.getLogger("kaiten.worker")

LOG_INTERVAL = 60.0
RECENT_ABORTS_MAX = 20_000
STOP_ERRORS = {"deadline": "the request's deadline passed"}
HANDOFF_REASON = {"pending": "restarted"}     # by entry source; a claimed entry's is "engine_lost"


class EngineWorker:
    """An ``LLMEngine`` fed from Redis. ``run()`` until ``stop()``."""

    def __init__(self, engine_config: EngineConfig, worker_config: WorkerConfig, *, engine=None,
                 startup: StartupReport | None = None):
        self.cfg = cfg = worker_config
        self.engine_config = engine_config
        self.startup = startup                  # deleted once the engine serves
        if engine is None:
            from engine_worker.engine.llm_engine import LLMEngine
            engine = LLMEngine(engine_config, None if startup is None else startup.stages)
            attach_kv_store(engine)
        self.engine = engine
        self.model = cfg.served_model_name or engine.model_name     # the served name: its streams
        self.explicit_id = bool(cfg.engine_id)
        self.engine_id = cfg.engine_id or default_engine_id()
        self.instance = uuid.uuid4().hex[:12]
        self.counters = Counters()
        self.inbox = Inbox()
        self.held = HeldRequests()
        self.recent_aborts = BoundedSet(RECENT_ABORTS_MAX)
        self.publisher = Publisher(self.engine_id)
        self.round = IoRound(self._client("round"), cfg.io_thread)
        self.requests = RequestReader(self._client("requests", blocking=True), self.inbox, cfg, self.counters,
                                      self.model)
        self.aborts = AbortReader(self._client("aborts", blocking=True), self.inbox, cfg, self.counters)
        self.control_reader = ControlReader(self._client("control", blocking=True), self.inbox, cfg, self.counters,
                                            self.model)
        self.controls = Controls(engine)
        self.heartbeat = Heartbeat(self._client("heartbeat"), self.instance, cfg.heartbeat_interval,
                                   cfg.heartbeat_ttl, cfg.loop_stall_timeout, self._static_facts())
        self.janitor = Janitor(self._client("janitor"), self.inbox, cfg, self.counters, self.model)
        self.orphans = OrphanWatch(self._client("orphans"), self.inbox, self.held, cfg.orphan_check_interval)
        self.step_stats = LatencyStats()        # engine.step() wall time
        self.round_stats = LatencyStats()       # the per-step Redis round trip (on the I/O thread)
        self.metrics = EngineMetrics(self.model, self.engine_id, self.counters)   # relabelled in _connect
        self.redis_up = True
        self._retry_at = 0.0
        self._backoff = 0.0
        self._queued = Outgoing()               # encoded, waiting for the round in flight
        self._stop_errors: dict[str, str] = {}  # request id -> error text of a deadline abort
        self._blocks_version, self._blocks_at = -1, 0.0   # the prefix-cache state last published
        self._stop = threading.Event()
        self.accepting = True
        self.started = threading.Event()
        self.exited = threading.Event()

    def _client(self, role: str, blocking: bool = False):
        """One connection per job. No client-level retries: each job handles outages itself."""
        timeout = max(2.0, min_socket_timeout_for_block(self.cfg.idle_block_ms)) if blocking else 2.0
        return redis_client(self.cfg.redis_url, retries=0, socket_connect_timeout=1.0, socket_timeout=timeout,
                            client_name=f"kaiten-engine-{role}", max_connections=4)

    def _static_facts(self) -> dict:
        e = self.engine
        return {"model": self.model, "model_path": str(self.engine_config.model), "max_model_len": int(e.max_model_len),
                "vocab_size": int(getattr(e, "vocab_size", 0)),
                "dtype": self.engine_config.dtype, "device": self.engine_config.device,
                "block_size": int(e.block_size),
                "kv_store": getattr(e, "kv", None) is not None,     # shares KV chunks through a store
                "heartbeat_interval": self.cfg.heartbeat_interval}

    # ------------------------------------------------------------------ control
    def stop(self) -> None:
        """Stop reading; after the current step, hand every request held to its gateway and exit."""
        self.accepting = self.requests.accepting = False
        self._stop.set()
        self.inbox.wake.set()

    def install_signal_handlers(self) -> None:
        def handler(signum, frame):
            log.info("%s: handing %d requests to their gateways, then stopping", signal.Signals(signum).name,
                     len(self.held))
            self.stop()
        signal.signal(signal.SIGTERM, handler)
        signal.signal(signal.SIGINT, handler)

    # ------------------------------------------------------------------ start
    def _connect(self) -> None:
        """Name the consumer, start every thread; retried while Redis is down (so a worker may
        start before Redis)."""
        delay = 0.1
        while not self._stop.is_set():
            try:
                self.engine_id = choose_engine_id(self.requests.r, self.engine_id, self.explicit_id, self.instance,
                                                  self.cfg.heartbeat_interval)
                self.publisher.engine_id = self.engine_id
                self.heartbeat.engine_id = self.engine_id
                self.metrics = EngineMetrics(self.model, self.engine_id, self.counters)
                self.heartbeat.update(self._live_stats())
                self.heartbeat.write()          # registers the name at once
                self.aborts.prepare()
                self.requests.prepare(self.engine_id)
                break
            except Exception as e:   # connection errors, a Redis still loading, ...
                log.warning("cannot start on Redis (%s: %s); retrying in %.1f s", type(e).__name__, e, delay)
                self._stop.wait(delay)
                delay = min(self.cfg.redis_retry_max, delay * 2)
        else:
            return
        self.aborts.start_thread()
        self.control_reader.start_thread()
        self.requests.start_thread()
        self.heartbeat.start(self.engine_id)
        self.janitor.start(self.engine_id)
        self.orphans.start()
        log.info("engine %s: consuming %s as %r in group %r", self.instance, self.requests.model_stream,
                 self.engine_id, names.ENGINE_GROUP)

    # ------------------------------------------------------------------ the loop
    def run(self) -> int:
        engine = self.engine
        self._connect()
        if self.startup is not None:             # serving now (or stopping): no longer starting
            self.startup.finish()
        if self._stop.is_set():
            self._shutdown()
            return 0
        self.metrics.serve(self.cfg.metrics_host, self.cfg.metrics_port)
        self.started.set()
        log.info("engine %r serving model %s (%s; max_model_len %d, %d tokens per step)", self.engine_id,
                 self.model, engine.model_name, engine.max_model_len, engine.config.max_num_batched_tokens)
        last_log = time.monotonic()
        try:
            while not self._stop.is_set():
                self._apply(self.inbox.take())
                if engine.has_unfinished():
                    t0 = time.perf_counter()
                    outputs = engine.step()
                    dt = time.perf_counter() - t0
                    self.step_stats.add(dt)
                    self.metrics.step_time.observe(dt)
                    self._route(outputs)
                    idle_work = False
                else:
                    idle_work = engine.between_steps()
                self.held.publish()
                self.inbox.set_capacity(engine.free_capacity() if self.accepting else 0)
                stats = self._live_stats()
                self.heartbeat.update(stats)
                self._publish_blocks()
                self.metrics.update(stats)
                self._flush()
                if not engine.has_unfinished() and not idle_work:
                    self.inbox.wait(0.01 if self._has_outgoing() else 0.1)
                if time.monotonic() - last_log > LOG_INTERVAL:
                    last_log = time.monotonic()
                    log.info("%s; counters %s", self.overhead_report(), self.counters)
        finally:
            self._shutdown()
        return 0

    def _publish_blocks(self) -> None:
        """Hand the heartbeat the prefix cache's block hashes when they changed, at most once per
        heartbeat interval (gateways route by them)."""
        version = self.engine.prefix_cache_version()
        now = time.monotonic()
        if version != self._blocks_version and now - self._blocks_at >= self.cfg.heartbeat_interval:
            self._blocks_version, self._blocks_at = version, now
            self.heartbeat.set_blocks(self.engine.cached_block_hashes())

    def _live_stats(self) -> dict:
        st = dataclasses.asdict(self.engine.stats())
        st["capacity"] = int(self.engine.free_capacity()) if self.accepting else 0
        st["accepting"] = self.accepting
        st["counters"] = self.counters.snapshot()
        st.update(self.controls.announce())
        return st

    # ------------------------------------------------------------------ arrivals
    def _apply(self, arrivals: Arrivals) -> None:
        for entry in arrivals.entries:
            self._admit(entry)
        for rid in arrivals.aborts:
            self._abort(rid)
        if arrivals.controls:
            self.controls.apply(arrivals.controls)
        for stop in arrivals.stops:
            if self.held.get(stop.request_id) is not None and self.engine.abort_request(stop.request_id):
                self.counters.add("stopped_" + stop.reason)
                if stop.reason in STOP_ERRORS:
                    self._stop_errors[stop.request_id] = STOP_ERRORS[stop.reason]

    def _admit(self, entry: StreamEntry) -> None:
        """Take one stream entry: into the engine, or answered/dead-lettered and deleted. Never raises."""
        pub = self.publisher
        if entry.fields is None:           # deleted while pending
            pub.done(entry.entry_id, entry.stream)
            return
        try:
            msg = decode_entry(entry, self.cfg.max_deliveries)
            rid = msg.request_id
            held = self.held.get(rid)
            if held is not None:
                if held.entry_id != entry.entry_id:
                    self._reject(entry, RejectedEntry(f"duplicate request_id {rid!r} already in progress"))
                return
            if not self.accepting or entry.taken_over:
                reason = HANDOFF_REASON.get(entry.source, "engine_lost") if self.accepting else "shutdown"
                self._hand_back(entry.entry_id, entry.stream, msg.reply_to, rid, reason)
                return
            if rid in self.recent_aborts:
                pub.done(entry.entry_id, entry.stream)
                pub.terminal(msg.reply_to, rid, "abort")
                return
            if msg.deadline is not None and time.time() > msg.deadline:
                pub.done(entry.entry_id, entry.stream)
                pub.terminal(msg.reply_to, rid, "error", "the request's deadline passed before an engine started it")
                return
            try:
                self.engine.add_request(rid, msg.prompt_token_ids, SamplingParams.from_dict(msg.params),
                                        num_generated=msg.num_generated, lora_name=msg.lora_name)
            except (ValueError, TypeError) as e:
                pub.done(entry.entry_id, entry.stream)
                pub.terminal(msg.reply_to, rid, "error", str(e))
                return
            self.held.add(HeldRequest(rid, entry.entry_id, msg.reply_to, msg.deadline, entry.stream))
            pub.admitted(msg.reply_to, rid, msg.first_seq)
            self.counters.add("requests")
            if msg.num_generated:
                self.counters.add("continuations")
        except RejectedEntry as e:
            self._reject(entry, e)
        except Exception as e:   # a bug or an input nobody foresaw must not stop the loop
            log.exception("entry %s could not be handled", entry.entry_id.decode(errors="replace"))
            rid, reply_to = salvage_ids((entry.fields or {}).get(names.PAYLOAD_FIELD))
            if rid is not None and self.held.get(rid) is not None:
                rid = reply_to = None        # already held: leave that request alone
            self._reject(entry, RejectedEntry(f"could not be handled: {type(e).__name__}: {e}", rid, reply_to))

    def _hand_back(self, entry_id: bytes, stream: str, reply_to: str, rid: str, reason: str) -> None:
        """Not ours to run: delete the entry and tell the gateway to move the request, unless it
        was aborted (the client left, or the gateway moved it already and aborted this id)."""
        self.publisher.done(entry_id, stream)
        if rid not in self.recent_aborts:
            self.publisher.handoff(reply_to, rid, reason)
        self.counters.add("handed_back")

    def _reject(self, entry: StreamEntry, e: RejectedEntry) -> None:
        log.warning("dead-lettering entry %s: %s", entry.entry_id.decode(errors="replace"), e.reason)
        self.publisher.dead_letter(dead_letter_fields(entry, e.reason, self.engine_id, e.request_id))
        self.publisher.done(entry.entry_id, entry.stream)
        self.counters.add("dead_lettered")
        if e.request_id and e.reply_to:
            self.publisher.terminal(e.reply_to, e.request_id, "error", e.reason)

    def _abort(self, rid: str) -> None:
        self.recent_aborts.add(rid)
        if self.held.get(rid) is not None and self.engine.abort_request(rid):
            self.counters.add("aborts")   # the engine freed its blocks; "abort" comes with the step

    # ------------------------------------------------------------------ outputs
    def _route(self, outputs) -> None:
        for o in outputs:
            h = self.held.get(o.request_id)
            if h is None:
                log.error("engine output for unknown request %r", o.request_id)
                continue
            if o.finish_reason is not None:
                if o.request_id in self._stop_errors:
                    o.finish_reason, o.error = "error", self._stop_errors.pop(o.request_id)
                self.held.pop(o.request_id)
                self.publisher.done(h.entry_id, h.stream)
            self.publisher.add(h.reply_to, o)

    def _flush(self, wait: float | None = 0.0) -> None:
        """Encode this step's messages (one per gateway) and send them in a round, with those of
        earlier steps whose round could not start yet (one still in flight). While Redis is down,
        deltas stay unencoded in the publisher, merged per request, until the next retry."""
        res = self.round.poll(wait)
        if res is not None:
            self._collect(res)
        if not self.redis_up and time.monotonic() < self._retry_at:
            return
        if self.publisher.has_outgoing():
            self._queued = self._queued + self.publisher.take()
        if self._queued and not self.round.in_flight():
            out, self._queued = self._queued, Outgoing()
            self.round.start(out)

    def _has_outgoing(self) -> bool:
        return self.publisher.has_outgoing() or bool(self._queued) or self.round.in_flight()

    def _collect(self, res: RoundResult) -> None:
        if res.error is not None:
            self.publisher.put_back(res.sent + self._queued)    # re-sent first, same seqs
            self._queued = Outgoing()
            self.counters.add("redis_errors")
            self._backoff = min(self.cfg.redis_retry_max, max(0.1, self._backoff * 2))
            self._retry_at = time.monotonic() + self._backoff
            if self.redis_up:
                log.warning("Redis unavailable (%s: %s); the engine keeps its in-flight work, retrying",
                            type(res.error).__name__, res.error)
            self.redis_up = False
            return
        if not self.redis_up:
            log.warning("Redis is reachable again")
            self.redis_up, self._backoff = True, 0.0
        for err in res.command_errors:
            log.warning("Redis round: %s", err)
        self.inbox.release(res.sent.done_entries)
        self.counters.add("messages", len(res.sent.messages))
        self.round_stats.add(res.rtt)
        self.metrics.round_time.observe(res.rtt)

    # ------------------------------------------------------------------ stop
    def _shutdown(self) -> None:
        self.accepting = self.requests.accepting = False
        self.requests.stop()
        # Every request held, and every entry read but not admitted, goes back to its gateway,
        # after the tokens computed so far (the publisher sends the Handoff after the batch).
        for h in self.held.all():
            self.engine.abort_request(h.request_id)
            self.held.pop(h.request_id)
            self._hand_back(h.entry_id, h.stream, h.reply_to, h.request_id, "shutdown")
        for entry in self.inbox.take().entries + self._drain_own():
            self._admit(entry)
        for _ in range(4):
            self._flush(wait=2.0)
            if not self._has_outgoing():
                break
            time.sleep(0.05)
        try:
            self.requests.delete_own_if_empty()
        except Exception as e:      # Redis down: another engine's janitor deletes it
            log.debug("could not delete the own stream: %s", e)
        for job in (self.aborts, self.control_reader, self.janitor, self.orphans):
            job.stop()
        self.heartbeat.stop(delete=self.started.is_set())
        self.round.close()
        self.metrics.close()
        if getattr(self.engine, "kv", None) is not None:
            self.engine.kv.connector.close()
        runner = getattr(self.engine, "runner", None)
        if runner is not None:
            runner.close()          # a tensor-parallel engine's other ranks
        log.info("engine %r stopped; %s", self.engine_id, self.overhead_report())
        self.exited.set()

    def _drain_own(self) -> list[StreamEntry]:
        """Entries routed to this engine and never read: handed back like the rest."""
        try:
            return self.requests.drain_own()
        except Exception as e:      # Redis down: another engine's janitor hands them back
            log.warning("could not drain the own stream: %s: %s", type(e).__name__, e)
            return []

    def overhead_report(self) -> str:
        return f"redis round trip {self.round_stats}; engine.step {self.step_stats}"
