"""Failover end to end (issue 13): a real Redis, real engine processes (the tiny model, steps
slowed by tests/support/slow_engine.py), an in-process gateway, real clients (httpx SSE, the `openai` SDK,
`websockets`). An engine SIGKILLed or SIGTERMed mid-stream: every stream completes with the text of
an uninterrupted run, its sequence numbers neither repeat nor skip, and no request is computed
twice (counted from the engines' own counters, in their heartbeats)."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import msgpack
import pytest
import redis

from shared import names, protocol
from tests.support.engine_support import WorkerThread, slow_steps, wait_until
from tests.support.gateway_support import start_gateway
from tests.support.paths import ROOT
from tests.support.redis_server import RedisServer

pytestmark = pytest.mark.timeout(240)

PROMPTS = [[1, 10 + i, 20 + 2 * i, 30 + (i * 7) % 50, 5] for i in range(16)]
N_TOKENS = 200
CHAT = [{"role": "user", "content": "Tell me a long story"}]
CHAT_TOKENS = 120
STEP_S = 0.02                     # each engine step >= 20 ms: 200 tokens take >= 4 s


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    """The uninterrupted greedy texts (the offline engine)."""
    from engine_worker import LLM, SamplingParams
    llm = LLM(str(tiny_model_dir), dtype="float32", kv_cache_memory="8MiB")
    texts = [c.text for c in llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=N_TOKENS,
                                                                  ignore_eos=True))]
    chat = llm.chat(CHAT, SamplingParams(temperature=0, max_tokens=CHAT_TOKENS, ignore_eos=True)).text
    return {"texts": texts, "chat": chat}


# ---------------------------------------------------------------------- the stack
def engine_process(url: str, model_dir, engine_id: str, log_path: Path, go_file: str = "-") -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    return subprocess.Popen(
        [sys.executable, "-m", "tests.support.slow_engine", str(STEP_S), go_file, "--model", str(model_dir),
         "--redis-url", url, "--engine-id", engine_id, "--dtype", "float32", "--kv-cache-memory", "8MiB",
         "--heartbeat-interval", "0.2", "--heartbeat-ttl", "1.0", "--claim-idle-ms", "300",
         "--janitor-interval", "0.2", "--idle-block-ms", "20", "--num-threads", "1", "--log-level", "INFO"],
        cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=open(log_path, "wb"))


class ReplyTap:
    """A second subscriber on the gateway's reply channel: every message, with its arrival time."""

    def __init__(self, url: str, gateway_id: str):
        self.ps = redis.Redis.from_url(url).pubsub()
        self.ps.subscribe(names.reply_channel(gateway_id))
        self.events: list[tuple[float, protocol.TokenBatch | protocol.Handoff]] = []
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True, name="reply-tap")
        self.thread.start()

    def _run(self):
        while not self._stop.is_set():
            m = self.ps.get_message(timeout=0.05)
            if m and m["type"] == "message":
                self.events.append((time.monotonic(), protocol.decode(m["data"])))

    def stop(self):
        self._stop.set()
        self.thread.join(5)

    def deltas(self) -> dict[str, list[tuple[float, str, protocol.Delta]]]:
        """origin request id -> (arrival, engine, delta), continuations (``<id>~<n>``) included."""
        out: dict[str, list] = {}
        for t, msg in list(self.events):
            if isinstance(msg, protocol.TokenBatch):
                for d in msg.deltas:
                    out.setdefault(d.request_id.split("~")[0], []).append((t, msg.engine_id, d))
        return out

    def engine_of(self) -> dict[str, str]:
        """request id -> the engine that admitted it (first attempts only)."""
        return {rid: msg.engine_id for _, msg in list(self.events) if isinstance(msg, protocol.TokenBatch)
                for rid in msg.admitted if "~" not in rid}

    def tokens_so_far(self) -> dict[str, int]:
        return {rid: sum(len(d.token_ids) for _, _, d in ds) for rid, ds in self.deltas().items()}


@dataclass
class Stack:
    server: RedisServer
    r: redis.Redis
    procs: dict[str, subprocess.Popen]
    srv: object
    tap: ReplyTap
    logs: dict[str, Path] = field(default_factory=dict)

    def counters(self, engine_id: str) -> dict[str, int]:
        raw = self.r.get(names.heartbeat_key(engine_id))
        return msgpack.unpackb(raw, raw=False).get("counters", {}) if raw else {}

    def log(self, engine_id: str) -> str:
        return self.logs[engine_id].read_text(errors="replace")[-3000:]


