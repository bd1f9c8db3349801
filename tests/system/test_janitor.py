"""The janitor against a real Redis, without an engine: which pending entries it takes."""
from __future__ import annotations

import time

import redis

from engine_worker.inbox import Inbox
from engine_worker.janitor import Janitor
from engine_worker.stream_reader import read_entries
from engine_worker.worker_stats import Counters
from shared import names
from shared.config import WorkerConfig

MODEL = "janitor-model"
STREAM = names.request_stream(MODEL)
ENGINE = "janitor-me"


def test_an_entry_in_hand_is_not_claimed_until_released(redis_url):
    """The loop took the entry and dead-lettered (or finished) it, but the round that deletes it
    has not run yet: the entry is still pending on this engine and idle past claim_idle_ms. The
    janitor must leave it alone, or it reaches the loop twice (two dead letters, two handoffs)."""
    r = redis.Redis.from_url(redis_url)
    for stream in (STREAM, names.engine_stream(ENGINE)):      # as the request reader prepares them
        r.xgroup_create(stream, names.ENGINE_GROUP, id="0", mkstream=True)
    entry_id = r.xadd(STREAM, {names.PAYLOAD_FIELD: b"x"})
    inbox = Inbox()
    inbox.set_capacity(8)
    inbox.put_entries(read_entries(r, ENGINE, {STREAM: ">"}, 8, None, "new"))
    assert [e.entry_id for e in inbox.take().entries] == [entry_id]      # the loop has it now

    janitor = Janitor(r, inbox, WorkerConfig(claim_idle_ms=50), Counters(), MODEL)
    janitor.engine_id = ENGINE
    time.sleep(0.2)                                  # idle > claim_idle_ms
    assert janitor.run_once() == []
    assert inbox.in_hand() == {(STREAM, entry_id)}

    # A read whose reply was lost is an orphan: pending here, never in hand.
    lost_id = r.xadd(STREAM, {names.PAYLOAD_FIELD: b"y"})
    r.xreadgroup(names.ENGINE_GROUP, ENGINE, {STREAM: ">"}, count=1)
    time.sleep(0.2)
    assert [(e.entry_id, e.source) for e in janitor.run_once()] == [(lost_id, "orphan")]

    inbox.release([(STREAM, entry_id)])              # its deletion failed: the next run re-claims it
    time.sleep(0.2)
    assert {e.entry_id for e in janitor.run_once()} == {entry_id, lost_id}
