"""Failover benchmark (issue 13): how long a stream pauses when its engine dies or is shut down,
and how many tokens are computed twice.

    .venv/bin/python bench/serving/failover.py                 # SmolLM2 (kaiten up's default model)
    .venv/bin/python bench/serving/failover.py --quick         # tiny random model, slowed steps: a check, seconds
    .venv/bin/python bench/serving/failover.py --model DIR --num-requests 8 --max-tokens 160

Starts a private redis-server, two `kaiten engine` processes and one `kaiten gateway`, with the
shipped settings (heartbeat and failover_timeout as shipped; engines on --num-threads torch threads).
Round 1: N concurrent greedy streaming /v1/completions requests (ignore_eos); once every stream
has --signal-after tokens, SIGKILL the engine serving most of them. Round 2: start a replacement
engine, so two run again; new prompts; SIGTERM the engine serving most. Per moved request: the
time from the signal to its next token, as the bench's own subscriber on the gateway's reply
channel sees the first delta of the continuation (Redis) and as the client sees the SSE chunk that
carries it. Checks: every stream ends with [DONE], no error, max_tokens tokens, and sequence
numbers 0, 1, 2, ... across its attempts; its tokens equal an uninterrupted run of the same prompt
(the offline engine in this process, after the rounds; --no-reference skips it).

Tokens computed twice, per round:
- prefill of each continuation (its prompt = original prompt + the tokens delivered), less its
  prefix-cache hits: from the continuation's terminal delta (num_prompt_tokens - num_cached_tokens),
  and independently from the survivors' heartbeats (prefix-cache lookups - hits over the round,
  less their own originals' prefills);
- claimed entries run twice: the survivors' `requests` counter less their originals and
  continuations (should be 0: the janitor hands claimed entries back, `handed_back`);
- SIGKILL only: the tokens the victim had computed but not published when it died (its step in
  flight and the batch being sent: at most 2 per moved request); not observable, not counted.
  SIGTERM publishes every computed token before the handoff.

Writes bench/results/failover/failover.{md,json} (--quick: failover.quick.*).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.common.machine import cpu_name, load_avg  # noqa: E402
from bench.common.results_files import results_dir  # noqa: E402
from shared import names  # noqa: E402
from shared.config import GatewayConfig, WorkerConfig  # noqa: E402
from shared.launcher import free_port, start_local_redis  # noqa: E402

HEARTBEAT_S, FAILOVER_S = WorkerConfig().heartbeat_interval, GatewayConfig().failover_timeout

RESULTS = results_dir(__file__)
TOPICS = ["a lighthouse keeper", "the first city on Mars", "a clockmaker's apprentice", "a dragon who hates gold",
          "two rival chefs", "a detective in Venice", "the last library on Earth", "a robot learning to paint",
          "a storm at sea", "a village without music", "a time traveller's mistake", "an honest politician",
          "a cat that runs a hotel", "the deepest cave", "a forgotten king", "a garden on the moon"]
GOALS_S = {"SIGKILL": 3.0, "SIGTERM": 1.0}


# ---------------------------------------------------------------------- the processes
@dataclass(slots=True)
class Stack:
    """A private redis-server, engine processes and one gateway; each child's log in workdir."""
    model: str
    num_threads: int
    step_delay: float
    dtype: str = "auto"
    workdir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="kaiten-bench-failover-")))
    redis: object = None
    redis_url: str = ""
    engines: dict[str, subprocess.Popen] = field(default_factory=dict)
    gateway: subprocess.Popen | None = None
    url: str = ""
    signalled: set = field(default_factory=set)          # engines the bench stopped on purpose
    engine_flags: list = field(default_factory=list)     # more `kaiten engine` flags
    gateway_flags: list = field(default_factory=list)    # more `kaiten gateway` flags

    def env(self) -> dict[str, str]:
        path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
        return dict(os.environ, PYTHONPATH=path, PYTHONUNBUFFERED="1", TOKENIZER_URL="")

    def _spawn(self, name: str, argv: list[str]) -> subprocess.Popen:
        log = open(self.workdir / f"{name}.log", "wb")
        return subprocess.Popen(argv, cwd=ROOT, env=self.env(), stdin=subprocess.DEVNULL, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)

    def start_redis(self) -> None:
        self.redis, self.redis_url = start_local_redis(workdir=str(self.workdir))

    def start_engine(self, engine_id: str, flags: tuple[str, ...] = (), cpus: str = "") -> None:
        """`kaiten engine` (or, with a step delay, the same engine with every step slowed: tests/support/slow_engine.py),
        with `flags` after the stack's; `cpus`: pinned to those cores (`taskset -c`)."""
        flags = ["--model", self.model, "--redis-url", self.redis_url, "--engine-id", engine_id,
                 "--num-threads", str(self.num_threads), "--dtype", self.dtype, "--log-level", "INFO",
                 *self.engine_flags, *flags]
        head = ["-m", "tests.support.slow_engine", str(self.step_delay), "-"] if self.step_delay else ["-m", "shared.cli",
                                                                                                "engine"]
        pin = ["taskset", "-c", cpus] if cpus else []
        self.engines[engine_id] = self._spawn(engine_id, [*pin, sys.executable, *head, *flags])

    def start_two_engines(self, ready_timeout: float):
        """Redis, engines eng-a and eng-b and the gateway, once the gateway sees both; returns a
        client of that Redis."""
        import redis
        self.start_redis()
        for e in ("eng-a", "eng-b"):
            self.start_engine(e)
        self.start_gateway()
        self.wait_ready(2, ready_timeout)
        return redis.Redis.from_url(self.redis_url)

    def start_gateway(self) -> None:
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.gateway = self._spawn("gateway", [sys.executable, "-m", "shared.cli", "gateway", "--host", "127.0.0.1",
                                               "--port", str(port), "--model", self.model, "--redis-url",
                                               self.redis_url, "--log-level", "INFO", *self.gateway_flags])

    def log_tail(self, name: str) -> str:
        p = self.workdir / f"{name}.log"
        return p.read_text(errors="replace")[-2000:] if p.exists() else ""

    def check_alive(self) -> None:
        for name, p in [*self.engines.items(), ("gateway", self.gateway)]:
            if p is not None and p.poll() is not None and name not in self.signalled:
                raise RuntimeError(f"{name} exited with code {p.returncode}:\n{self.log_tail(name)}")

    def wait_ready(self, engines: int, timeout: float) -> None:
        """Until the gateway's /ready counts `engines` live engines."""
        import httpx
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.check_alive()
            try:
                r = httpx.get(self.url + "/ready", timeout=2, trust_env=False)
                if r.json().get("engines", 0) >= engines:
                    return
            except (httpx.HTTPError, ValueError):
                pass
            time.sleep(0.3)
        raise RuntimeError(f"the gateway did not see {engines} engines within {timeout:.0f} s (logs: {self.workdir})")

    def stop(self) -> None:
        procs = ([self.gateway] if self.gateway else []) + list(self.engines.values())
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)
        if self.redis is not None:
            self.redis.signal(signal.SIGTERM)
            self.redis.proc.wait(10)