@contextmanager
def two_engines_and_a_gateway(model_dir, tmp_path, go_files: dict[str, str] | None = None, **gateway_overrides):
    server = RedisServer().start()
    r = redis.Redis.from_url(server.url)
    logs = {e: tmp_path / f"{e}.log" for e in ("eng-a", "eng-b")}
    procs = {e: engine_process(server.url, model_dir, e, logs[e], (go_files or {}).get(e, "-")) for e in logs}
    srv = tap = None
    try:
        srv = start_gateway(server.url, model_dir, **{"engine_timeout": 5.0, "failover_timeout": 2.0,
                                                      **gateway_overrides})
        tap = ReplyTap(server.url, srv.gw.gateway_id)
        yield Stack(server, r, procs, srv, tap, logs)
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
        if tap is not None:
            tap.stop()
        if srv is not None:
            srv.stop()
        server.stop()


def wait_engines(st: Stack, engine_ids, timeout: float = 120.0) -> None:
    def up():
        dead = [e for e, p in st.procs.items() if p.poll() is not None]
        assert not dead, f"engine {dead} exited: {st.log(dead[0])}"
        return all(st.r.exists(names.heartbeat_key(e)) for e in engine_ids)
    wait_until(up, timeout, 0.1, "the engines' heartbeats")
    wait_until(lambda: {e.engine_id for e in st.srv.gw.monitor.live_engines()} >= set(engine_ids), 10)


# ---------------------------------------------------------------------- clients
async def sse_completion(client: httpx.AsyncClient, prompt: list[int], max_tokens: int = N_TOKENS) -> dict:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    text, finish, done, errors, usage = "", None, False, [], None
    async with client.stream("POST", "/v1/completions", json=body) as resp:
        assert resp.status_code == 200
        async for line in resp.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                done = True
                continue
            ev = json.loads(data)
            if "error" in ev:
                errors.append(ev["error"])
                continue
            if ev.get("usage"):
                usage = ev["usage"]
            for c in ev["choices"]:
                text += c["text"]
                finish = c["finish_reason"] or finish
    return {"text": text, "finish": finish, "done": done, "errors": errors, "usage": usage}


def run_sse_clients(url: str, prompts: list[list[int]], out: dict) -> threading.Thread:
    async def main():
        async with httpx.AsyncClient(base_url=url, trust_env=False, timeout=120,
                                     limits=httpx.Limits(max_connections=len(prompts))) as c:
            return await asyncio.gather(*(sse_completion(c, p) for p in prompts), return_exceptions=True)

    def target():
        out["results"] = asyncio.run(main())
    t = threading.Thread(target=target, daemon=True, name="sse-clients")
    t.start()
    return t


def kill_time_to_next_token(st: Stack, victim: str, t_signal: float) -> dict[str, float]:
    """For each request the victim held: seconds from the signal to its first token elsewhere."""
    out = {}
    for rid, ds in st.tap.deltas().items():
        later = [t for t, eng, d in ds if eng != victim and t > t_signal and d.token_ids]
        if any(eng == victim for _, eng, _ in ds) and later:
            out[rid] = min(later) - t_signal
    return out


def check_streams(st: Stack, results: list, texts: list[str]) -> None:
    """Every stream complete, error-free, equal to the uninterrupted run, usage the original's."""
    for i, (res, want) in enumerate(zip(results, texts)):
        assert not isinstance(res, BaseException), (i, res)
        assert res["done"] and not res["errors"] and res["finish"] == "length", (i, res["errors"], res["finish"])
        assert res["text"] == want, i
        assert res["usage"]["completion_tokens"] == N_TOKENS and res["usage"]["prompt_tokens"] == len(PROMPTS[i])


def check_sequences(st: Stack, n_tokens: int) -> set[str]:
    """Across attempts, every request's seqs are 0, 1, 2, ... (no repeat, no gap) and its tokens
    number n_tokens. Returns the requests that were moved."""
    moved = set()
    for rid, ds in st.tap.deltas().items():
        seqs = [d.seq for _, _, d in ds]
        assert seqs == list(range(len(seqs))), (rid, seqs)
        assert sum(len(d.token_ids) for _, _, d in ds) == n_tokens, rid
        if any("~" in d.request_id for _, _, d in ds):
            moved.add(rid)
    c = st.srv.gw.router.counters
    assert c["duplicates"] == 0 and c["gaps"] == 0 and c["foreign_engine"] == 0, c
    return moved


