"""The engine worker against a real Redis and the tiny model (fp32, CPU).

Each test acts as a gateway itself: it subscribes to its reply channel BEFORE it XADDs, then reads
the TokenBatch messages the worker publishes. Workers run in threads (one subprocess test covers
the CLI and SIGTERM).
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import msgpack
import pytest
import redis

from shared import names, protocol
from shared.config import WorkerConfig
from tests.support.engine_support import GatewayAlive, WorkerThread, slow_steps, wait_engine_idle, wait_until
from tests.support.paths import ROOT

pytestmark = pytest.mark.timeout(120)

PROMPTS = [[1, 10, 20, 30], [1, 50, 60], [1, 100, 101, 102, 103, 104], [1, 7]]


# ---------------------------------------------------------------------- helpers
class FakeGateway:
    """Keeps its liveness key and subscribes to its reply channel on creation, as a gateway does;
    XADDs requests and aborts; reads TokenBatches."""

    def __init__(self, url: str, gateway_id: str):
        self.r = redis.Redis.from_url(url, socket_timeout=5)
        self.id = gateway_id
        self.alive = GatewayAlive(url, gateway_id)
        self.messages: list[protocol.TokenBatch] = []
        self.deltas: dict[str, list[protocol.Delta]] = {}
        self.handoffs: dict[str, str] = {}          # request id -> reason
        self.subscribe()

    def subscribe(self) -> None:
        self.ps = self.r.pubsub()
        self.ps.subscribe(names.reply_channel(self.id))
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:           # wait for the server's confirmation
            m = self.ps.get_message(timeout=1.0)
            if m and m["type"] == "subscribe":
                return
        raise AssertionError("no subscribe confirmation")

    def submit(self, rid: str, prompt: list[int], deadline: float | None = None, **params) -> bytes:
        params.setdefault("temperature", 0)
        msg = protocol.GenerateRequest(rid, self.id, list(prompt), params, arrival_time=time.time(),
                                       deadline=deadline)
        return self.r.xadd(STREAM, {names.PAYLOAD_FIELD: protocol.encode(msg)})

    def abort(self, rid: str) -> None:
        self.r.xadd(names.ABORT_STREAM, {names.PAYLOAD_FIELD: protocol.encode(protocol.Abort(rid, self.id))})

    def pump(self, timeout: float = 0.2) -> protocol.TokenBatch | None:
        m = self.ps.get_message(timeout=timeout)
        if not m or m["type"] != "message":
            return None
        batch = protocol.decode(m["data"])
        if isinstance(batch, protocol.Handoff):
            self.handoffs.update((rid, batch.reason) for rid in batch.request_ids)
            return batch
        assert isinstance(batch, protocol.TokenBatch)
        self.messages.append(batch)
        for d in batch.deltas:
            self.deltas.setdefault(d.request_id, []).append(d)
        return batch

    def finished(self, rid: str) -> bool:
        """A terminal delta, or a Handoff (the engine gave the request back)."""
        return rid in self.handoffs or any(d.finish_reason is not None for d in self.deltas.get(rid, []))

    def wait(self, rids, timeout: float = 30.0, what=None) -> dict[str, list[protocol.Delta]]:
        deadline = time.monotonic() + timeout
        while not all(self.finished(r) for r in rids):
            if time.monotonic() > deadline:
                missing = [r for r in rids if not self.finished(r)]
                raise AssertionError(f"no terminal delta for {missing}; got {list(self.deltas)}")
            self.pump()
        return {r: self.deltas.get(r, []) for r in rids}

    def tokens(self, rid: str) -> list[int]:
        return [t for d in self.deltas[rid] for t in d.token_ids]

    def terminal(self, rid: str) -> protocol.Delta:
        return next(d for d in self.deltas[rid] if d.finish_reason is not None)


def assert_contiguous(deltas: list[protocol.Delta]) -> None:
    assert [d.seq for d in deltas] == list(range(len(deltas))), [d.seq for d in deltas]
    assert deltas[-1].finish_reason is not None
    assert all(d.finish_reason is None for d in deltas[:-1])


MODEL = "tiny"                              # the workers' served name
STREAM = names.request_stream(MODEL)        # the stream they read


@pytest.fixture
def start_worker(redis_url, tiny_model_dir):
    workers: list[WorkerThread] = []

    def start(engine_id: str = "e1", url: str | None = None, engine_kw: dict | None = None, **kw) -> WorkerThread:
        kw.setdefault("served_model_name", MODEL)
        w = WorkerThread(url or redis_url, tiny_model_dir, engine_id, engine_kw=engine_kw, **kw).start()
        workers.append(w)
        return w

    yield start
    for w in workers:
        w.stop()


@pytest.fixture(scope="module")
def offline_reference(tiny_model_dir):
    from engine_worker import LLM, SamplingParams
    llm = LLM(str(tiny_model_dir), dtype="float32", kv_cache_memory="4MiB")
    outs = llm.generate([list(p) for p in PROMPTS], SamplingParams(temperature=0, max_tokens=12))
    return [o.token_ids for o in outs]


def dead_letters(r: redis.Redis) -> list[dict]:
    return [fields for _, fields in r.xrange(names.DEAD_LETTER_STREAM)]


def pending_count(r: redis.Redis) -> int:
    return r.xpending(STREAM, names.ENGINE_GROUP)["pending"]


# ---------------------------------------------------------------------- tests
def test_tokens_equal_offline_greedy(redis_url, start_worker, offline_reference):
    gw = FakeGateway(redis_url, "gw-a")
    w = start_worker()
    for i, p in enumerate(PROMPTS):
        gw.submit(f"req-{i}", p, max_tokens=12)
    got = gw.wait([f"req-{i}" for i in range(len(PROMPTS))])
    for i, ref in enumerate(offline_reference):
        rid = f"req-{i}"
        assert_contiguous(got[rid])
        assert gw.tokens(rid) == ref, rid
        last = gw.terminal(rid)
        assert last.finish_reason in ("stop", "length")
        assert last.num_prompt_tokens == len(PROMPTS[i])
        assert last.num_output_tokens == len(ref)
        assert last.metrics and {"queued", "first_token", "finished"} <= set(last.metrics)
        assert all(b.engine_id == w.engine_id for b in gw.messages)
    # Every finished request was XACKed.
    wait_until(lambda: pending_count(gw.r) == 0, what="XACK of finished requests")
    s = w.round_stats.summary()
    assert s["count"] > 0
    print(f"\nredis round trip per step (tiny model, CPU): {s}")


def test_one_message_per_gateway_per_step(redis_url, start_worker):
    gws = {g: FakeGateway(redis_url, g) for g in ("gw-1", "gw-2")}
    n_tokens = 10
    # Queue all six before the worker starts: they are read in one XREADGROUP and admitted in one
    # step, so every step produces a delta for each of them.
    for g, gw in gws.items():
        for i in range(3):
            gw.submit(f"{g}-r{i}", PROMPTS[i], max_tokens=n_tokens, ignore_eos=True)
    w = start_worker()
    for g, gw in gws.items():
        got = gw.wait([f"{g}-r{i}" for i in range(3)])
        for rid, deltas in got.items():
            assert_contiguous(deltas)
            assert len(gw.tokens(rid)) == n_tokens
        # One message per step for this gateway, each with one delta per request of the gateway.
        assert len(gw.messages) == n_tokens, [len(m.deltas) for m in gw.messages]
        for m in gw.messages:
            assert sorted(d.request_id for d in m.deltas) == [f"{g}-r{i}" for i in range(3)]
    assert w.engine.stats().step_count == n_tokens


def test_abort_frees_blocks_within_one_step(redis_url, start_worker):
    gw = FakeGateway(redis_url, "gw-abort")
    w = start_worker()
    events = {}
    worker, engine = w.worker, w.engine
    orig_abort, orig_route = worker._abort, worker._route

    def spy_abort(rid):
        events.setdefault("abort_read_at_step", engine.step_count)
        return orig_abort(rid)

    def spy_route(outputs):
        for o in outputs:
            if o.request_id == "long" and o.finish_reason == "abort":
                st = engine.stats()
                events["abort_output_at_step"] = engine.step_count
                events["stats"] = st
        return orig_route(outputs)

    worker._abort, worker._route = spy_abort, spy_route
    gw.submit("long", PROMPTS[2], max_tokens=400, ignore_eos=True)
    wait_until(lambda: gw.pump(0.05) is not None and gw.deltas.get("long"), what="first delta")
    assert engine.stats().num_free_blocks < engine.stats().num_blocks
    gw.abort("long")
    got = gw.wait(["long"])
    assert_contiguous(got["long"])
    assert gw.terminal("long").finish_reason == "abort"
    assert len(gw.tokens("long")) < 400
    assert events["abort_output_at_step"] - events["abort_read_at_step"] <= 1
    st = events["stats"]
    assert st.num_running == 0 and st.num_free_blocks == st.num_blocks, st
    wait_until(lambda: pending_count(gw.r) == 0, what="XACK of the aborted request")
    # An abort that arrives before its request is read: the request is never run.
    gw.abort("early")
    time.sleep(0.3)
    gw.submit("early", PROMPTS[0], max_tokens=50)
    gw.wait(["early"])
    assert gw.terminal("early").finish_reason == "abort" and gw.tokens("early") == []
    wait_until(lambda: pending_count(gw.r) == 0, what="XACK of the early-aborted request")


def test_garbage_entries_are_dead_lettered_and_worker_keeps_serving(redis_url, start_worker):
    gw = FakeGateway(redis_url, "gw-garbage")
    r = gw.r
    w = start_worker()
    pack = lambda body: msgpack.packb(body, use_bin_type=True)  # noqa: E731
    good = {"v": 1, "t": "request", "reply_to": gw.id, "prompt_token_ids": [1, 2, 3], "params": {"max_tokens": 2}}
    bad_entries = [
        ({b"m": b"\xc1\xc1 definitely not msgpack"}, None),
        ({b"m": pack([1, 2, 3])}, None),                                            # not a map
        ({b"m": pack({**good, "v": 99, "request_id": "bad-version"})}, "bad-version"),
        ({b"m": pack({**good, "request_id": "bad-types", "prompt_token_ids": ["a", "b"]})}, "bad-types"),
        ({b"m": pack({k: v for k, v in good.items() if k != "prompt_token_ids"} | {"request_id": "missing"})}, "missing"),
        ({b"m": pack({**good, "request_id": "extra", "bogus": 1})}, "extra"),      # unknown field
        ({b"other": b"no payload field"}, None),
        ({b"m": protocol.encode(protocol.Abort("x"))}, None),                      # wrong message type
        ({b"m": pack({**good, "request_id": 7})}, None),                           # unusable id
        ({b"m": pack({**good, "request_id": "bad-deadline", "deadline": "soon"})}, "bad-deadline"),
    ]
    for fields, _ in bad_entries:
        r.xadd(STREAM, fields)
    # Valid messages the engine rejects: error deltas, XACKed, not dead letters.
    gw.submit("bad-params", [1, 2, 3], temperature=-1)
    gw.submit("oov", [1, 99999])
    gw.submit("too-long", [1, 2, 3], max_tokens=10_000)
    gw.submit("fine", PROMPTS[0], max_tokens=5)
    salvaged = [rid for _, rid in bad_entries if rid]
    got = gw.wait(salvaged + ["bad-params", "oov", "too-long", "fine"])
    for rid in salvaged + ["bad-params", "oov", "too-long"]:
        (d,) = got[rid]
        assert d.seq == 0 and d.finish_reason == "error" and d.error, (rid, d)
    assert gw.terminal("fine").finish_reason == "length" and len(gw.tokens("fine")) == 5
    dead = wait_until(lambda: len(dead_letters(r)) >= len(bad_entries) and dead_letters(r), what="dead letters")
    assert len(dead) == len(bad_entries)
    for fields in dead:
        assert fields[b"error"] and fields[b"engine_id"] == b"e1" and fields[b"source_id"]
    errors = b" | ".join(f[b"error"] for f in dead)
    assert b"not msgpack" in errors and b"version" in errors and b"no 'm' field" in errors
    wait_until(lambda: pending_count(r) == 0, what="every entry XACKed")
    assert w.thread.is_alive() and w.counters["dead_lettered"] == len(bad_entries)
    # Still serving.
    gw.submit("after", PROMPTS[1], max_tokens=3)
    gw.wait(["after"])
    assert len(gw.tokens("after")) == 3


def test_pending_entries_of_an_earlier_process_are_handed_back(redis_url, start_worker):
    gw = FakeGateway(redis_url, "gw-restart")
    r = gw.r
    r.xgroup_create(STREAM, names.ENGINE_GROUP, id="0", mkstream=True)
    # A worker named "e-restart" read two entries and died before acknowledging them; "poison"
    # had already taken it down twice more (each restart re-read it): 3 deliveries so far.
    gw.submit("orphan-0", PROMPTS[0], max_tokens=12)
    gw.submit("poison", PROMPTS[1], max_tokens=12)
    r.xreadgroup(names.ENGINE_GROUP, "e-restart", {STREAM: ">"}, count=10)
    poison_id = r.xrange(STREAM)[1][0]
    r.xclaim(STREAM, names.ENGINE_GROUP, "e-restart", 0, [poison_id], retrycount=3)
    counts = {row["message_id"]: row["times_delivered"] for row in
              r.xpending_range(STREAM, names.ENGINE_GROUP, "-", "+", 10)}
    assert counts[poison_id] == 3
    w = start_worker(engine_id="e-restart", max_deliveries=3)
    gw.wait(["orphan-0", "poison"])
    # The earlier process may have streamed tokens: its gateway moves the request (failover), so
    # the restarted engine does not run it from the start.
    assert gw.handoffs == {"orphan-0": "restarted"} and "orphan-0" not in gw.deltas
    assert gw.terminal("poison").finish_reason == "error" and "delivered 4 times" in gw.terminal("poison").error
    dead = dead_letters(r)
    assert len(dead) == 1 and dead[0][b"source_id"] == poison_id
    wait_until(lambda: pending_count(r) == 0 and r.xlen(STREAM) == 0, what="XACK+XDEL of both")
    assert w.counters["handed_back"] == 1 and w.counters["requests"] == 0


def test_janitor_claims_dead_consumers_entries_and_hands_them_back(redis_url, start_worker):
    gw = FakeGateway(redis_url, "gw-janitor")
    r = gw.r
    r.xgroup_create(STREAM, names.ENGINE_GROUP, id="0", mkstream=True)
    read = lambda consumer: r.xreadgroup(names.ENGINE_GROUP, consumer, {STREAM: ">"}, count=1)  # noqa: E731
    gw.submit("stranded", PROMPTS[0], max_tokens=6)
    read("dead-1")                                   # a dead engine: no heartbeat
    gw.submit("aborted", PROMPTS[1], max_tokens=6)
    read("dead-1")
    gw.abort("aborted")
    gw.submit("too-often", PROMPTS[2], max_tokens=6)
    read("dead-2")
    too_often_id = r.xrange(STREAM)[-1][0]
    r.xclaim(STREAM, names.ENGINE_GROUP, "dead-2", 0, [too_often_id], retrycount=3)
    gw.submit("alive-owned", PROMPTS[3], max_tokens=6)
    read("alive-1")                                  # a live engine (heartbeat) working on it
    r.set(names.heartbeat_key("alive-1"), msgpack.packb({"engine_id": "alive-1"}), px=60_000)
    time.sleep(0.4)                                  # all idle > claim_idle_ms (300 ms)

    w = start_worker(engine_id="janitor-e", claim_idle_ms=300, max_deliveries=3)
    gw.wait(["stranded", "too-often"], timeout=30)
    # Not run here: its gateway owns the failover (the dead engine may have streamed tokens).
    assert gw.handoffs["stranded"] == "engine_lost" and "stranded" not in gw.deltas
    assert gw.terminal("too-often").finish_reason == "error"
    assert "delivered 4 times" in gw.terminal("too-often").error
    wait_until(lambda: {row["consumer"] for row in
                        r.xpending_range(STREAM, names.ENGINE_GROUP, "-", "+", 10)} == {b"alive-1"},
               what="every dead consumer's entry handled")
    time.sleep(1.0)                                  # several more janitor runs
    rows = r.xpending_range(STREAM, names.ENGINE_GROUP, "-", "+", 10)
    assert [row["consumer"] for row in rows] == [b"alive-1"], "a live engine's entry was claimed"
    assert "aborted" not in gw.deltas and "aborted" not in gw.handoffs   # aborted: dropped silently
    assert [f[b"source_id"] for f in dead_letters(r)] == [too_often_id]
    assert w.counters["claimed"] == 3 and w.counters["requests"] == 0
    assert w.counters["handed_back"] == 2


def test_nogroup_recovery_and_redis_outage(tiny_model_dir, start_worker):
    from tests.support.redis_server import RedisServer
    server = RedisServer().start()
    try:
        url = server.url
        gw = FakeGateway(url, "gw-outage")
        # Reconnect backoff 0.1, 0.2, 0.4, 0.8, 1.6 s: retries ~0.1, 0.3, 0.7, 1.5 and 3.1 s into the
        # outage. Redis comes back at ~1.6 s, so the gateway resubscribes well before the worker
        # reconnects and publishes what it held back.
        w = start_worker(engine_id="e-outage", url=url, redis_retry_max=3.0)
        gw.submit("before", PROMPTS[0], max_tokens=4)
        gw.wait(["before"])

        # Redis goes away in the middle of a generation and comes back empty.
        gw.submit("through", PROMPTS[2], max_tokens=200, ignore_eos=True)
        wait_until(lambda: gw.pump(0.05) is not None and gw.deltas.get("through"), what="first delta")
        server.stop()
        time.sleep(1.6)
        assert w.thread.is_alive() and not w.redis_up
        server.start()
        gw = FakeGateway(url, "gw-outage")            # the gateway reconnects and resubscribes
        wait_until(lambda: not w.engine.has_unfinished(), timeout=60, what="in-flight work to finish")
        assert w.counters["redis_errors"] > 0
        gw.wait(["through"], timeout=30)
        assert gw.terminal("through").num_output_tokens == 200   # the engine kept its work

        # The group is gone (NOGROUP): the worker recreates it and serves new requests.
        gw.submit("after", PROMPTS[1], max_tokens=4)
        gw.wait(["after"], timeout=20)
        assert_contiguous(gw.deltas["after"])
        assert w.counters["group_recreated"] >= 1
        wait_until(lambda: gw.r.exists(names.heartbeat_key("e-outage")), what="heartbeat after the restart")
    finally:
        server.stop()


def test_heartbeat_contents(redis_url, start_worker, tiny_model_dir):
    r = redis.Redis.from_url(redis_url)
    w = start_worker(engine_id="hb-1", heartbeat_ttl=2.0)
    raw = wait_until(lambda: r.get(names.heartbeat_key("hb-1")), what="heartbeat")
    hb = msgpack.unpackb(raw, raw=False)
    assert hb["engine_id"] == "hb-1"
    assert hb["model"] == MODEL and hb["model_path"] == str(tiny_model_dir) and hb["adapters"] == {}
    assert hb["max_model_len"] == 512
    for key in ("capacity", "num_running", "num_waiting", "num_waiting_tokens", "kv_cache_usage",
                "prefix_cache_hit_rate", "time"):
        assert key in hb, key
    assert hb["capacity"] == 32 and hb["num_running"] == 0 and hb["kv_cache_usage"] == 0.0
    assert abs(hb["time"] - time.time()) < 5
    ttl = r.pttl(names.heartbeat_key("hb-1"))
    assert 0 < ttl <= 2000
    t0 = hb["time"]
    wait_until(lambda: msgpack.unpackb(r.get(names.heartbeat_key("hb-1")), raw=False)["time"] > t0,
               what="a refreshed heartbeat")
    # A running request shows up in it.
    gw = FakeGateway(redis_url, "gw-hb")
    gw.submit("busy", PROMPTS[2], max_tokens=400, ignore_eos=True)
    busy = wait_until(lambda: (h := msgpack.unpackb(r.get(names.heartbeat_key("hb-1")), raw=False))["num_running"] == 1
                      and h, what="num_running 1")
    assert busy["kv_cache_usage"] > 0
    gw.abort("busy")
    gw.wait(["busy"])
    from engine_worker.cli import healthcheck
    assert healthcheck(WorkerConfig(redis_url=redis_url, engine_id="hb-1")) == 0
    # A clean stop deletes the key, so gateways notice at once.
    w.stop()
    w.thread.join(15)
    assert not r.exists(names.heartbeat_key("hb-1"))
    assert healthcheck(WorkerConfig(redis_url=redis_url, engine_id="hb-1")) == 1


def test_default_engine_id_is_unique_on_one_host(redis_url, start_worker):
    import socket
    r = redis.Redis.from_url(redis_url)
    # A heartbeat left by a process that just died under the default name (a quick restart) is
    # waited out, so the name stays stable; a live engine's is not.
    r.set(names.heartbeat_key(socket.gethostname()),
          msgpack.packb({"engine_id": socket.gethostname(), "instance": "dead", "time": time.time()}), px=3000)
    a = start_worker(engine_id="")
    b = start_worker(engine_id="")
    assert a.engine_id == socket.gethostname()
    assert b.engine_id == socket.gethostname() + "-2"


def test_requests_of_a_dead_gateway_are_aborted_within_2s(redis_url, start_worker):
    gw = FakeGateway(redis_url, "gw-dies")
    other = FakeGateway(redis_url, "gw-stays")
    w = start_worker(engine_id="e-orphans")
    slow_steps(w.engine, 0.01)                       # 400 tokens take > 4 s
    rids = [f"o{i}" for i in range(4)]
    for i, rid in enumerate(rids):
        gw.submit(rid, PROMPTS[i], max_tokens=400, ignore_eos=True)
    other.submit("kept", PROMPTS[0], max_tokens=500, ignore_eos=True)
    wait_until(lambda: gw.pump(0.05) is not None and all(r in gw.deltas for r in rids), what="first deltas")
    wait_until(lambda: w.engine.stats().num_running == 5, what="all five running")   # "kept" may come a step later
    gw.alive.stop_refreshing()                       # the gateway dies: its key lapses in 1.5 s
    wait_until(lambda: w.engine.stats().num_running <= 1, timeout=5, interval=0.01, what="orphans aborted")
    st = w.engine.stats()
    assert st.num_running == 1, st                   # the live gateway's request runs on
    gw.wait(rids, timeout=5)
    for rid in rids:
        assert gw.terminal(rid).finish_reason == "abort" and len(gw.tokens(rid)) < 400
    other.abort("kept")
    other.wait(["kept"], timeout=30)
    assert other.terminal("kept").finish_reason == "abort" and len(other.tokens("kept")) > 0
    assert w.counters["stopped_gateway_gone"] == 4
    wait_until(lambda: gw.r.xlen(STREAM) == 0, what="every entry deleted")
    other.alive.delete()


def test_engine_running_count_reaches_zero_within_2s_of_gateway_death(redis_url, start_worker):
    gw = FakeGateway(redis_url, "gw-killed")
    w = start_worker(engine_id="e-orphans-2")
    slow_steps(w.engine, 0.01)
    for i in range(10):
        gw.submit(f"s{i}", PROMPTS[i % 4], max_tokens=400, ignore_eos=True)
    wait_until(lambda: gw.pump(0.05) is not None and len(gw.deltas) == 10, what="10 streams")
    t_dead = gw.alive.stop_refreshing()
    elapsed = wait_engine_idle(w.engine, timeout=10)
    since_death = time.monotonic() - t_dead
    print(f"\nrunning count 0 after {since_death:.2f} s (gateway key TTL {names.GATEWAY_ALIVE_TTL_S} s)")
    assert since_death < 2.0 + 0.1 and elapsed < 2.1
    assert all(len(gw.tokens(f"s{i}")) < 400 for i in range(10) if f"s{i}" in gw.deltas)


def test_request_past_its_deadline_is_stopped(redis_url, start_worker):
    gw = FakeGateway(redis_url, "gw-deadline")
    w = start_worker(engine_id="e-deadline")
    slow_steps(w.engine, 0.005)
    gw.submit("late", PROMPTS[2], deadline=time.time() + 0.6, max_tokens=450, ignore_eos=True)
    gw.submit("on-time", PROMPTS[0], deadline=time.time() + 60, max_tokens=20, ignore_eos=True)
    gw.submit("expired", PROMPTS[1], deadline=time.time() - 1, max_tokens=20)
    gw.wait(["late", "on-time", "expired"], timeout=30)
    late = gw.terminal("late")
    assert late.finish_reason == "error" and "deadline" in late.error and len(gw.tokens("late")) < 450
    assert gw.terminal("on-time").finish_reason == "length"
    assert gw.terminal("expired").finish_reason == "error" and gw.tokens("expired") == []
    assert w.counters["stopped_deadline"] == 1
    wait_until(lambda: not w.engine.has_unfinished(), what="the engine idle")


def test_stream_holds_only_unfinished_work(redis_url, start_worker):
    gw = FakeGateway(redis_url, "gw-bounded")
    r = gw.r
    w = start_worker(engine_id="e-bounded")
    n = 24
    for i in range(n):
        gw.submit(f"b{i}", PROMPTS[i % 4], max_tokens=3 + i % 5)
    gw.submit("rejected", [1, 99999])                           # an error delta
    r.xadd(STREAM, {names.PAYLOAD_FIELD: b"garbage"})   # a dead letter
    gw.submit("aborted", PROMPTS[0], max_tokens=400, ignore_eos=True)
    wait_until(lambda: gw.pump(0.05) is not None and "aborted" in gw.deltas, what="first delta")
    gw.abort("aborted")
    gw.wait([f"b{i}" for i in range(n)] + ["rejected", "aborted"])
    wait_until(lambda: r.xlen(STREAM) == 0, what="the request stream empty")
    assert pending_count(r) == 0
    assert r.xlen(names.DEAD_LETTER_STREAM) == 1
    assert w.counters["requests"] == n + 1


def test_heartbeat_never_lapses_during_a_long_step(redis_url, start_worker):
    r = redis.Redis.from_url(redis_url)
    w = start_worker(engine_id="hb-slow", heartbeat_interval=0.2, heartbeat_ttl=0.8)
    key = names.heartbeat_key("hb-slow")
    engine, step = w.engine, w.engine.step
    slow = {"n": 0}

    def slow_step():                  # one step 3 s long (a huge prefill on a slow machine)
        if slow["n"] == 0 and engine.scheduler.waiting:
            slow["n"] += 1
            time.sleep(3.0)
        return step()

    engine.step = slow_step
    gw = FakeGateway(redis_url, "gw-slow")
    gw.submit("slow", PROMPTS[0], max_tokens=3)
    times, t_end = [], time.monotonic() + 4.0
    while time.monotonic() < t_end:
        raw = r.get(key)
        assert raw is not None, "the heartbeat key lapsed during a long step"
        times.append(msgpack.unpackb(raw, raw=False)["time"])
        time.sleep(0.02)
    gw.wait(["slow"])
    assert slow["n"] == 1
    assert len(set(times)) >= 10                       # refreshed all along (every 0.2 s)


def test_long_prompt_is_chunked_and_decodes_keep_flowing(redis_url, start_worker):
    budget = 32
    w = start_worker(engine_id="e-chunk", engine_kw={"max_num_batched_tokens": budget})
    sched = w.engine.scheduler
    batches = []
    schedule = sched.schedule

    def spy_schedule():
        b = schedule()
        batches.append({s.request_id: n for s, n in zip(b.seqs, b.num_new_tokens)})
        return b

    sched.schedule = spy_schedule
    gw = FakeGateway(redis_url, "gw-chunk")
    gw.submit("short", PROMPTS[0], max_tokens=450, ignore_eos=True)
    wait_until(lambda: gw.pump(0.05) is not None and "short" in gw.deltas, what="short decoding")
    gw.submit("long", [1] + [(7 * i) % 200 + 2 for i in range(299)], max_tokens=2)
    gw.submit("late", PROMPTS[1], max_tokens=2)
    gw.wait(["long", "late"], timeout=60)
    gw.abort("short")
    gw.wait(["short"], timeout=60)
    prefill = [b for b in batches if "long" in b][:-1]   # the long prompt's chunks
    assert len(prefill) >= 300 // budget, prefill
    assert all(sum(b.values()) <= budget for b in batches)
    decoding = [b for b in prefill if "short" in b]
    assert len(decoding) >= len(prefill) - 1           # short decoded alongside every chunk
    assert all(b["short"] == 1 for b in decoding)
    late_admitted = next(i for i, b in enumerate(batches) if "late" in b)
    long_done = max(i for i, b in enumerate(batches) if "long" in b)
    assert late_admitted < long_done                    # a new request did not wait for the prefill


def test_cli_config_env_and_flags(monkeypatch, tiny_model_dir):
    from engine_worker.cli import build_parser, configs_from_args
    monkeypatch.setenv("REDIS_URL", "redis://example:1/0")
    monkeypatch.setenv("KAITEN_MAX_NUM_SEQS", "7")
    monkeypatch.setenv("KAITEN_CLAIM_IDLE_MS", "1234")
    args = build_parser().parse_args(["--model", str(tiny_model_dir), "--engine-id", "x", "--dtype", "float32",
                                      "--no-enable-prefix-caching", "--max-deliveries", "9"])
    e, w = configs_from_args(args)
    assert (e.model, e.dtype, e.max_num_seqs, e.enable_prefix_caching) == (str(tiny_model_dir), "float32", 7, False)
    assert (w.redis_url, w.engine_id, w.claim_idle_ms, w.max_deliveries) == ("redis://example:1/0", "x", 1234, 9)


def test_cli_process_serves_and_stops_on_sigterm(redis_url, tiny_model_dir):
    r = redis.Redis.from_url(redis_url)
    gw = FakeGateway(redis_url, "gw-cli")
    env = dict(os.environ, KAITEN_HEARTBEAT_INTERVAL="0.2",
               PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    proc = subprocess.Popen(
        [sys.executable, "-m", "shared.cli", "engine", "--model", str(tiny_model_dir), "--redis-url", redis_url,
         "--engine-id", "cli-1", "--dtype", "float32", "--kv-cache-memory", "4MiB", "--served-model-name", MODEL],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        wait_until(lambda: r.exists(names.heartbeat_key("cli-1")) or proc.poll() is not None, timeout=60,
                   what="the engine process's heartbeat")
        assert proc.poll() is None, proc.stdout.read().decode()
        gw.submit("cli-req", PROMPTS[0], max_tokens=5)
        gw.wait(["cli-req"])
        assert len(gw.tokens("cli-req")) == 5
        # SIGTERM: the request in flight goes back to its gateway after the tokens computed so far,
        # and the process exits at once.
        gw.submit("in-flight", PROMPTS[2], max_tokens=150, ignore_eos=True)
        wait_until(lambda: gw.pump(0.05) is not None and gw.deltas.get("in-flight"), what="first delta")
        proc.send_signal(signal.SIGTERM)
        t_term = time.monotonic()
        gw.wait(["in-flight"], timeout=10)
        assert gw.handoffs == {"in-flight": "shutdown"}
        deltas = gw.deltas["in-flight"]
        assert [d.seq for d in deltas] == list(range(len(deltas))) and all(d.finish_reason is None for d in deltas)
        assert len(gw.tokens("in-flight")) < 150
        proc.wait(10)
        assert time.monotonic() - t_term < 5
        out, _ = proc.communicate(timeout=30)
        assert proc.returncode == 0, out.decode()
        assert pending_count(r) == 0
        assert not r.exists(names.heartbeat_key("cli-1"))
        assert b"stopped" in out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