def wait_heartbeat(stack: Stack, r, engine_id: str, timeout: float) -> None:
    """Until a new engine has joined Redis (its heartbeat: it reads the request stream)."""
    deadline = time.monotonic() + timeout
    while not r.exists(names.heartbeat_key(engine_id)):
        stack.check_alive()
        if time.monotonic() > deadline:
            raise RuntimeError(f"{engine_id} did not join within {timeout:.0f} s:\n{stack.log_tail(engine_id)}")
        time.sleep(0.2)


def heartbeat(r, engine_id: str) -> dict:
    import msgpack
    raw = r.get(names.heartbeat_key(engine_id))
    return msgpack.unpackb(raw, raw=False) if raw else {}


def fresh_heartbeats(r, engine_ids: list[str], timeout: float = 10.0) -> dict[str, dict]:
    """Each engine's first heartbeat written after now (so it counts everything done before now)."""
    after, deadline = time.time(), time.monotonic() + timeout
    out: dict[str, dict] = {}
    while len(out) < len(engine_ids) and time.monotonic() < deadline:
        for e in engine_ids:
            hb = heartbeat(r, e)
            if hb.get("time", 0) > after:
                out[e] = hb
        time.sleep(0.05)
    missing = set(engine_ids) - set(out)
    if missing:
        raise RuntimeError(f"no fresh heartbeat from {sorted(missing)} within {timeout:.0f} s")
    return out


