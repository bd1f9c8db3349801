"""Cache-aware routing (issue 20): the shared block hash, the gateway's placement decisions, and,
end to end with real engine processes and a real Redis, that a conversation's next turn goes to the
engine holding its prefix, that a routed request outlives its engine (mid-queue and mid-stream), and
that a hot prefix spills to the other engine when its holder is busy."""
from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from gateway.backend.engines import EngineInfo, EngineMonitor
from gateway.backend.placement import Placer
from shared import names
from shared.block_hash import block_hash, prefix_block_hashes
from shared.block_index import pack_blocks, unpack_blocks
from tests.support.engine_cluster import sse_completion, two_engines_and_a_gateway, wait_engines
from tests.support.engine_support import wait_until
from tests.support.paths import ROOT

pytestmark = pytest.mark.timeout(240)

BS = 16
SYSTEM = [1] + [(7 * i) % 200 + 3 for i in range(63)]          # 4 full blocks every turn shares


def turn(user: int, k: int) -> list[int]:
    """The prompt of turn k of a user: the shared system prompt and the history so far."""
    return SYSTEM + [(user * 31 + 11 * j) % 200 + 3 for j in range(40 * k)]


# ---------------------------------------------------------------------- the hash
def test_block_hash_is_the_same_in_every_process():
    tokens = list(range(100, 164))
    code = ("from shared.block_hash import prefix_block_hashes; "
            "print(prefix_block_hashes(list(range(100, 164)), 16))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True,
                         env=dict(os.environ, PYTHONHASHSEED="123"))
    assert out.stdout.strip() == str(prefix_block_hashes(tokens, 16))
    hashes = prefix_block_hashes(tokens, 16)
    assert len(hashes) == 4 and len(set(hashes)) == 4 and all(0 <= h < 2**64 for h in hashes)
    assert hashes[1] == block_hash(hashes[0], tokens[16:32])
    assert prefix_block_hashes(tokens, 16, max_blocks=2) == hashes[:2]
    assert prefix_block_hashes(tokens[:15], 16) == []


def test_adapters_chain_from_their_own_root():
    from shared.block_hash import ROOT, prefix_block_hashes, root_hash
    ids = list(range(40))
    assert root_hash("") == ROOT and root_hash("a") != root_hash("b") != ROOT
    base, a, b = (prefix_block_hashes(ids, 16, lora_name=n) for n in ("", "a", "b"))
    assert len(base) == len(a) == 2 and not set(base) & set(a) and not set(a) & set(b)
    assert prefix_block_hashes(ids, 16) == base


def test_block_list_round_trips_and_rejects_junk():
    assert unpack_blocks(pack_blocks(7, [1, 2**64 - 1])) == (7, frozenset({1, 2**64 - 1}))
    for bad in (b"", b"123", None):
        with pytest.raises((ValueError, TypeError)):
            unpack_blocks(bad)


def test_prefix_cache_hashes_are_the_routing_hashes():
    from engine_worker.engine.block_manager import BlockManager
    from engine_worker.engine.sequence import Sequence
    from engine_worker.engine.sampling_params import SamplingParams
    bm = BlockManager(num_blocks=16, block_size=BS)
    prompt = list(range(3, 3 + 5 * BS + 3))
    seq = Sequence("r", list(prompt), len(prompt), SamplingParams())
    assert bm.allocate(seq, len(prompt))
    seq.num_computed_tokens = len(prompt)
    v0 = bm.cache_version
    bm.cache_full_blocks(seq)
    assert set(bm.cached_hashes()) == set(prefix_block_hashes(prompt, BS))
    assert bm.cache_version > v0


# ---------------------------------------------------------------------- placement
def monitor_with(*engines: tuple[str, list[int], int]) -> EngineMonitor:
    """A monitor that has read these engines: (id, block hashes held, running requests)."""
    mon = EngineMonitor(client=None, engine_timeout=10.0)
    now = time.monotonic()
    for engine_id, hashes, running in engines:
        mon.engines[engine_id] = EngineInfo(
            engine_id, {"block_size": BS, "num_running": running, "num_waiting": 0, "accepting": True,
                        "heartbeat_interval": 0.5, "instance": engine_id, "blocks_version": 1},
            last_alive=now, blocks=frozenset(hashes), blocks_version=(engine_id, 1), blocks_seen=now)
    return mon