def check_survivor_ran_no_claimed_entry(st: Stack, survivor: str, moved: set[str], originals: int) -> None:
    """The survivor's janitor claimed the victim's entries and handed them back (ACK+DEL, no run):
    it ran its own originals and one continuation per moved request, nothing else."""
    wait_until(lambda: st.counters(survivor).get("handed_back", 0) >= len(moved), 15, 0.1,
               "the survivor's janitor to hand back the victim's entries")
    time.sleep(0.5)
    c = st.counters(survivor)
    assert c.get("handed_back") == len(moved), c
    assert c.get("continuations") == len(moved), c
    assert c.get("requests") == originals + len(moved), c
    assert st.r.xlen(st.srv.gw.models.default.stream) == 0


# ---------------------------------------------------------------------- tests
def test_sigkill_of_the_busier_engine_16_streams_complete_unchanged(tiny_model_dir, tmp_path, reference):
    with two_engines_and_a_gateway(tiny_model_dir, tmp_path) as st:
        wait_engines(st, ["eng-a", "eng-b"])
        out: dict = {}
        clients = run_sse_clients(st.srv.url, PROMPTS, out)
        wait_until(lambda: len(st.tap.tokens_so_far()) == 16 and min(st.tap.tokens_so_far().values()) >= 10,
                   60, 0.01, "16 streams with 10 tokens each")
        placed = Counter(st.tap.engine_of().values())
        victim = placed.most_common(1)[0][0]
        survivor = "eng-b" if victim == "eng-a" else "eng-a"
        st.procs[victim].send_signal(signal.SIGKILL)
        t_kill = time.monotonic()
        clients.join(120)
        assert not clients.is_alive()
        check_streams(st, out["results"], reference["texts"])
        moved = check_sequences(st, N_TOKENS)
        assert moved == {rid for rid, e in st.tap.engine_of().items() if e == victim}
        assert len(moved) == placed[victim] >= 8 and st.srv.gw.router.counters["failovers"] == len(moved)
        check_survivor_ran_no_claimed_entry(st, survivor, moved, placed[survivor])
        waits = sorted(kill_time_to_next_token(st, victim, t_kill).values())
        print(f"\nSIGKILL -> next token over {len(waits)} moved streams: p50 {waits[len(waits) // 2]:.2f} s, "
              f"max {waits[-1]:.2f} s (failover_timeout 2.0 s)")
        assert len(waits) == len(moved) and waits[-1] < 8.0