# ---------------------------------------------------------------------- observation
class ReplyTap:
    """The bench's own subscriber on every gateway reply channel: each delta with its arrival time
    and engine, and which engine admitted which request."""

    def __init__(self, redis_url: str):
        import redis
        self.ps = redis.Redis.from_url(redis_url).pubsub(ignore_subscribe_messages=True)
        self.ps.psubscribe(names.reply_channel("*"))
        self.deltas: list[tuple[float, str, object]] = []        # (monotonic, engine id, Delta)
        self.admitted: dict[str, str] = {}                        # first-attempt request id -> engine
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="reply-tap", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        from shared.protocol import ProtocolError, TokenBatch, decode
        while not self._stop.is_set():
            m = self.ps.get_message(timeout=0.05)
            if not m or m["type"] != "pmessage":
                continue
            now = time.monotonic()
            try:
                msg = decode(m["data"])
            except ProtocolError:
                continue
            if isinstance(msg, TokenBatch):
                for rid in msg.admitted:
                    if "~" not in rid:
                        self.admitted.setdefault(rid, msg.engine_id)
                self.deltas.extend((now, msg.engine_id, d) for d in msg.deltas)

    def of(self, origin: str) -> list[tuple[float, str, object]]:
        return [x for x in list(self.deltas) if x[2].request_id.split("~")[0] == origin]

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)
        self.ps.close()


@dataclass(slots=True)
class Stream:
    """One client stream: every SSE chunk's arrival (monotonic) and text, and how it ended."""
    request_id: str = ""
    chunks: list[tuple[float, str]] = field(default_factory=list)
    done: bool = False
    finish: str | None = None
    usage: dict | None = None
    errors: list = field(default_factory=list)

    @property
    def text(self) -> str:
        return "".join(t for _, t in self.chunks)


async def stream_one(client, prompt: list[int], max_tokens: int) -> Stream:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    s = Stream()
    try:
        async with client.stream("POST", "/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                s.errors.append(f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}")
                return s
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    s.done = True
                    continue
                ev = json.loads(data)
                if "error" in ev:
                    s.errors.append(ev["error"])
                    continue
                s.request_id = ev.get("id", s.request_id)
                s.usage = ev.get("usage") or s.usage
                for c in ev.get("choices", []):
                    s.chunks.append((time.monotonic(), c["text"]))
                    s.finish = c["finish_reason"] or s.finish
    except Exception as e:          # recorded, and counted as an error in the report
        s.errors.append(f"{type(e).__name__}: {e}")
    return s


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q / 100 * (len(xs) - 1))))]


# ---------------------------------------------------------------------- one round
@dataclass(slots=True)
class Round:
    name: str                                   # SIGKILL or SIGTERM
    victim: str = ""
    placed: dict = field(default_factory=dict)  # engine -> requests it admitted
    moved: int = 0
    next_token_redis_s: list = field(default_factory=list)
    next_token_client_s: list = field(default_factory=list)
    victim_exit_s: float | None = None
    streams_ok: int = 0
    stream_problems: list = field(default_factory=list)
    recomputed_from_deltas: int = 0             # continuations' prompt tokens computed (prompt - cached)
    continuation_prompt_tokens: int = 0
    continuation_cached_tokens: int = 0
    delivered_before_move: int = 0
    recomputed_from_engines: int = 0            # survivors' prefix lookups - hits, less their originals
    claimed_entries_run: int = 0
    handed_back: int = 0
    preemptions: int = 0
    tokens: dict = field(default_factory=dict)  # request id -> every token id, in order (all attempts)
    order: list = field(default_factory=list)   # request ids in prompt order


