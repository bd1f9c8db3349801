"""The orphan watch's verdict on a gateway whose liveness key is missing (real Redis): at once
while Redis has been fine; after a Redis error (a restart, a Sentinel promotion that may lose the
gateway's last SET), only once the key stayed missing for GATEWAY_ALIVE_TTL_S."""
from __future__ import annotations

import time

import redis

from engine_worker.held import HeldRequest, HeldRequests
from engine_worker.inbox import Inbox
from engine_worker.orphan_watch import OrphanWatch
from shared import names


def watch(url: str) -> tuple[OrphanWatch, redis.Redis]:
    r = redis.Redis.from_url(url)
    held = HeldRequests()
    held.add(HeldRequest("req-1", b"1-0", "gw-x", None, "s"))
    held.publish()
    return OrphanWatch(r, Inbox(), held, 0.05), r


def test_missing_key_stops_at_once_while_redis_was_fine(redis_url):
    w, r = watch(redis_url)
    r.delete(names.gateway_alive_key("gw-x"))
    assert [s.request_id for s in w.check()] == ["req-1"]


def test_after_a_redis_error_a_missing_key_gets_the_gateways_ttl(redis_url):
    w, r = watch(redis_url)
    r.delete(names.gateway_alive_key("gw-x"))
    w._error_at = time.monotonic()                  # what _run records on a failed check
    assert w.check() == []                          # missing, but the gateway may just not have re-set it
    r.set(names.gateway_alive_key("gw-x"), "gw-x")  # ... and it does: nothing is stopped
    assert w.check() == []
    r.delete(names.gateway_alive_key("gw-x"))       # gone for good this time
    t0 = time.monotonic()
    while not (stops := w.check()):
        assert time.monotonic() - t0 < names.GATEWAY_ALIVE_TTL_S + 1.0
        time.sleep(0.05)
    assert [s.request_id for s in stops] == ["req-1"] and time.monotonic() - t0 >= names.GATEWAY_ALIVE_TTL_S
