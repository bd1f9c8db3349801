"""Engine workers for the tests that run them (no tests here): configs for the tiny model on the
CPU, an EngineWorker running in a thread of the test process, and a polling wait."""
from __future__ import annotations

import threading
import time

from shared.config import EngineConfig, WorkerConfig


def engine_config(model_dir, **kw) -> EngineConfig:
    """Eager, like the engines the conftest starts as processes (see there)."""
    base = dict(model=str(model_dir), dtype="float32", device="cpu", kv_cache_memory="4MiB", max_num_seqs=32,
                num_threads=1, enforce_eager=True)
    base.update(kw)
    return EngineConfig(**base)


def serve_flags(argv: list[str]) -> tuple[list[str], list[str], EngineConfig]:
    """What `kaiten serve ARGV` hands the engine and the gateway, and the engine's config from its share."""
    from engine_worker.cli import build_parser, configs_from_args
    from shared.launcher import build_parser as serve_parser
    from shared.up_flags import child_args
    args = serve_parser().parse_args(argv)
    engine_args = child_args(args, "engine")
    ecfg, _ = configs_from_args(build_parser().parse_args(engine_args), resolve_model=False)
    return engine_args, child_args(args, "gateway"), ecfg


def worker_config(url: str, engine_id: str, **kw) -> WorkerConfig:
    """Fast heartbeats and janitor, short Redis retries, no /metrics port; override per test file or test."""
    base = dict(redis_url=url, engine_id=engine_id, heartbeat_interval=0.2, heartbeat_ttl=3.0,
                janitor_interval=0.2, claim_idle_ms=300, idle_block_ms=20, redis_retry_max=0.5, metrics_port=0)
    base.update(kw)
    return WorkerConfig(**base)


class WorkerThread:
    """An EngineWorker running in a thread of the test process; `kw` goes to worker_config.
    Attributes it lacks (engine, counters, started...) are the worker's."""

    def __init__(self, url, model_dir, engine_id, engine_kw=None, **kw):
        from engine_worker.worker import EngineWorker
        self.worker = EngineWorker(engine_config(model_dir, **(engine_kw or {})), worker_config(url, engine_id, **kw))
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True, name=f"worker-{engine_id}")

    def __getattr__(self, name):
        return getattr(self.worker, name)

    def _run(self):
        try:
            self.worker.run()
        except BaseException as e:          # surfaced by stop()
            self.error = e
            raise

    def start(self) -> "WorkerThread":
        self.thread.start()
        assert self.worker.started.wait(60), "worker did not start"
        return self

    def stop(self) -> None:
        self.worker.stop()
        self.thread.join(15)
        assert not self.thread.is_alive(), "worker thread did not stop"
        assert self.error is None, f"worker loop raised {self.error!r}"


def e2e_worker(url, model_dir, engine_id, **kw) -> WorkerThread:
    """A worker that gateways give up on quickly (heartbeat TTL 1.5 s)."""
    return WorkerThread(url, model_dir, engine_id, **({"heartbeat_ttl": 1.5} | kw))


def wait_until(cond, timeout: float = 15.0, interval: float = 0.02, what: str = "condition"):
    """Poll `cond` until it returns a truthy value, which is returned."""
    deadline = time.monotonic() + timeout
    while True:
        v = cond()
        if v:
            return v
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


class GatewayAlive:
    """A stand-in for a gateway's liveness key: SET names.gateway_alive_key(id) with the gateway's
    TTL and refresh it every TTL/3 from a thread, until stop_refreshing() (a gateway that died:
    the key lapses within GATEWAY_ALIVE_TTL_S) or delete() (a gateway that exits cleanly)."""

    def __init__(self, url: str, gateway_id: str):
        import redis
        from shared import names
        self.r = redis.Redis.from_url(url, socket_timeout=5)
        self.redis_error = redis.RedisError
        self.key = names.gateway_alive_key(gateway_id)
        self.ttl_ms = int(names.GATEWAY_ALIVE_TTL_S * 1000)
        self._stop = threading.Event()
        self.r.set(self.key, b"1", px=self.ttl_ms)
        self.thread = threading.Thread(target=self._run, daemon=True, name=f"alive-{gateway_id}")
        self.thread.start()

    def _run(self):
        while not self._stop.wait(self.ttl_ms / 3000):
            try:
                self.r.set(self.key, b"1", px=self.ttl_ms)
            except self.redis_error:     # Redis restarting: refresh on the next tick
                pass

    def stop_refreshing(self) -> float:
        """Stop refreshing; returns time.monotonic() of the last refresh's expiry horizon start."""
        self._stop.set()
        self.thread.join(5)
        return time.monotonic()

    def delete(self) -> None:
        self.stop_refreshing()
        self.r.delete(self.key)


def wait_engine_idle(engine, timeout: float = 15.0) -> float:
    """Seconds until the engine runs nothing (no running or waiting sequence)."""
    t0 = time.monotonic()
    wait_until(lambda: not engine.scheduler.has_unfinished(), timeout, 0.01, "the engine to run nothing")
    return time.monotonic() - t0


def slow_steps(engine, seconds: float) -> None:
    """Make every step of `engine` at least `seconds` long (the tiny model is too fast for tests
    that must act while requests are still running)."""
    step = engine.step

    def slow_step():
        time.sleep(seconds)
        return step()
    engine.step = slow_step