async def run_round(stack: Stack, tap: ReplyTap, r, rnd: Round, prompts: list[list[int]], args) -> Round:
    import httpx
    live = [e for e, p in stack.engines.items() if p.poll() is None]
    before = fresh_heartbeats(r, live)
    async with httpx.AsyncClient(base_url=stack.url, trust_env=False, timeout=args.timeout,
                                 limits=httpx.Limits(max_connections=len(prompts))) as client:
        tasks = [asyncio.create_task(stream_one(client, p, args.max_tokens)) for p in prompts]
        ids = await wait_streaming(tasks, tap, args)
        rnd.placed = dict(Counter(tap.admitted[i] for i in ids))
        rnd.victim = max(rnd.placed, key=rnd.placed.get)
        sig = signal.SIGKILL if rnd.name == "SIGKILL" else signal.SIGTERM
        stack.signalled.add(rnd.victim)
        stack.engines[rnd.victim].send_signal(sig)
        t_sig = time.monotonic()
        exited = asyncio.ensure_future(exit_time(stack.engines[rnd.victim], t_sig))   # watched from now on
        print(f"{rnd.name} -> {rnd.victim} (placed {rnd.placed})", flush=True)
        streams = await asyncio.gather(*tasks)
    rnd.order = [s.request_id for s in streams]
    rnd.victim_exit_s = await exited
    survivors = [e for e in live if e != rnd.victim]
    await no_pending_entries(r, names.request_stream(Path(stack.model).name), args.timeout)
    after = fresh_heartbeats(r, survivors)
    measure(rnd, tap, streams, ids, t_sig, args)
    engine_accounting(rnd, tap, ids, before, after, survivors)
    return rnd


async def wait_streaming(tasks, tap: ReplyTap, args) -> list[str]:
    """Until every request of the round has --signal-after tokens; returns their request ids."""
    deadline = time.monotonic() + args.timeout
    while time.monotonic() < deadline:
        fresh = [rid for rid in tap.admitted if rid not in args.seen]
        counts = Counter()
        for _, _, d in list(tap.deltas):
            counts[d.request_id.split("~")[0]] += len(d.token_ids)
        if len(fresh) == len(tasks) and all(counts[rid] >= args.signal_after for rid in fresh):
            args.seen.update(fresh)
            return fresh
        done = [t for t in tasks if t.done()]
        if done:
            raise RuntimeError(f"a stream ended before the signal: {done[0].result()}")
        await asyncio.sleep(0.01)
    raise RuntimeError("the streams did not reach --signal-after tokens in time")


async def no_pending_entries(r, stream: str, timeout: float) -> None:
    """Until no stream entry is pending: a SIGKILLed engine's originals stay pending until a
    survivor's janitor claims them (idle claim_idle_ms, 10 s) and hands them back; the counts wait
    for that, so a claimed entry that ran would show."""
    deadline = time.monotonic() + timeout
    while r.xpending(stream, names.ENGINE_GROUP)["pending"] and time.monotonic() < deadline:
        await asyncio.sleep(0.2)


async def exit_time(proc: subprocess.Popen, t_sig: float) -> float | None:
    for _ in range(300):
        if proc.poll() is not None:
            return None if proc.returncode == -signal.SIGKILL else time.monotonic() - t_sig
        await asyncio.sleep(0.05)
    return None


def measure(rnd: Round, tap: ReplyTap, streams: list[Stream], ids: list[str], t_sig: float, args) -> None:
    """Per moved request: signal -> its first continuation delta (Redis) and the SSE chunk that
    carried it (client); and every stream's checks."""
    by_id = {s.request_id: s for s in streams}
    for rid in ids:
        ds = tap.of(rid)
        rnd.tokens[rid] = [t for _, _, d in ds for t in d.token_ids]
        s = by_id.get(rid)
        problems = check_stream(s, ds, args.max_tokens)
        if problems:
            rnd.stream_problems.append({"request_id": rid, "problems": problems})
        else:
            rnd.streams_ok += 1
        cont = [(t, d) for t, eng, d in ds if "~" in d.request_id]
        if not cont:
            continue
        rnd.moved += 1
        t_next = min(t for t, d in cont if d.token_ids)
        rnd.next_token_redis_s.append(t_next - t_sig)
        if s is not None:
            later = [t for t, _ in s.chunks if t >= t_next]
            if later:
                rnd.next_token_client_s.append(later[0] - t_sig)
        end = next(d for _, d in cont if d.finish_reason is not None)
        rnd.continuation_prompt_tokens += end.num_prompt_tokens or 0
        rnd.continuation_cached_tokens += end.num_cached_tokens or 0
        rnd.recomputed_from_deltas += (end.num_prompt_tokens or 0) - (end.num_cached_tokens or 0)
        rnd.delivered_before_move += sum(len(d.token_ids) for _, _, d in ds if "~" not in d.request_id)


