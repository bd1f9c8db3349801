"""Two engine processes (the tiny model, steps slowed by tests/support/slow_engine.py) and an
in-process gateway on one real Redis, the SSE clients that stream from them, and the checks the
failover and routing tests make of what came back (no tests here)."""
from __future__ import annotations

import asyncio
import os
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
import redis

from shared import names, protocol
from tests.support.engine_support import wait_until
from tests.support.gateway_support import start_gateway, stream_completion
from tests.support.paths import ROOT
from tests.support.redis_server import RedisServer

PROMPTS = [[1, 10 + i, 20 + 2 * i, 30 + (i * 7) % 50, 5] for i in range(16)]
N_TOKENS = 200
CHAT = [{"role": "user", "content": "Tell me a long story"}]
CHAT_TOKENS = 120
STEP_S = 0.02                     # each engine step >= 20 ms: 200 tokens take >= 4 s


# ---------------------------------------------------------------------- the stack
def engine_process(url: str, model_dir, engine_id: str, log_path: Path, go_file: str = "-",
                   extra: tuple[str, ...] = ()) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    return subprocess.Popen(
        [sys.executable, "-m", "tests.support.slow_engine", str(STEP_S), go_file, "--model", str(model_dir),
         "--redis-url", url, "--engine-id", engine_id, "--dtype", "float32", "--kv-cache-memory", "8MiB",
         "--heartbeat-interval", "0.2", "--heartbeat-ttl", "1.0", "--claim-idle-ms", "300",
         "--janitor-interval", "0.2", "--idle-block-ms", "20", "--num-threads", "1", "--log-level", "INFO", *extra],
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
def two_engines_and_a_gateway(model_dir, tmp_path, go_files: dict[str, str] | None = None,
                              engine_args: tuple[str, ...] = (), **gateway_overrides):
    """`engine_args`: more `kaiten engine` flags for both engines."""
    server = RedisServer().start()
    r = redis.Redis.from_url(server.url)
    logs = {e: tmp_path / f"{e}.log" for e in ("eng-a", "eng-b")}
    procs = {e: engine_process(server.url, model_dir, e, logs[e], (go_files or {}).get(e, "-"), engine_args)
             for e in logs}
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
    return await stream_completion(client, {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                                            "ignore_eos": True, "stream": True,
                                            "stream_options": {"include_usage": True}})


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


def streams_under_way(st: Stack, prompts: list[list[int]], timeout: float, tokens: int = 10
                      ) -> tuple[threading.Thread, dict, Counter]:
    """run_sse_clients over `prompts`, returned once every stream has `tokens` tokens: the clients'
    thread, the dict their results go to, and how many streams each engine serves."""
    out: dict = {}
    clients = run_sse_clients(st.srv.url, prompts, out)
    n = len(prompts)
    wait_until(lambda: len(st.tap.tokens_so_far()) == n and min(st.tap.tokens_so_far().values()) >= tokens,
               timeout, 0.01, f"{n} streams with {tokens} tokens each")
    return clients, out, Counter(st.tap.engine_of().values())


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
