"""The engine's consumer name in the group: stable per deployment, unique among live engines."""
from __future__ import annotations

import logging
import socket
import time

import msgpack
import redis

from shared import names

log = logging.getLogger("kaiten.worker")


def default_engine_id() -> str:
    return socket.gethostname() or "engine"


def read_heartbeat(r: redis.Redis, engine_id: str) -> dict | None:
    raw = r.get(names.heartbeat_key(engine_id))
    if raw is None:
        return None
    try:
        hb = msgpack.unpackb(raw, raw=False)
        return hb if isinstance(hb, dict) else {}
    except Exception:       # msgpack raises several unrelated exception types
        return {}


def live_other(r: redis.Redis, engine_id: str, instance: str, heartbeat_interval: float) -> str | None:
    """The instance of another live engine heartbeating under ``engine_id``, else None.

    A heartbeat left by a process that just died (a quick restart under the same name) is waited
    out: live means refreshed within a couple of heartbeat intervals."""
    stale_after = 2 * heartbeat_interval + 0.5
    deadline = time.monotonic() + stale_after + 0.5
    first_time = None
    while True:
        hb = read_heartbeat(r, engine_id)
        if hb is None or hb.get("instance") == instance:
            return None
        t = float(hb.get("time", 0) or 0)
        if time.time() - t > stale_after:
            return None                                  # left behind by a dead process
        if first_time is None:
            first_time = t
        elif t > first_time or time.monotonic() > deadline:
            return str(hb.get("instance", "?"))          # refreshed: a live engine
        time.sleep(min(0.2, heartbeat_interval / 2))


def choose_engine_id(r: redis.Redis, base: str, explicit: bool, instance: str, heartbeat_interval: float) -> str:
    """An explicit id is used as given (a warning if another live engine heartbeats under it). The
    default (hostname) gets a numeric suffix when a live engine already uses it, so two engines on
    one host do not share a consumer. The caller registers the name (a heartbeat) at once."""
    for n in range(1, 64):
        candidate = base if n == 1 else f"{base}-{n}"
        other = live_other(r, candidate, instance, heartbeat_interval)
        if other is None:
            return candidate
        if explicit:
            log.warning("engine id %r has a live heartbeat from another process (instance %s); "
                        "two engines sharing a consumer name may both serve its pending entries",
                        candidate, other)
            return candidate
    return f"{base}-{instance}"