def check_stream(s: Stream | None, ds: list, max_tokens: int) -> list[str]:
    out = []
    if s is None:
        return ["no client stream carries this id"]
    if s.errors:
        out.append(f"errors: {s.errors[:2]}")
    if not s.done:
        out.append("no [DONE]")
    if s.finish != "length" or not s.usage or s.usage.get("completion_tokens") != max_tokens:
        out.append(f"finish {s.finish}, usage {s.usage}")
    seqs = [d.seq for _, _, d in ds]
    if seqs != list(range(len(seqs))):
        out.append(f"sequence numbers repeat or skip: {seqs}")
    if sum(len(d.token_ids) for _, _, d in ds) != max_tokens:
        out.append("token count on the reply channel differs from max_tokens")
    return out


def engine_accounting(rnd: Round, tap: ReplyTap, ids: list[str], before: dict, after: dict,
                      survivors: list[str]) -> None:
    """From the survivors' own heartbeats: prompt tokens they prefilled beyond their originals,
    and whether they ran any claimed entry."""
    originals = [rid for rid in ids if tap.admitted[rid] in survivors]
    own_prefill = 0
    for rid in originals:
        end = next(d for _, _, d in tap.of(rid) if d.finish_reason is not None and "~" not in d.request_id)
        own_prefill += (end.num_prompt_tokens or 0) - (end.num_cached_tokens or 0)
    delta = Counter()
    for e in survivors:
        b, a = before[e], after[e]
        delta["prefilled"] += (a["prefix_cache_queries"] - a["prefix_cache_hits"]) - (
            b["prefix_cache_queries"] - b["prefix_cache_hits"])
        delta["preemptions"] += a["num_preemptions"] - b["num_preemptions"]
        for k in ("requests", "continuations", "handed_back"):
            delta[k] += a.get("counters", {}).get(k, 0) - b.get("counters", {}).get(k, 0)
    rnd.recomputed_from_engines = delta["prefilled"] - own_prefill
    rnd.claimed_entries_run = delta["requests"] - delta["continuations"] - len(originals)
    rnd.handed_back = delta["handed_back"]
    rnd.preemptions = delta["preemptions"]


# ---------------------------------------------------------------------- reference and prompts
def make_prompts(model: str, n: int, offset: int) -> list[list[int]]:
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(model)
    return [tok.encode(f"Tell a long story about {TOPICS[(offset + i) % len(TOPICS)]}, part {offset + i}.")
            for i in range(n)]


def reference_tokens(model: str, prompts: list[list[int]], args) -> list[list[int]]:
    """The uninterrupted greedy run: the offline engine in this process (after the served rounds)."""
    from engine_worker import LLM, SamplingParams
    llm = LLM(model, num_threads=args.num_threads, dtype=args.dtype)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True))
    return [list(c.token_ids) for c in outs]


# ---------------------------------------------------------------------- report
def summary(rnd: Round) -> dict:
    d = asdict(rnd)
    d.pop("tokens")
    d.pop("order")
    for key in ("next_token_redis_s", "next_token_client_s"):
        xs = d.pop(key)
        d[key] = {"p50": pct(xs, 50), "p99": pct(xs, 99), "max": max(xs, default=None), "n": len(xs),
                  "each": [round(x, 3) for x in sorted(xs)]}
    d["goal_s"] = GOALS_S[rnd.name]
    d["goal_met"] = bool(rnd.next_token_client_s) and max(rnd.next_token_client_s) <= GOALS_S[rnd.name]
    return d


