"""The engine's heartbeat: its own thread and Redis connection, written every heartbeat_interval
however long a step takes. The loop ``update()``s a stats snapshot each step; the thread SETs
``names.heartbeat_key`` (TTL heartbeat_ttl) with the snapshot, the time and this process's
instance. A loop that has not come round for ``loop_stall_timeout`` (wedged) is no longer vouched
for: the key lapses, gateways fail its requests and the janitors of other engines claim them.

The prefix cache's block hashes go beside it, in ``names.blocks_key`` with the same TTL: rewritten
when the loop ``set_blocks()`` a new list, else only kept alive. The heartbeat's ``blocks_version``
names the list (``shared.block_index.pack_blocks``), so a gateway reads it only when it changed."""
from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any

import msgpack
import redis

from shared import names
from shared.block_index import pack_blocks

log = logging.getLogger("kaiten.worker")


class Heartbeat:
    def __init__(self, client: redis.Redis, instance: str, interval: float, ttl: float,
                 loop_stall_timeout: float, static: dict[str, Any]):
        self.r = client
        self.instance = instance
        self.interval, self.ttl, self.loop_stall_timeout = interval, ttl, loop_stall_timeout
        self.engine_id = ""
        self._fields: dict[str, Any] = dict(static)
        self._loop_time = time.monotonic()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._blocks_lock = threading.Lock()
        self._blocks: bytes | None = None          # packed by the loop, not written yet
        self._blocks_made = 0                      # versions packed by the loop
        self._blocks_version = 0                   # the version in Redis (or going there now)
        self.last_write = 0.0               # time.monotonic() of the last successful SET

    def update(self, fields: dict[str, Any]) -> None:
        """(loop) The latest stats; also says that the loop is coming round."""
        self._fields = {**self._fields, **fields}
        self._loop_time = time.monotonic()

    def set_blocks(self, hashes: list[int]) -> None:
        """(loop) The block hashes the prefix cache holds now."""
        with self._blocks_lock:
            self._blocks_made += 1
            self._blocks = pack_blocks(self._blocks_made, hashes)

    def payload(self) -> bytes:
        return msgpack.packb({**self._fields, "engine_id": self.engine_id, "instance": self.instance,
                              "pid": os.getpid(), "time": time.time(), "blocks_version": self._blocks_version},
                             use_bin_type=True)

    def write(self) -> None:
        ttl_ms = int(self.ttl * 1000)
        with self._blocks_lock:
            blocks, version = self._blocks, self._blocks_made
        p = self.r.pipeline(transaction=False)
        if blocks is not None:          # before the heartbeat that names its version
            p.set(names.blocks_key(self.engine_id), blocks, px=ttl_ms)
            self._blocks_version = version
        else:
            p.pexpire(names.blocks_key(self.engine_id), ttl_ms)
        p.set(names.heartbeat_key(self.engine_id), self.payload(), px=ttl_ms)
        p.execute()
        with self._blocks_lock:
            if self._blocks is blocks:
                self._blocks = None     # written (else a newer list waits for the next write)
        self.last_write = time.monotonic()

    def start(self, engine_id: str) -> None:
        self.engine_id = engine_id
        self._thread = threading.Thread(target=self._run, daemon=True, name="kaiten-heartbeat")
        self._thread.start()

    def _run(self) -> None:
        stalled = False
        while not self._stop.is_set():
            silent = time.monotonic() - self._loop_time
            if silent > self.loop_stall_timeout:
                if not stalled:
                    log.error("the engine loop has not come round for %.0f s: heartbeat withheld", silent)
                stalled = True
            else:
                stalled = False
                try:
                    self.write()
                except Exception as e:      # Redis down: the readers and the round log it too
                    log.debug("heartbeat failed: %s", e)
            self._stop.wait(self.interval)

    def stop(self, delete: bool = True) -> None:
        """Stop the thread; delete the key (a clean exit: gateways notice at once)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
        if delete and self.engine_id:
            try:
                self.r.delete(names.heartbeat_key(self.engine_id), names.blocks_key(self.engine_id))
            except Exception as e:
                log.warning("could not delete the heartbeat: %s", e)
