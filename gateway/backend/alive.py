"""The gateway's liveness key, refreshed by its own thread on its own connection.

Engines abort the requests of a gateway whose ``names.gateway_alive_key`` is gone (after at most
``GATEWAY_ALIVE_TTL_S``), so the refresh must not wait behind a busy event loop or a command pool
whose connections are all taken: under load either made a live gateway look dead and lose its
streams. A thread that sleeps between SETs gets the GIL within the interpreter's switch interval.
"""
from __future__ import annotations

import logging
import threading
import time

from shared import names
from shared.redis_conn import redis_client

log = logging.getLogger("kaiten.gateway")


class AliveKey:
    def __init__(self, redis_url: str, gateway_id: str):
        self.key = names.gateway_alive_key(gateway_id)
        self.value = gateway_id
        ttl = names.GATEWAY_ALIVE_TTL_S
        self.r = redis_client(redis_url, socket_timeout=ttl / 3, socket_connect_timeout=ttl / 3, retries=0,
                              client_name=f"kaiten-gateway-alive-{gateway_id}")
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def set(self) -> bool:
        try:
            self.r.set(self.key, self.value, px=int(names.GATEWAY_ALIVE_TTL_S * 1000))
            return True
        except Exception as e:      # Redis down: the next submission's pipeline sets it again
            log.debug("liveness key: %s: %s", type(e).__name__, e)
            return False

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, daemon=True, name="kaiten-gateway-alive")
        self._thread.start()

    def _run(self) -> None:
        """Every third of the TTL; a failed SET is retried sooner."""
        period = names.GATEWAY_ALIVE_TTL_S / 3
        ok = True
        while not self._stop.wait(period if ok else period / 4):
            ok = self.set()

    def stop_refreshing(self) -> None:
        """Stop the thread (the key then expires within the TTL unless deleted)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(2.0)

    def stop(self, wait_s: float = 2.0) -> None:
        """Stop refreshing and delete the key, on this connection, after the thread's last SET (engines
        then abort this gateway's requests at once); retried for up to wait_s, then it expires."""
        self.stop_refreshing()
        deadline = time.monotonic() + wait_s
        while True:
            try:
                self.r.delete(self.key)
                break
            except Exception as e:
                if time.monotonic() >= deadline:
                    log.warning("liveness key not deleted (it expires within %.1f s): %s: %s",
                                names.GATEWAY_ALIVE_TTL_S, type(e).__name__, e)
                    break
                time.sleep(0.1)
        self.r.close()
