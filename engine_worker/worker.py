"""`kaiten engine`: one engine worker serving the Redis request stream.

    kaiten engine [--model DIR] [--redis-url URL] [--engine-id ID] [--dtype ...] [--device ...] ...

Configuration: ``EngineConfig.from_env()`` and ``WorkerConfig.from_env()`` (``KAITEN_*``,
``REDIS_URL``), then the CLI flags that were given. An empty ``--model`` means the default model
(``shared.gguf_convert.ensure_default_model()``).

The loop (``EngineWorker.run``)::

    while running:
        if the engine has work:
            outputs = engine.step()      # step() calls source.poll(); the previous round trip
            source.on_outputs(outputs)   #   runs on the I/O thread meanwhile
        source.finish_round()            # collect it (normally done already): new requests, aborts
        source.start_round(...)          # ONE Redis round trip: publish this step's tokens (one
                                         # message per gateway), XACK finished requests, heartbeat,
                                         # read aborts, XREADGROUP new requests (non-blocking; BLOCK
                                         # ~100 ms when the engine is idle, and then waited for)

See ``engine_worker/redis_source.py`` for the Redis side (janitor, dead letters, outages).
"""
from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import signal
import sys
import threading
import time
from typing import Any

from shared.config import EngineConfig, WorkerConfig

log = logging.getLogger("kaiten.worker")

LOG_INTERVAL = 60.0


class EngineWorker:
    """An ``LLMEngine`` driven by a ``RedisRequestSource``. ``run()`` until ``stop()``."""

    def __init__(self, engine_config: EngineConfig, worker_config: WorkerConfig, *, engine=None,
                 client=None):
        from engine_worker.redis_source import RedisRequestSource, SyncStats
        from shared.redis_conn import min_socket_timeout_for_block, redis_client

        self.engine_config = engine_config
        self.cfg = worker_config
        if client is None:
            # No client-level retries: the loop handles outages itself and must never stall long.
            client = redis_client(worker_config.redis_url, retries=0, socket_connect_timeout=1.0,
                                  socket_timeout=max(2.0, min_socket_timeout_for_block(worker_config.idle_block_ms)),
                                  client_name="kaiten-engine")
        self.redis = client
        self.source = RedisRequestSource(client, worker_config, idle_block_ms=worker_config.idle_block_ms,
                                         io_thread=worker_config.io_thread)
        if engine is None:
            from engine_worker.llm_engine import LLMEngine
            engine = LLMEngine(engine_config, source=self.source)
        else:
            engine.source = self.source
        self.engine = engine
        self.step_stats = SyncStats()       # engine.step() wall time, for comparison
        self._stop = threading.Event()
        self._drain_deadline: float | None = None
        self.started = threading.Event()
        self.exited = threading.Event()

    @property
    def engine_id(self) -> str:
        return self.source.engine_id

    # ------------------------------------------------------------------ control
    def stop(self, drain: bool = True) -> None:
        """Stop taking requests; finish in-flight ones for up to drain_timeout (if drain), then exit."""
        if drain and self._drain_deadline is None and not self._stop.is_set():
            self._drain_deadline = time.monotonic() + self.cfg.drain_timeout
            self.source.accepting = False
            log.info("draining: no new requests; %d in flight (up to %.0f s)", self.source.num_held(),
                     self.cfg.drain_timeout)
        else:
            self._stop.set()

    def install_signal_handlers(self) -> None:
        def handler(signum, frame):
            if self._drain_deadline is None:
                log.info("%s: finishing in-flight requests (again to stop at once)", signal.Signals(signum).name)
                self.stop(drain=True)
            else:
                log.info("%s again: stopping now", signal.Signals(signum).name)
                self.stop(drain=False)
        signal.signal(signal.SIGTERM, handler)
        signal.signal(signal.SIGINT, handler)

    # ------------------------------------------------------------------ heartbeat facts
    def _static_heartbeat(self) -> dict[str, Any]:
        e = self.engine
        return {"model": e.model_name, "max_model_len": int(e.max_model_len),
                "vocab_size": int(getattr(e, "vocab_size", 0)),
                "dtype": self.engine_config.dtype, "device": self.engine_config.device}

    def _stats(self):
        st = self.engine.stats()
        self.source.heartbeat_fields["capacity"] = max(0, int(self.engine.free_capacity()) - len(self.source))
        return st

    # ------------------------------------------------------------------ the loop
    def _connect(self) -> None:
        """Start the source, retrying while Redis is down (so a worker may start before Redis)."""
        delay = 0.1
        while not self._stop.is_set():
            try:
                self.source.start()
                return
            except Exception as e:   # connection errors, a Redis still loading, ...
                log.warning("cannot start on Redis (%s: %s); retrying in %.1f s", type(e).__name__, e, delay)
                self._stop.wait(delay)
                delay = min(self.cfg.redis_retry_max, delay * 2)

    def run(self) -> int:
        src, engine = self.source, self.engine
        src.heartbeat_fields.update(self._static_heartbeat())
        self._connect()
        if self._stop.is_set():
            return 0
        try:
            src.write_heartbeat(self._stats())
        except Exception as e:
            log.warning("heartbeat failed: %s", e)
        self.started.set()
        log.info("engine %r serving model %s (max_model_len %d)", self.engine_id, engine.model_name,
                 engine.max_model_len)
        last_log = time.monotonic()
        try:
            while not self._stop.is_set():
                if engine.has_unfinished() or src.has_buffered():
                    t0 = time.perf_counter()
                    outputs = engine.step()          # the previous round trip runs meanwhile
                    self.step_stats.add(time.perf_counter() - t0)
                    src.on_outputs(outputs)
                src.finish_round()                   # normally done already: no wait
                busy = engine.has_unfinished() or src.has_buffered()
                if self._drain_deadline is not None:
                    if src.num_held() == 0 and not src.has_outgoing():
                        break
                    if time.monotonic() > self._drain_deadline:
                        log.warning("drain timeout: %d requests still in flight", src.num_held())
                        break
                capacity = max(0, engine.free_capacity() - len(src))
                started = src.start_round(capacity, block=not busy, engine_stats=self._stats_if_due())
                if not busy:
                    if started:
                        src.finish_round()           # idle: wait for the blocking read
                        if capacity == 0:            # nothing was read, so nothing blocked
                            self._stop.wait(self.cfg.idle_block_ms / 1000)
                    else:                            # Redis down and nothing to compute
                        self._stop.wait(min(0.1, max(0.005, src.retry_delay())))
                if time.monotonic() - last_log > LOG_INTERVAL:
                    last_log = time.monotonic()
                    log.info("%s; counters %s", self.overhead_report(), src.counters)
        finally:
            self._shutdown()
        return 0

    def _stats_if_due(self):
        if time.monotonic() - self.source._last_heartbeat >= self.cfg.heartbeat_interval:
            return self._stats()
        return None

    def _shutdown(self) -> None:
        src = self.source
        try:
            src.finish_round()
            # Requests that already streamed tokens end with an error; the rest stay pending in the
            # stream for another engine (or this one, restarted) to take over.
            for rid in src.started_requests():
                src.error_request(rid, "the engine shut down")
                self.engine.abort_request(rid)
            src.accepting = False
            for _ in range(3):
                if src.sync(0, block=False) and not src.has_outgoing():
                    break
                time.sleep(0.05)
            src.delete_heartbeat()
        except Exception as e:
            log.warning("shutdown: could not reach Redis: %s", e)
        src.close()
        log.info("engine %r stopped; %s", self.engine_id, self.overhead_report())
        self.exited.set()


    def overhead_report(self) -> str:
        """Per step: the engine loop's Redis stall, the round trip on the I/O thread, the step."""
        return (f"redis stall per step {_fmt(self.source.stats.summary())}; redis round trip "
                f"{_fmt(self.source.rtt_stats.summary())}; engine.step {_fmt(self.step_stats.summary())}")


