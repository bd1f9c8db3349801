"""Engine liveness and load, from the engines' heartbeat keys and the request streams' backlog.

One poll task per gateway (``EngineMonitor.run``) reads every ``kaiten:engine:*`` key and the
consumer group's lag on each model's stream, and each engine's prefix-cache block list (``names.blocks_key``) when the
heartbeat's ``blocks_version`` moved (a restarted engine, a new ``instance``, starts empty). An engine is alive while its heartbeat keeps changing: ``last_alive`` is the
gateway's clock when a new heartbeat (or a token delta from that engine) was last seen, so clock
skew between hosts does not matter.

Each poll groups the engines by the model their heartbeat announces (``views``: a ``ModelView``
per model, with its live engines, load, adapters and backlog), so what a request reads of its
model's engines costs the same however many models the deployment serves.
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import msgpack
import redis

from shared import names
from shared.block_index import unpack_blocks
from shared.startup_stages import StartupState

log = logging.getLogger("kaiten.gateway")


@dataclass(slots=True)
class EngineInfo:
    engine_id: str
    heartbeat: dict[str, Any] = field(default_factory=dict)
    last_alive: float = 0.0          # time.monotonic() of the latest sign of life
    hb_time: Any = None              # the heartbeat's own "time" field, to see it change
    blocks: frozenset[int] = frozenset()   # prefix-cache block hashes it held at blocks_version
    blocks_version: Any = None       # (instance, version) of `blocks`
    blocks_seen: float = 0.0         # time.monotonic() when `blocks` was read

    def get(self, key: str, default: Any = 0) -> Any:
        v = self.heartbeat.get(key, default)
        return default if v is None else v


@dataclass(slots=True)
class Backlog:
    """Entries in the request stream that no engine has read yet."""
    lag: int = 0
    group_exists: bool = True
    time: float = 0.0                # time.monotonic() of the reading


@dataclass(slots=True)
class ModelView:
    """One model's engines as of the latest poll: those whose heartbeat announces it."""
    engines: list[EngineInfo] = field(default_factory=list)      # live or not
    live: list[EngineInfo] = field(default_factory=list)         # heartbeat within engine_timeout
    load: dict[str, float] = field(default_factory=dict)         # load_of(live, backlog)
    adapters: dict[str, str] = field(default_factory=dict)       # LoRA adapters of the live engines
    backlog: Backlog = field(default_factory=Backlog)
    last_alive: float = 0.0                                      # latest sign of life of any of them


def load_of(live: list[EngineInfo], backlog: int) -> dict[str, float]:
    n = len(live)
    return {
        "engines": n,
        "num_running": sum(int(e.get("num_running")) for e in live),
        "num_waiting": sum(int(e.get("num_waiting")) for e in live),
        "num_waiting_tokens": sum(int(e.get("num_waiting_tokens")) for e in live),
        "kv_cache_usage": (sum(float(e.get("kv_cache_usage", 0.0)) for e in live) / n) if n else 0.0,
        "prefix_cache_hit_rate": (sum(float(e.get("prefix_cache_hit_rate", 0.0)) for e in live) / n) if n else 0.0,
        "backlog": backlog,
    }


EMPTY_VIEW = ModelView()


def _group_lag(groups: Any) -> int | None:
    """The engines' group's lag from an XINFO GROUPS reply (None: no such stream or group)."""
    if isinstance(groups, Exception):
        if isinstance(groups, redis.ResponseError):
            return None
        raise groups
    for g in groups:
        name = g.get("name")
        name = name.decode() if isinstance(name, bytes) else name
        if name != names.ENGINE_GROUP:
            continue
        lag = g.get("lag")
        if lag is None:                   # Redis cannot tell (entries deleted): estimate
            added, read = g.get("entries-added"), g.get("entries-read")
            lag = (int(added) - int(read)) if added is not None and read is not None else 0
        return max(0, int(lag))
    return None


STARTING_POLL_S = 0.05