SHARED = names.request_stream("m")


def place(placer: Placer, ids: list[int], lora_name: str = ""):
    """The placer's decision among every engine its monitor knows (one model's)."""
    return placer.place(ids, list(placer.monitor.engines.values()), SHARED, lora_name)


def test_placement_prefers_the_engine_holding_the_prefix():
    a_holds = prefix_block_hashes(turn(0, 1), BS)
    placer = Placer(monitor_with(("a", a_holds, 2), ("b", [], 0)))
    d = place(placer, turn(0, 2))
    assert (d.engine_id, d.reason, d.stream) == ("a", "prefix_hit", names.engine_stream("a"))
    assert d.hit_blocks == len(a_holds)


def test_placement_no_hit_goes_to_the_shared_stream():
    placer = Placer(monitor_with(("a", prefix_block_hashes(turn(0, 1), BS), 0), ("b", [], 0)))
    d = place(placer, [9] * 200)
    assert (d.engine_id, d.reason, d.stream) == (None, "no_hit", SHARED)


def test_placement_queue_policy_and_no_engine_fall_back():
    assert place(Placer(monitor_with(("a", [], 0)), policy="queue"), turn(0, 1)).reason == "fallback"
    assert place(Placer(monitor_with()), turn(0, 1)).reason == "fallback"
    with pytest.raises(ValueError, match="routing must be one of"):
        Placer(monitor_with(), policy="random")


def test_an_adapter_request_goes_only_to_engines_holding_the_adapter():
    """Never the shared stream (an engine without the adapter could take it); the hashes chain
    from the adapter's root, so the base model's cached blocks are no hit for it."""
    a_holds = prefix_block_hashes(turn(0, 1), BS)
    mon = monitor_with(("a", a_holds, 0), ("b", [], 3), ("c", [], 1))
    mon.engines["b"].heartbeat["adapters"] = {"sql": "/x"}
    mon.engines["c"].heartbeat["adapters"] = {"sql": "/x"}
    placer = Placer(mon)
    d = place(placer, turn(0, 2), "sql")
    assert (d.engine_id, d.reason, d.stream) == ("c", "no_hit", names.engine_stream("c"))
    assert place(placer, turn(0, 2)).engine_id == "a"                 # the base model: a holds it
    assert place(placer, turn(0, 2), "other").stream == ""            # nobody holds "other"
    q = place(Placer(mon, policy="queue"), turn(0, 2), "sql")
    assert q.reason == "fallback" and q.engine_id in ("b", "c")


def test_placement_spills_a_busy_engines_hot_prefix():
    hot = prefix_block_hashes(SYSTEM + [5] * 32, BS)
    placer = Placer(monitor_with(("a", hot, 20), ("b", [], 1)), balance_abs_threshold=8, balance_rel_threshold=1.5)
    d = place(placer, SYSTEM + [5] * 32 + [6])
    assert (d.engine_id, d.reason) == ("b", "load_spill")


def test_engines_sharing_a_kv_store_spread_a_hot_prefix_at_a_small_imbalance():
    """The prefix a busy engine holds is in the store: on the least loaded engine it costs a load,
    so a request spills at an imbalance below the cache-only thresholds; without a store it stays."""
    hot = prefix_block_hashes(SYSTEM + [5] * 32, BS)
    prompt = SYSTEM + [5] * 32 + [6]
    shared = monitor_with(("a", hot, 4), ("b", [], 1))
    for e in shared.engines.values():
        e.heartbeat["kv_store"] = True
    d = place(Placer(shared), prompt)
    assert (d.engine_id, d.reason) == ("b", "store_spill")
    d = place(Placer(monitor_with(("a", hot, 4), ("b", [], 1))), prompt)
    assert (d.engine_id, d.reason) == ("a", "prefix_hit")