def _fmt(s: dict) -> str:
    return (f"n={s['count']} mean={s['mean_us']:.0f}us p50={s['p50_us']:.0f}us p99={s['p99_us']:.0f}us "
            f"max={s['max_us']:.0f}us")


# ---------------------------------------------------------------------- CLI
def _add_dataclass_flags(parser: argparse.ArgumentParser, cls, skip: set[str]) -> None:
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        flag = "--" + f.name.replace("_", "-")
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        if isinstance(default, bool):
            parser.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=None)
        else:
            typ = type(default) if isinstance(default, (int, float)) else str
            parser.add_argument(flag, dest=f.name, type=typ, default=None,
                                help=f"(env {cls.ENV_NAMES.get(f.name, 'KAITEN_' + f.name.upper())}, default {default!r})")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kaiten engine", description="Run one engine worker on the Redis request stream.")
    parser.add_argument("--model", default=None, help="model directory (env KAITEN_MODEL; empty: the default model)")
    parser.add_argument("--redis-url", dest="redis_url", default=None, help="Redis URL (env REDIS_URL)")
    parser.add_argument("--engine-id", dest="engine_id", default=None,
                        help="consumer name; stable per deployment (env KAITEN_ENGINE_ID; default: hostname)")
    parser.add_argument("--log-level", default=os.environ.get("KAITEN_LOG_LEVEL", "INFO"))
    parser.add_argument("--healthcheck", action="store_true",
                        help="exit 0 if this engine's heartbeat is in Redis (for container healthchecks)")
    _add_dataclass_flags(parser.add_argument_group("engine"), EngineConfig, {"model"})
    _add_dataclass_flags(parser.add_argument_group("worker"), WorkerConfig, {"redis_url", "engine_id"})
    return parser


def configs_from_args(args: argparse.Namespace, resolve_model: bool = True) -> tuple[EngineConfig, WorkerConfig]:
    kw = vars(args)
    ecfg = EngineConfig.from_env().with_overrides(**{f.name: kw.get(f.name) for f in dataclasses.fields(EngineConfig)})
    wcfg = WorkerConfig.from_env().with_overrides(**{f.name: kw.get(f.name) for f in dataclasses.fields(WorkerConfig)})
    if not ecfg.model and resolve_model:
        from shared.gguf_convert import ensure_default_model
        ecfg = ecfg.with_overrides(model=str(ensure_default_model()))
    return ecfg, wcfg


def healthcheck(wcfg: WorkerConfig) -> int:
    """0 when the heartbeat of this host's engine (or of --engine-id) is fresh in Redis.

    Containers use the lighter ``python -m shared.healthcheck engine`` (no torch import)."""
    from engine_worker.redis_source import default_engine_id
    from shared.healthcheck import engine_heartbeat
    ok, why = engine_heartbeat(wcfg.redis_url, wcfg.engine_id or default_engine_id(), wcfg.heartbeat_ttl)
    print(("healthy: " if ok else "unhealthy: ") + why, file=sys.stdout if ok else sys.stderr)
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.healthcheck:
        return healthcheck(configs_from_args(args, resolve_model=False)[1])
    ecfg, wcfg = configs_from_args(args)
    worker = EngineWorker(ecfg, wcfg)
    worker.install_signal_handlers()
    return worker.run()


if __name__ == "__main__":
    sys.exit(main())