def render(rep: dict) -> str:
    a = rep["args"]
    f = lambda v: "-" if v is None else f"{v:.2f}"  # noqa: E731
    lines = [f"# Failover: {rep['model']}, {a['num_requests']} streams per round", "",
             f"`{rep['command']}`", "",
             f"Two engines ({a['num_threads']} torch thread(s) each, dtype {a.get('dtype', 'auto')}) and one "
             f"gateway, shipped settings (heartbeat {HEARTBEAT_S:g} s, failover_timeout {FAILOVER_S:g} s), on {rep['cpu']} ({rep['cores']} cores, load average "
             f"{rep['load_avg_before']} before); {rep['date']}. Each round: {a['num_requests']} concurrent greedy "
             f"streaming /v1/completions requests of {a['max_tokens']} tokens (ignore_eos); once every stream has "
             f"{a['signal_after']} tokens, the engine serving most of them gets the signal. Round 2 first starts "
             "a replacement engine, so two run. Next token: signal -> the continuation's first token, on Redis "
             "(the bench's subscriber) and at the client (the SSE chunk that carries it).", "",
             "| signal | moved / placed on the victim | next token p50 / p99 / max s (client) | same, Redis | goal | victim "
             "exit s | streams ok | tokens computed twice |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for s in rep["rounds"]:
        c, rd = s["next_token_client_s"], s["next_token_redis_s"]
        goal = f"<= {s['goal_s']:.0f} s: {'met' if s['goal_met'] else 'MISSED'}"
        lines.append(f"| {s['name']} | {s['moved']} / {s['placed'][s['victim']]} on {s['victim']} | {f(c['p50'])} / {f(c['p99'])} / "
                     f"{f(c['max'])} | {f(rd['p50'])} / {f(rd['p99'])} / {f(rd['max'])} | {goal} | "
                     f"{f(s['victim_exit_s'])} | {s['streams_ok']}/{a['num_requests']} | "
                     f"{s['recomputed_from_deltas']} |")
    lines += ["", "**Tokens computed twice**, per round: the continuations' prompts (original prompt + the "
              "tokens delivered before the move) that the survivor prefilled, less its prefix-cache hits:"]
    for s in rep["rounds"]:
        lines.append(f"- {s['name']}: {s['moved']} continuations, {s['continuation_prompt_tokens']} prompt tokens "
                     f"({s['delivered_before_move']} of them delivered output), {s['continuation_cached_tokens']} "
                     f"from the prefix cache -> **{s['recomputed_from_deltas']}** prefilled again (the survivors' "
                     f"own counters: {s['recomputed_from_engines']}; preemptions {s['preemptions']}). Claimed "
                     f"entries run twice: {s['claimed_entries_run']} ({s['handed_back']} handed back by the "
                     "janitors).")
    lines += ["", "Not counted: after a SIGKILL, the tokens the victim had computed but not yet published (its "
              "step in flight and the batch being sent: at most 2 per moved request), invisible from outside. "
              "SIGTERM publishes every computed token before its handoff. A continuation's prompt is prefilled "
              "in chunks, batched with the survivor's decodes, not decoded again token by token.", ""]
    ref = rep.get("reference")
    if ref:
        lines.append(f"**Equal to an uninterrupted run** (offline engine, same prompts, greedy): "
                     f"{ref['equal']}/{ref['compared']} streams token for token.")
    problems = [p for s in rep["rounds"] for p in s["stream_problems"]]
    if problems:
        lines.append(f"**Stream problems**: `{json.dumps(problems)[:1500]}`")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------- main
def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="", help="model directory (default: SmolLM2, as kaiten up; --quick: tiny)")
    ap.add_argument("--quick", action="store_true", help="tiny random model, steps slowed to 20 ms: checks the bench")
    ap.add_argument("--num-requests", type=int, default=8, help="concurrent streams per round")
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--signal-after", type=int, default=32, help="tokens every stream has before the signal")
    ap.add_argument("--num-threads", type=int, default=1, help="torch threads per engine (two share the cores)")
    ap.add_argument("--dtype", default="auto", help="the engines' and the reference's dtype (float32: greedy "
                    "output is batch-independent, so every stream can equal the uninterrupted run)")
    ap.add_argument("--step-delay", type=float, default=None, help="slow every engine step to this many s "
                    "(tests/support/slow_engine.py; --quick: 0.02)")
    ap.add_argument("--no-reference", action="store_true", help="skip the uninterrupted offline run")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per round")
    ap.add_argument("--ready-timeout", type=float, default=600.0)
    ap.add_argument("--out", default="", help="output prefix (default bench/results/failover/failover[.quick])")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not 0 < args.signal_after < args.max_tokens or args.num_requests < 1:
        raise SystemExit("need --num-requests >= 1 and 0 < --signal-after < --max-tokens")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))      # run the finally: stop the children
    tmp = None
    if args.quick and not args.model:
        from tests.support.tiny_model import build_tiny_model
        tmp = tempfile.mkdtemp(prefix="kaiten-bench-tiny-")
        args.model = str(build_tiny_model(Path(tmp) / "tiny"))
    elif not args.model:
        from shared.gguf_convert import ensure_default_model
        args.model = str(ensure_default_model())
    args.step_delay = args.step_delay if args.step_delay is not None else (0.02 if args.quick else 0.0)
    args.seen = set()
    out = Path(args.out or RESULTS / ("failover.quick" if args.quick else "failover"))
    cmd = "python bench/serving/failover.py " + " ".join(sys.argv[1:] if argv is None else argv)
    rep = {"command": cmd.strip(), "model": Path(args.model).name, "cpu": cpu_name(), "cores": os.cpu_count(),
           "load_avg_before": load_avg(), "date": time.strftime("%Y-%m-%d %H:%M"),
           "args": {k: v for k, v in vars(args).items() if k != "seen"}, "rounds": []}
    stack = Stack(args.model, args.num_threads, args.step_delay, args.dtype)
    print(f"logs: {stack.workdir}", flush=True)
    try:
        rep["rounds"], prompts, tokens = run_rounds(stack, args)
        stack.stop()
        if not args.no_reference:
            ref = reference_tokens(args.model, prompts, args)
            rep["reference"] = {"compared": len(ref), "equal": sum(a == b for a, b in zip(tokens, ref))}
    finally:
        stack.stop()
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
    rep["load_avg_after"] = load_avg()
    out.parent.mkdir(parents=True, exist_ok=True)
    # Not with_suffix: it would turn "<name>.quick" into "<name>.json", the full run's results.
    Path(f"{out}.json").write_text(json.dumps(rep, indent=1))
    Path(f"{out}.md").write_text(render(rep))
    print(render(rep))
    ok = all(s["streams_ok"] == args.num_requests for s in rep["rounds"])
    return 0 if ok and rep.get("reference", {}).get("equal", 0) == rep.get("reference", {}).get("compared", 0) else 1


