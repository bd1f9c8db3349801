"""A starting engine's stages in Redis: a thread with its own connection SETs
``names.starting_key`` (TTL ``names.STARTING_TTL_S``) every second with the stages' snapshot,
from the process's first second until the engine serves. Then ``finish`` writes it once more,
stage SERVING, to expire a few seconds later: a reader polling less often than the last stages
passed still sees them all. An engine serving eagerly while it compiles in the background keeps
the key, SERVING with its background stage, until the compilation ends. Redis may be down or
slow: the engine's start never waits for it."""
from __future__ import annotations

import logging
import threading
import uuid

import msgpack

from shared import names
from shared.redis_conn import redis_client
from shared.startup_stages import SERVING, StartupStages

log = logging.getLogger("kaiten.worker")

INTERVAL_S = 1.0


class StartupReport:
    def __init__(self, redis_url: str, stages: StartupStages, interval: float = INTERVAL_S):
        self.stages = stages
        self.key = names.starting_key(uuid.uuid4().hex[:12])
        self.interval = interval
        self._r = redis_client(redis_url, retries=0, socket_connect_timeout=1.0, socket_timeout=2.0,
                               client_name="kaiten-engine-startup", max_connections=1)
        self._stop = threading.Event()
        self._serving = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="kaiten-startup-report")

    def start(self) -> StartupReport:
        self._thread.start()
        return self

    def write(self) -> None:
        payload = msgpack.packb(self.stages.snapshot().as_dict(), use_bin_type=True)
        self._r.set(self.key, payload, px=int(names.STARTING_TTL_S * 1000))

    def _run(self) -> None:
        while not self._stop.is_set():
            self._write_quietly()
            if self._serving.is_set() and not self.stages.snapshot().background:
                break                       # the background stage ended: its last state is written
            self._stop.wait(self.interval)
        if self._serving.is_set() and not self._stop.is_set():
            self._r.close()

    def _write_quietly(self) -> None:
        try:
            self.write()
        except Exception as e:          # Redis not up yet: the worker's own connect logs it
            log.debug("start-up report failed: %s", e)

    def finish(self) -> None:
        """The engine serves, or exits: the key's state is SERVING from now. While a stage goes on
        in the background (the compilation, the engine serving eagerly) the thread keeps the key
        until that ends; else reporting stops now. Once."""
        if self._serving.is_set():
            return
        self.stages.serving()
        self._serving.set()
        if self.stages.snapshot().background and self._thread.is_alive():
            self._write_quietly()           # SERVING at once, as below: the gateways admit requests
            return
        self.close()

    def close(self) -> None:
        """Stop reporting now (the engine exits), the last state written."""
        if self._stop.is_set():
            return
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(5)
        self._write_quietly()
        self._r.close()