def test_a_chats_next_turn_spills_on_the_history_its_engine_computed_before_publishing_it():
    """The first turn finished on a busy engine that has not published its blocks yet: with a
    store its history was computed, so written, and the next turn goes to the least loaded
    engine to load it; without one it follows its history."""
    first = turn(0, 1) + [9] * 16                     # the prompt and its answer
    for store, want in ((True, ("b", "store_spill")), (False, ("a", "prefix_hit"))):
        mon = monitor_with(("a", [], 3), ("b", [], 0))
        for e in mon.engines.values():
            e.heartbeat["kv_store"] = store
        placer = Placer(mon)
        placer.learned("a", first)
        d = place(placer, first + [7] * 20)
        assert (d.engine_id, d.reason) == want


def test_a_burst_on_a_new_prefix_goes_to_the_one_store_engine_computing_it():
    """No engine holds it and none has written it: the first request goes to the least loaded
    engine's own stream, and those sharing its prefix follow it there (blocks only sent to an
    engine are not in the store), rather than four engines computing it at once."""
    mon = monitor_with(*((e, [], 0) for e in "abcd"))
    for e in mon.engines.values():
        e.heartbeat["kv_store"] = True
    placer = Placer(mon)
    picks = [place(placer, turn(u, 1)) for u in range(4)]
    assert picks[0].reason == "no_hit" and picks[0].engine_id is not None
    assert {d.engine_id for d in picks} == {picks[0].engine_id}


def test_a_burst_spreads_before_the_next_heartbeat():
    """Eight new conversations on the shared system prompt, all engines holding it: what this
    gateway just sent counts as load, so they spread evenly."""
    sys_blocks = prefix_block_hashes(SYSTEM, BS)
    placer = Placer(monitor_with(*((e, sys_blocks, 0) for e in "abcd")))
    picks = [place(placer, turn(u, 1)).engine_id for u in range(8)]
    assert sorted(picks) == sorted("abcd" * 2)
    # ... and the second turns follow them (the gateway's own knowledge of what it sent).
    assert [place(placer, turn(u, 2)).engine_id for u in range(8)] == picks


# ---------------------------------------------------------------------- end to end
ENGINES = ("eng-a", "eng-b")


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    """Greedy texts of every prompt the end-to-end tests send (the offline engine, fp32)."""
    from engine_worker import LLM, SamplingParams
    llm = LLM(str(tiny_model_dir), dtype="float32", kv_cache_memory="8MiB")
    prompts = {(u, k): turn(u, k) for u in range(4) for k in (1, 2)}
    outs = llm.generate(list(prompts.values()), SamplingParams(temperature=0, max_tokens=120, ignore_eos=True))
    return {key: o.text for key, o in zip(prompts, outs)}


def admissions(st) -> dict[str, str]:
    """origin request id -> the engine that admitted it first (a continuation counts for its origin)."""
    out: dict[str, str] = {}
    for _, msg in list(st.tap.events):
        for rid in getattr(msg, "admitted", ()):
            out.setdefault(rid.split("~")[0], msg.engine_id)
    return out


def send(st, prompt: list[int], max_tokens: int = 24) -> tuple[str, str]:
    """One streamed completion; (its text, the engine that admitted it first)."""
    before = set(admissions(st))

    async def main():
        async with httpx.AsyncClient(base_url=st.srv.url, trust_env=False, timeout=120) as c:
            return await sse_completion(c, prompt, max_tokens)
    res = asyncio.run(main())
    assert res["done"] and not res["errors"], res
    new = wait_until(lambda: [e for rid, e in admissions(st).items() if rid not in before], 5, 0.02, "admission")
    return res["text"], new[0]