def run_rounds(stack: Stack, args) -> tuple[list[dict], list[list[int]], list[list[int]]]:
    """Round 1 (SIGKILL) and round 2 (SIGTERM, after a replacement joined); returns the round
    summaries, every prompt and every stream's tokens, in order."""
    r = stack.start_two_engines(args.ready_timeout)
    tap = ReplyTap(stack.redis_url)
    rounds, all_prompts, all_tokens = [], [], []
    try:
        for i, (name, replacement) in enumerate((("SIGKILL", None), ("SIGTERM", "eng-c"))):
            if replacement:
                stack.start_engine(replacement)
                wait_heartbeat(stack, r, replacement, args.ready_timeout)
            prompts = make_prompts(args.model, args.num_requests, i * args.num_requests)
            rnd = asyncio.run(run_round(stack, tap, r, Round(name), prompts, args))
            rounds.append(summary(rnd))
            all_prompts += prompts
            all_tokens += [rnd.tokens.get(rid, []) for rid in rnd.order]
            c = rounds[-1]["next_token_client_s"]
            print(f"{name}: {rnd.moved} moved, next token p50 {c['p50']} max {c['max']} s, "
                  f"{rnd.streams_ok}/{len(prompts)} streams ok", flush=True)
    finally:
        tap.close()
    return rounds, all_prompts, all_tokens


if __name__ == "__main__":
    sys.exit(main())