class EngineMonitor:
    def __init__(self, client, engine_timeout: float, poll_interval: float | None = None):
        self.r = client
        self.engine_timeout = engine_timeout
        self.poll_interval = poll_interval if poll_interval is not None else max(0.05, min(0.5, engine_timeout / 4))
        self.engines: dict[str, EngineInfo] = {}
        self.backlog = Backlog()                 # of every model's stream together
        self.views: dict[str, ModelView] = {}    # model (as announced) -> its engines, at the last poll
        self.starting: list[StartupState] = []   # engines not serving yet, or compiling (names.starting_key), at the last poll
        self.watched: set[str] = set()           # models whose stream backlog is read with no engine up
        self.last_poll_ok: float = 0.0           # monotonic time of the last successful poll
        self.redis_ok = False
        self.started = time.monotonic()
        self.polled = asyncio.Event()            # set after the first successful poll
        self.on_poll = []                        # callbacks after each successful poll

    # ------------------------------------------------------------------ liveness
    def touch(self, engine_id: str) -> None:
        """A token delta from this engine: it is alive now."""
        info = self.engines.get(engine_id)
        if info is None:
            info = self.engines[engine_id] = EngineInfo(engine_id)
        info.last_alive = time.monotonic()

    def is_alive(self, engine_id: str, now: float | None = None, timeout: float | None = None) -> bool:
        """A sign of life within `timeout` (default engine_timeout) seconds."""
        info = self.engines.get(engine_id)
        if info is None:
            return False
        now = time.monotonic() if now is None else now
        return now - info.last_alive <= (self.engine_timeout if timeout is None else timeout)

    def live_engines(self, now: float | None = None, timeout: float | None = None) -> list[EngineInfo]:
        """Engines with a sign of life within `timeout` (default engine_timeout) seconds."""
        now = time.monotonic() if now is None else now
        timeout = self.engine_timeout if timeout is None else timeout
        return [e for e in self.engines.values() if e.heartbeat and now - e.last_alive <= timeout]

    def last_any_alive(self) -> float:
        """Monotonic time of the latest sign of life of any engine (the monitor's start if none)."""
        return max([e.last_alive for e in self.engines.values()] + [0.0])

    def view(self, model: str) -> ModelView:
        return self.views.get(model, EMPTY_VIEW)

    def starting_for(self, model: str) -> list[StartupState]:
        """The starting engines of `model`, or of a model not known yet (one converting)."""
        return [s for s in self.starting if s.starting and s.model in (model, "")]

    def compiling_for(self, model: str) -> list[StartupState]:
        """The engines of `model` serving the eager model while they compile in the background."""
        return [s for s in self.starting if s.compiling and s.model == model]

    def load(self) -> dict[str, float]:
        """Every engine's load together (all models)."""
        return load_of(self.live_engines(), self.backlog.lag)

    # ------------------------------------------------------------------ polling
    async def poll_once(self) -> None:
        keys = [k async for k in self.r.scan_iter(match=names.HEARTBEAT_PATTERN, count=1000)]
        values = await self.r.mget(keys) if keys else []
        now = time.monotonic()
        prefix = names.heartbeat_key("")
        for key, raw in zip(keys, values):
            if raw is None:
                continue
            key_s = key.decode() if isinstance(key, bytes) else str(key)
            try:
                hb = msgpack.unpackb(raw, raw=False)
            except Exception:
                continue
            if not isinstance(hb, dict):
                continue
            engine_id = str(hb.get("engine_id") or key_s[len(prefix):])
            info = self.engines.get(engine_id)
            if info is None:
                info = self.engines[engine_id] = EngineInfo(engine_id)
            hb_time = hb.get("time")
            if hb_time is None or hb_time != info.hb_time or not info.heartbeat:
                info.last_alive = now
            info.hb_time = hb_time
            if hb.get("instance") != info.heartbeat.get("instance"):
                info.blocks, info.blocks_version = frozenset(), None     # restarted: holds nothing
            info.heartbeat = hb
        # Forget engines silent for a long time.
        for eid in [eid for eid, e in self.engines.items() if now - e.last_alive > max(60.0, 6 * self.engine_timeout)]:
            del self.engines[eid]
        await self._poll_blocks(now)
        await self._poll_starting()
        views = self._group(now)
        await self._poll_backlog(views, now)
        self.views = views
        self.last_poll_ok = now
        self.redis_ok = True
        self.polled.set()
        for cb in self.on_poll:
            cb(self)

    async def _poll_blocks(self, now: float) -> None:
        """Read the block lists whose version the heartbeats say moved."""
        stale = [e for e in self.engines.values() if e.heartbeat.get("blocks_version")
                 and e.blocks_version != (e.heartbeat.get("instance"), e.heartbeat.get("blocks_version"))]
        if not stale:
            return
        values = await self.r.mget([names.blocks_key(e.engine_id) for e in stale])
        for info, raw in zip(stale, values):
            try:
                version, hashes = unpack_blocks(raw)
            except (ValueError, TypeError):       # expired, or not (yet) written
                continue
            info.blocks, info.blocks_seen = hashes, now
            info.blocks_version = (info.heartbeat.get("instance"), version)

    async def _poll_starting(self) -> None:
        keys = [k async for k in self.r.scan_iter(match=names.STARTING_PATTERN, count=1000)]
        starting = []
        for raw in (await self.r.mget(keys) if keys else []):
            try:
                starting.append(StartupState.from_dict(msgpack.unpackb(raw, raw=False)))
            except Exception:           # expired meanwhile, or not a state
                continue
        self.starting = starting

    def _group(self, now: float) -> dict[str, ModelView]:
        views: dict[str, ModelView] = {}
        for e in self.engines.values():
            model = e.heartbeat.get("model")
            if not isinstance(model, str) or not model:
                continue
            v = views.setdefault(model, ModelView())
            v.engines.append(e)
            v.last_alive = max(v.last_alive, e.last_alive)
            if e.heartbeat and now - e.last_alive <= self.engine_timeout:
                v.live.append(e)
                adapters = e.heartbeat.get("adapters")
                if isinstance(adapters, dict):
                    v.adapters.update(adapters)
        return views

    async def _poll_backlog(self, views: dict[str, ModelView], now: float) -> None:
        """Each model stream's lag, in one pipeline."""
        models = sorted(set(views) | self.watched)
        pipe = self.r.pipeline(transaction=False)
        for model in models:
            pipe.xinfo_groups(names.request_stream(model))
        replies = await pipe.execute(raise_on_error=False) if models else []
        total = 0
        for model, groups in zip(models, replies):
            lag = _group_lag(groups)
            if lag is None:               # no stream or no group yet (or Redis restarted empty)
                stream = names.request_stream(model)
                await self.ensure_group(stream)
                lag = int(await self.r.xlen(stream))
            total += lag
            view = views.setdefault(model, ModelView())
            view.backlog = Backlog(lag=lag, group_exists=True, time=now)
            view.load = load_of(view.live, lag)
        self.backlog = Backlog(lag=total, group_exists=True, time=now)

    async def ensure_group(self, stream: str) -> None:
        """Create the engines' consumer group at the stream's start, so nothing XADDed before an
        engine starts (or after Redis restarted empty) is skipped. Idempotent."""
        try:
            await self.r.xgroup_create(stream, names.ENGINE_GROUP, id="0", mkstream=True)
        except redis.ResponseError as e:
            if "BUSYGROUP" not in str(e):
                raise

    async def run(self) -> None:
        backoff = self.poll_interval
        while True:
            try:
                await self.poll_once()
                # Until an engine is live, poll faster: /ready (and a start-up's wait for it) sees
                # the first one within STARTING_POLL_S of its first heartbeat.
                backoff = self.poll_interval if self.live_engines() else min(self.poll_interval, STARTING_POLL_S)
            except asyncio.CancelledError:
                raise
            except Exception as e:
                if self.redis_ok:
                    log.warning("engine monitor: cannot read heartbeats (%s: %s)", type(e).__name__, e)
                self.redis_ok = False
                backoff = min(2.0, max(self.poll_interval, backoff * 2))
            await asyncio.sleep(backoff)