def test_sigkill_through_the_openai_sdk_and_the_websocket_chat(tiny_model_dir, tmp_path, reference):
    """The victim holds every request (the other engine joins Redis only after they are admitted)."""
    import openai
    from websockets.sync.client import connect
    go = tmp_path / "go-b"
    with two_engines_and_a_gateway(tiny_model_dir, tmp_path, go_files={"eng-b": str(go)}) as st:
        wait_engines(st, ["eng-a"])
        results: dict = {}

        def sdk(i):
            client = openai.OpenAI(base_url=st.srv.url + "/v1", api_key="unused", max_retries=0, timeout=120,
                                   http_client=httpx.Client(trust_env=False, timeout=120))
            try:
                stream = client.completions.create(model=tiny_model_dir.name, prompt=PROMPTS[i], max_tokens=N_TOKENS,
                                                   temperature=0, stream=True, extra_body={"ignore_eos": True})
                results[("sdk", i)] = "".join(c.choices[0].text for c in stream if c.choices)
            except Exception as e:          # recorded: the assertion below shows it
                results[("sdk", i)] = e

        def ws(i):
            with connect(st.srv.ws_url + "/v1/chat/ws", proxy=None, open_timeout=10) as conn:
                conn.send(json.dumps({"type": "chat", "id": f"c{i}", "messages": CHAT, "max_tokens": CHAT_TOKENS,
                                      "temperature": 0, "ignore_eos": True}))
                events = []
                while not events or events[-1]["type"] not in ("done", "error"):
                    events.append(json.loads(conn.recv(120)))
                results[("ws", i)] = events

        threads = [threading.Thread(target=sdk, args=(i,)) for i in range(3)]
        threads += [threading.Thread(target=ws, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        wait_until(lambda: len(st.tap.tokens_so_far()) == 5 and min(st.tap.tokens_so_far().values()) >= 5,
                   60, 0.01, "5 streams with tokens")
        go.touch()                                   # the survivor joins
        wait_engines(st, ["eng-b"])
        st.procs["eng-a"].send_signal(signal.SIGKILL)
        for t in threads:
            t.join(120)
        for i in range(3):
            assert results[("sdk", i)] == reference["texts"][i], results[("sdk", i)]
        for i in range(2):
            events = results[("ws", i)]
            assert events[-1]["type"] == "done" and not any(e["type"] == "error" for e in events), events[-2:]
            assert "".join(e["content"] for e in events if e["type"] == "delta") == reference["chat"]
            assert events[-1]["usage"]["completion_tokens"] == CHAT_TOKENS
        moved = set(st.tap.deltas())
        assert all(any("~" in d.request_id for _, _, d in ds) for ds in st.tap.deltas().values())
        for rid, ds in st.tap.deltas().items():
            assert [d.seq for _, _, d in ds] == list(range(len(ds))), [(e, d.request_id, d.seq, d.token_ids, d.finish_reason) for _, e, d in ds]
        check_survivor_ran_no_claimed_entry(st, "eng-b", moved, 0)


def test_sigterm_under_load_hands_off_and_exits_within_5s(tiny_model_dir, tmp_path, reference):
    with two_engines_and_a_gateway(tiny_model_dir, tmp_path) as st:
        wait_engines(st, ["eng-a", "eng-b"])
        out: dict = {}
        prompts = PROMPTS[:8]
        clients = run_sse_clients(st.srv.url, prompts, out)
        wait_until(lambda: len(st.tap.tokens_so_far()) == 8 and min(st.tap.tokens_so_far().values()) >= 10,
                   60, 0.01, "8 streams with 10 tokens each")
        placed = Counter(st.tap.engine_of().values())
        victim = placed.most_common(1)[0][0]
        st.procs[victim].send_signal(signal.SIGTERM)
        t_term = time.monotonic()
        assert st.procs[victim].wait(10) == 0
        exit_s = time.monotonic() - t_term
        clients.join(120)
        assert not clients.is_alive()
        check_streams(st, out["results"], reference["texts"][:8])
        moved = check_sequences(st, N_TOKENS)
        assert moved == {rid for rid, e in st.tap.engine_of().items() if e == victim}
        assert st.srv.gw.router.counters["handoffs"] == len(moved) and st.srv.gw.router.counters["engine_lost"] == 0
        waits = sorted(kill_time_to_next_token(st, victim, t_term).values())
        print(f"\nSIGTERM: exit after {exit_s:.2f} s; next token over {len(waits)} moved streams: "
              f"p50 {waits[len(waits) // 2]:.2f} s, max {waits[-1]:.2f} s")
        assert exit_s < 5.0
        assert not st.r.exists(names.heartbeat_key(victim))


def test_redis_restart_8_streams_complete_unchanged(tiny_model_dir, reference):
    """Redis restarts empty under 8 streams: the gateway resubmits them as continuations once its
    reply channel is back; the engine (in-process: it lives through the restart) drops the
    orphaned originals on their aborts, so none runs to its end twice."""
    server = RedisServer().start()
    w = WorkerThread(server.url, tiny_model_dir, "e-restart", heartbeat_ttl=1.0).start()
    slow_steps(w.engine, STEP_S)
    srv = start_gateway(server.url, tiny_model_dir, engine_timeout=5.0)
    try:
        wait_until(lambda: srv.gw.monitor.live_engines(), 10)
        out: dict = {}
        clients = run_sse_clients(srv.url, PROMPTS[:8], out)
        wait_until(lambda: len(srv.gw.router.streams) == 8
                   and min(len(s.token_ids) for s in srv.gw.router.streams.values()) >= 10, 60, 0.01,
                   "8 streams with 10 tokens each")
        server.restart_empty()
        clients.join(120)
        assert not clients.is_alive()
        for i, res in enumerate(out["results"]):
            assert not isinstance(res, BaseException), (i, res)
            assert res["done"] and not res["errors"] and res["finish"] == "length", (i, res["errors"])
            assert res["text"] == reference["texts"][i], i
            assert res["usage"]["completion_tokens"] == N_TOKENS
        assert srv.gw.router.counters["failovers"] == 8
        # The 8 originals were stopped before their end (aborted by the gateway, or stopped by the
        # orphan watch while the restarted Redis lacked the gateway's liveness key); only the
        # continuations ran to the end.
        dropped = lambda: w.counters["aborts"] + w.counters["stopped_gateway_gone"]  # noqa: E731
        wait_until(lambda: dropped() >= 8 and not w.engine.has_unfinished(), 10)
        assert dropped() == 8, w.counters
        assert w.counters["requests"] == 16 and w.counters["continuations"] == 8
    finally:
        srv.stop()
        w.stop()
        server.stop()
