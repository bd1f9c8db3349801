"""`kaiten serve`'s account of the start: each engine's stages, read from Redis
(``names.starting_key``, shared/startup_stages.py) while the launcher waits for /ready, logged as
each ends ("engine 1/1: compilation took 14.2 s"), and a line when the engines serve (or serve
the eager model while they compile in the background)."""
from __future__ import annotations

import logging
import time

import msgpack

from shared import names
from shared.startup_stages import STAGE_TITLES, StartupState

log = logging.getLogger("kaiten.up")

POLL_INTERVAL_S = 0.5


class StartupWatch:
    def __init__(self, redis_url: str, engines: int):
        from shared.redis_conn import redis_client
        self._r = redis_client(redis_url, retries=0, socket_timeout=1.0, socket_connect_timeout=1.0,
                               client_name="kaiten-serve-startup")
        self.engines = engines
        self._names: dict[str, int] = {}        # key -> engine number, in the order first seen
        self._shown: dict[str, int] = {}        # key -> stages logged
        self._stage: dict[str, str] = {}        # key -> the stage last logged as begun
        self._polled = 0.0

    def poll(self) -> None:
        """Log what changed since the last poll (at most every POLL_INTERVAL_S)."""
        now = time.monotonic()
        if now - self._polled < POLL_INTERVAL_S:
            return
        self._polled = now
        try:
            keys = sorted(self._r.scan_iter(match=names.STARTING_PATTERN, count=1000))
            values = self._r.mget(keys) if keys else []
        except Exception as e:          # Redis is the launcher's own child: a hiccup, not a failure
            log.debug("cannot read the start-up stages: %s", e)
            return
        for key, raw in zip(keys, values):
            if raw is not None:
                self._show(key.decode() if isinstance(key, bytes) else str(key),
                           StartupState.from_dict(msgpack.unpackb(raw, raw=False)))

    def _show(self, key: str, state: StartupState) -> None:
        n = self._names.setdefault(key, len(self._names) + 1)
        who = "engine" if self.engines == 1 else f"engine {n}/{self.engines}"
        for name, seconds in state.done[self._shown.get(key, 0):]:
            log.info("%s: %s took %.1f s", who, STAGE_TITLES.get(name, name), seconds)
        self._shown[key] = len(state.done)
        now = state.background if state.compiling else state.stage if state.starting else ""
        if now and self._stage.get(key) != now:
            title = STAGE_TITLES.get(now, now)
            log.info("%s: %s ...", who, f"{title} in the background, serving the eager model" if state.compiling
                     else title)
        self._stage[key] = now

    def close(self) -> None:
        self.poll_now()
        self._r.close()

    def poll_now(self) -> None:
        self._polled = 0.0
        self.poll()