def wait_blocks(st, engine_id: str, prompt: list[int]) -> None:
    """Until the gateway has read that `engine_id` holds the prompt's blocks."""
    want = set(prefix_block_hashes(prompt, BS, (len(prompt) - 1) // BS))
    wait_until(lambda: want <= st.srv.gw.monitor.engines[engine_id].blocks, 10, 0.05, f"{engine_id}'s blocks")


def routing_counts(st) -> dict[str, float]:
    out = {}
    for line in st.srv.gw.metrics.render().decode().splitlines():
        if line.startswith("kaiten:routing_decisions_total{"):
            out[line.split('reason="')[1].split('"')[0]] = float(line.rsplit(" ", 1)[1])
    return out


def test_turns_of_a_conversation_follow_their_blocks(tiny_model_dir, tmp_path, reference):
    with two_engines_and_a_gateway(tiny_model_dir, tmp_path) as st:
        wait_engines(st, ENGINES)
        first = {}
        for u in range(4):
            text, first[u] = send(st, turn(u, 1), 120)
            assert text == reference[(u, 1)]
            wait_blocks(st, first[u], turn(u, 1))
        for u in range(4):
            text, engine = send(st, turn(u, 2), 120)
            assert text == reference[(u, 2)]
            assert engine == first[u], (u, first, engine)
        counts = routing_counts(st)
        # Every second turn, and the first turns once an engine held SYSTEM (one at a time, on idle
        # engines: the engine holding it; a burst spreads, test_a_burst_spreads_...).
        assert counts["prefix_hit"] >= 4 + 3, counts


def test_routed_request_whose_engine_dies_in_the_queue_runs_elsewhere(tiny_model_dir, tmp_path, reference):
    with two_engines_and_a_gateway(tiny_model_dir, tmp_path) as st:
        wait_engines(st, ENGINES)
        _, victim = send(st, turn(0, 1))
        wait_blocks(st, victim, turn(0, 1))
        st.procs[victim].send_signal(signal.SIGSTOP)      # alive to the gateway for failover_timeout
        text, engine = send(st, turn(0, 2), 120)
        assert engine != victim and text == reference[(0, 2)]
        # Moved once: by the gateway's watchdog, or first by the survivor's janitor, which hands
        # back what a dead engine's stream holds once its heartbeat key expired.
        c = st.srv.gw.router.counters
        assert c["failovers"] == 1 and c["routed_respilled"] + c["handoffs"] == 1, c
        assert routing_counts(st)["prefix_hit"] >= 1
        st.procs[victim].kill()
        st.procs[victim].wait()
        # The survivor's janitor empties and deletes the dead engine's own stream.
        wait_until(lambda: not st.r.exists(names.engine_stream(victim)), 15, 0.1, "the dead engine's stream gone")


def test_routed_request_whose_engine_dies_mid_stream_completes_elsewhere(tiny_model_dir, tmp_path, reference):
    with two_engines_and_a_gateway(tiny_model_dir, tmp_path) as st:
        wait_engines(st, ENGINES)
        _, victim = send(st, turn(1, 1))
        wait_blocks(st, victim, turn(1, 1))
        before, out = set(admissions(st)), {}

        def client():
            out["res"] = send(st, turn(1, 2), 120)
        t = threading.Thread(target=client, daemon=True)
        t.start()

        def streaming_on_victim():
            tokens = st.tap.tokens_so_far()
            return any(e == victim and tokens.get(rid, 0) >= 10
                       for rid, e in admissions(st).items() if rid not in before)
        wait_until(streaming_on_victim, 30, 0.005, "tokens from the routed engine")
        st.procs[victim].kill()
        t.join(60)
        text, engine = out["res"]
        assert engine == victim and text == reference[(1, 2)]
        assert st.srv.gw.router.counters["failovers"] >= 1


def test_a_busy_engines_hot_prefix_spills_to_the_other(tiny_model_dir, tmp_path):
    with two_engines_and_a_gateway(tiny_model_dir, tmp_path, routing_balance_abs_threshold=0,
                                   routing_balance_rel_threshold=1.0) as st:
        wait_engines(st, ENGINES)
        _, holder = send(st, turn(2, 1))
        wait_blocks(st, holder, turn(2, 1))
        before = set(admissions(st))
        hot = [turn(2, 1) + [50 + i] * 20 for i in range(6)]

        async def main():
            async with httpx.AsyncClient(base_url=st.srv.url, trust_env=False, timeout=120) as c:
                return await asyncio.gather(*(sse_completion(c, p, 40) for p in hot))
        assert all(r["done"] and not r["errors"] for r in asyncio.run(main()))
        engines = [e for rid, e in admissions(st).items() if rid not in before]
        assert len(engines) == 6 and set(engines) == set(ENGINES), engines
        assert routing_counts(st)["load_spill"] >= 1
