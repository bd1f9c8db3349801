"""Serving benchmark: Poisson arrivals against the gateway's streaming /v1/completions.

Runs `kaiten up` as it ships (a subprocess: its own redis-server, one engine, one gateway that
tokenizes in-process; engine settings through KAITEN_* variables), or uses a running gateway with
--url, then measures, per request rate, TTFT, inter-token latency (gaps
between SSE chunks), TPOT and end-to-end latency (p50/p99), output tokens/s and errors. The
workload is bench/engine/engine_throughput.py's (prompts uniform 32..512 random token ids, outputs
uniform 16..256 with ignore_eos, greedy); each phase draws its own prompts (seed + phase), so the
engine's prefix cache never serves one phase from another. The "inf" phase sends all requests at
once with the same prompts as the offline engine (`engine_worker.LLM`, same engine settings), which
runs in this process right before it and again right after it (the machine is shared: the mean of
the two cancels a drift of the other load): saturation throughput / offline throughput is the
served system's efficiency.

The first-token goal (TTFT <= the engine step that computed the first token + 20 ms) is checked per
request with the engine's own event times, which the bench reads by subscribing to every reply
channel (kaiten:replies:*): step = first_token - scheduled (engine clock; same host, same wall
clock). "idle" is a probe phase that sends requests one at a time, so each one finds the engine
idle; the Poisson phases report the same fraction under load.

    .venv/bin/python bench/serving/serve.py                      # SmolLM2, 64 requests, rates 0.5,1,2,4,inf
    .venv/bin/python bench/serving/serve.py --quick              # tiny random model, 16 requests, seconds
    .venv/bin/python bench/serving/serve.py --num-requests 32 --rates 1,2,inf
    .venv/bin/python bench/serving/serve.py --url http://127.0.0.1:8000 --model DIR [--redis-url URL]

Writes {out}.md, {out}.json and {out}.png (default bench/results/serve/serve; --quick: serve.quick).
"""
from __future__ import annotations

import argparse
import asyncio
import gc
import importlib.util
import json
import math
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.common.machine import cpu_name  # noqa: E402
from bench.common.results_files import results_dir  # noqa: E402
from shared import names  # noqa: E402
from shared.launcher import free_port  # noqa: E402

GOAL_SLACK_S = 0.020          # first token within one engine step plus 20 ms
REDIS_RE = re.compile(r"redis at (redis://\S+)")
STEP_RE = re.compile(r"engine\.step n=(\d+) mean=(\d+)us p50=(\d+)us p99=(\d+)us max=(\d+)us")


# ---------------------------------------------------------------------- the system under test
@dataclass(slots=True)
class System:
    """`kaiten up` as it ships (its own redis-server, one engine, one gateway tokenizing in-process),
    as a subprocess; engine settings through the KAITEN_* environment its children read. Its
    output (every child's log) goes to one file under a temporary directory."""
    model: str
    num_threads: int
    env: dict[str, str]
    workdir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="kaiten-bench-serve-")))
    proc: subprocess.Popen | None = None
    redis_url: str = ""
    url: str = ""

    @property
    def log_path(self) -> Path:
        return self.workdir / "kaiten-up.log"

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def start(self, ready_timeout: float) -> None:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
                   PYTHONUNBUFFERED="1", **self.env)
        env.pop("REDIS_URL", None)               # kaiten up starts its own Redis
        env.pop("TOKENIZER_URL", None)
        if self.num_threads > 0:
            env["OMP_NUM_THREADS"] = str(self.num_threads)
            env["KAITEN_NUM_THREADS"] = str(self.num_threads)
        port = free_port()
        with open(self.log_path, "wb") as logf:
            self.proc = subprocess.Popen([sys.executable, "-m", "shared.cli", "up", "--model", self.model,
                                          "--port", str(port), "--ready-timeout", str(ready_timeout)],
                                         env=env, stdin=subprocess.DEVNULL, stdout=logf, stderr=subprocess.STDOUT,
                                         cwd=ROOT, start_new_session=True)   # Ctrl-C reaches only the bench
        self.url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + ready_timeout
        while "Kaiten is up" not in self.log_text():
            if self.proc.poll() is not None:
                raise RuntimeError(f"kaiten up exited with code {self.proc.returncode}:\n{self.log_text()[-3000:]}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"kaiten up was not ready within {ready_timeout:.0f} s (log: {self.log_path})")
            time.sleep(0.5)
        m = REDIS_RE.search(self.log_text())
        self.redis_url = m.group(1) if m else ""

    def stop(self, timeout: float = 60.0) -> None:
        """Ctrl-C, as a user stops it: the gateway, then the engine (it logs its step times), then Redis."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)

    def engine_step_report(self) -> dict | None:
        """The worker's last 'engine.step' summary (logged every minute and when it stops)."""
        matches = STEP_RE.findall(self.log_text())
        if not matches:
            return None
        n, mean, p50, p99, mx = map(int, matches[-1])
        return {"count": n, "mean_ms": mean / 1e3, "p50_ms": p50 / 1e3, "p99_ms": p99 / 1e3, "max_ms": mx / 1e3}

    def log_lines(self) -> int:
        return len(self.log_text().splitlines())


class ReplyTap:
    """Reads every engine reply (kaiten:replies:*) to learn each request's engine event times."""

    def __init__(self, redis_url: str):
        from shared.redis_conn import redis_client
        self.client = redis_client(redis_url, socket_timeout=None, retries=0)
        self.pubsub = self.client.pubsub(ignore_subscribe_messages=True)
        self.pubsub.psubscribe(names.reply_channel("*"))
        self.engine_times: dict[str, dict[str, float]] = {}   # request id -> queued/scheduled/first_token
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="reply-tap", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        from shared.protocol import ProtocolError, TokenBatch, decode
        while not self._stop.is_set():
            msg = self.pubsub.get_message(timeout=0.2)
            if msg is None or msg.get("type") != "pmessage":
                continue
            try:
                batch = decode(msg["data"])
            except ProtocolError:
                continue
            if isinstance(batch, TokenBatch):
                for d in batch.deltas:
                    if d.metrics:                 # the terminal delta carries the event times
                        self.engine_times[d.request_id] = dict(d.metrics)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2.0)
        self.pubsub.close()
        self.client.close()


# ---------------------------------------------------------------------- the client
@dataclass(slots=True)
class Result:
    index: int
    prompt_len: int
    max_tokens: int
    request_id: str = ""
    sent_wall: float = 0.0           # time.time() when the request was sent
    ttft_s: float = math.nan
    e2e_s: float = math.nan
    chunk_gaps_s: list[float] = field(default_factory=list)
    output_tokens: int = 0
    cached_tokens: int = 0
    error: str | None = None

    @property
    def tpot_s(self) -> float:
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1) if self.output_tokens > 1 else math.nan


async def send_one(client, model: str, index: int, prompt: list[int], max_tokens: int, at: float) -> Result:
    import httpx
    await asyncio.sleep(max(0.0, at - time.perf_counter()))
    res = Result(index, len(prompt), max_tokens)
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0.0,
            "stream": True, "stream_options": {"include_usage": True}}
    res.sent_wall = time.time()
    t0 = last = time.perf_counter()
    done = False
    try:
        async with client.stream("POST", "/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")
                res.error = f"HTTP {resp.status_code}: {text[:200]}"
                return res
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    done = True
                    break
                obj = json.loads(data)
                if "error" in obj:
                    res.error = f"stream error: {obj['error'].get('message', obj['error'])}"[:200]
                    return res
                res.request_id = obj.get("id", res.request_id)
                if obj.get("usage"):
                    res.output_tokens = obj["usage"]["completion_tokens"]
                    res.cached_tokens = obj["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0)
                if obj.get("choices"):
                    now = time.perf_counter()
                    if math.isnan(res.ttft_s):
                        res.ttft_s = now - t0
                    else:
                        res.chunk_gaps_s.append(now - last)
                    last = now
    except (httpx.HTTPError, ValueError) as e:
        res.error = f"{type(e).__name__}: {e}"[:200]
        return res
    res.e2e_s = time.perf_counter() - t0
    if not done:
        res.error = "the stream ended without [DONE]"
    elif res.output_tokens != max_tokens:
        res.error = f"{res.output_tokens} output tokens, expected {max_tokens}"
    return res


def arrival_offsets(n: int, rate: float, seed: int) -> list[float]:
    """Poisson process: exponential gaps with mean 1/rate; rate inf sends everything at once."""
    if math.isinf(rate):
        return [0.0] * n
    rng, t, out = random.Random(seed), 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


def _client(url: str, timeout: float):
    import httpx
    return httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(timeout, connect=10.0),
                             limits=httpx.Limits(max_connections=None, max_keepalive_connections=None))


async def run_poisson(url: str, model: str, reqs, rate: float, seed: int, timeout: float) -> tuple[list[Result], float]:
    """All requests on a Poisson schedule; returns the results and the phase's wall time."""
    async with _client(url, timeout) as client:
        start = time.perf_counter() + 0.05
        tasks = [asyncio.create_task(send_one(client, model, i, p, n, start + off))
                 for i, ((p, n), off) in enumerate(zip(reqs, arrival_offsets(len(reqs), rate, seed)))]
        done, pending = await asyncio.wait(tasks, timeout=timeout)
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        wall = time.perf_counter() - start
    results = []
    for i, t in enumerate(tasks):
        if t in done and t.exception() is None:
            results.append(t.result())
        else:
            err = "phase timeout" if t in pending else f"{type(t.exception()).__name__}: {t.exception()}"
            results.append(Result(i, len(reqs[i][0]), reqs[i][1], error=err))
    return results, wall


async def run_sequential(url: str, model: str, reqs, timeout: float) -> tuple[list[Result], float]:
    """One request at a time: each finds the engine idle."""
    out = []
    async with _client(url, timeout) as client:
        start = time.perf_counter()
        for i, (p, n) in enumerate(reqs):
            out.append(await send_one(client, model, i, p, n, 0.0))
            await asyncio.sleep(0.05)
        return out, time.perf_counter() - start


# ---------------------------------------------------------------------- statistics
def pct(xs: list[float], q: float) -> float:
    import numpy as np
    xs = [x for x in xs if not math.isnan(x)]
    return float(np.percentile(xs, q)) if xs else math.nan


def goal_check(results: list[Result], engine_times: dict[str, dict]) -> dict:
    """Per request: TTFT <= (engine first_token - scheduled) + 20 ms, and where the TTFT went."""
    rows = []
    for r in results:
        t = engine_times.get(r.request_id)
        if r.error or not t or not t.get("scheduled") or not t.get("first_token"):
            continue
        step = t["first_token"] - t["scheduled"]
        rows.append({"ttft": r.ttft_s, "step": step, "to_engine": t["queued"] - r.sent_wall,
                     "wait": t["scheduled"] - t["queued"], "delivery": r.sent_wall + r.ttft_s - t["first_token"],
                     "met": r.ttft_s <= step + GOAL_SLACK_S})
    if not rows:
        return {"measured": 0}
    med = {k: pct([x[k] for x in rows], 50) for k in ("step", "to_engine", "wait", "delivery")}
    met = sum(x["met"] for x in rows)
    return {"measured": len(rows), "met": met, "fraction": met / len(rows),
            "median_step_ms": med["step"] * 1e3, "median_to_engine_ms": med["to_engine"] * 1e3,
            "median_wait_ms": med["wait"] * 1e3, "median_delivery_ms": med["delivery"] * 1e3,
            "median_overhead_ms": pct([x["ttft"] - x["step"] for x in rows], 50) * 1e3,
            "p99_overhead_ms": pct([x["ttft"] - x["step"] for x in rows], 99) * 1e3}


def summarize(name: str, rate: float | None, results: list[Result], wall: float, engine_times: dict | None) -> dict:
    ok = [r for r in results if r.error is None]
    errors: dict[str, int] = {}
    for r in results:
        if r.error is not None:
            key = r.error.split(":")[0]
            errors[key] = errors.get(key, 0) + 1
    tokens = sum(r.output_tokens for r in ok)
    gaps = [g for r in ok for g in r.chunk_gaps_s]
    s = {"phase": name, "rate": None if rate is None else "inf" if math.isinf(rate) else rate,
         "requests": len(results), "completed": len(ok), "errors": len(results) - len(ok), "error_kinds": errors,
         "wall_s": wall, "output_tokens": tokens,
         "output_tokens_per_s": tokens / wall if wall > 0 else 0.0,
         "requests_per_s": len(ok) / wall if wall > 0 else 0.0,
         "cached_prompt_tokens": sum(r.cached_tokens for r in ok)}
    for key, xs in (("ttft", [r.ttft_s for r in ok]), ("itl", gaps), ("tpot", [r.tpot_s for r in ok]),
                    ("e2e", [r.e2e_s for r in ok])):
        s[f"{key}_p50_ms"], s[f"{key}_p99_ms"] = pct(xs, 50) * 1e3, pct(xs, 99) * 1e3
    s["goal"] = goal_check(ok, engine_times) if engine_times is not None else {"measured": 0}
    return s


# ---------------------------------------------------------------------- the offline baseline
def run_offline(model: str, reqs, args) -> dict:
    from engine_throughput import run_kaiten
    from engine_worker import LLM, SamplingParams
    llm = LLM(model, dtype="auto", num_threads=args.num_threads, kv_cache_memory=args.kv_cache_memory,
              max_num_batched_tokens=args.max_num_batched_tokens)
    llm.generate([reqs[0][0][:64]], SamplingParams(temperature=0, max_tokens=4))       # warm-up
    out = run_kaiten(llm, reqs)
    out["tokens_per_s"] = out["output_tokens"] / out["wall_s"]
    out["dtype"] = str(llm.engine.runner.dtype).removeprefix("torch.")
    print(f"offline engine: {out['tokens_per_s']:.1f} tok/s ({out['wall_s']:.1f} s)", flush=True)
    del llm
    gc.collect()
    return out


# ---------------------------------------------------------------------- report
def _f(v: float, digits: int = 0) -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.{digits}f}"


def render(res: dict) -> str:
    a = res["args"]
    lines = [f"# Serving benchmark: {res['model']}, {a['num_requests']} requests per rate", "",
             f"`{res['command']}`", "",
             f"One engine worker (dtype {res.get('dtype', 'auto')}, {a['num_threads']} torch thread(s), "
             f"KV {a['kv_cache_memory']}, {a['max_num_batched_tokens']} tokens per step) and one gateway on "
             f"{res['cpu_count']} CPU cores shared with the client, Redis and other work; {res['date']}.",
             "Workload: prompts uniform 32..512 random token ids, outputs uniform 16..256 (ignore_eos, greedy), "
             "streamed from /v1/completions; Poisson arrivals; `inf` sends all at once. ITL: gaps between SSE "
             "chunks; TPOT: (e2e - TTFT) / (tokens - 1).", "",
             "| rate req/s | done | errors | wall s | out tok/s | TTFT p50 / p99 ms | ITL p50 / p99 ms | "
             "TPOT p50 / p99 ms | E2E p50 / p99 s | TTFT <= step + 20 ms |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for s in res["phases"]:
        g = s["goal"]
        goal = f"{g['met']}/{g['measured']} ({100 * g['fraction']:.0f}%)" if g.get("measured") else "-"
        label = "idle (one at a time)" if s["phase"] == "idle" else str(s["rate"])
        lines.append(f"| {label} | {s['completed']}/{s['requests']} | {s['errors']} | {s['wall_s']:.1f} | "
                     f"{s['output_tokens_per_s']:.1f} | {_f(s['ttft_p50_ms'])} / {_f(s['ttft_p99_ms'])} | "
                     f"{_f(s['itl_p50_ms'], 1)} / {_f(s['itl_p99_ms'], 1)} | {_f(s['tpot_p50_ms'], 1)} / "
                     f"{_f(s['tpot_p99_ms'], 1)} | {_f(s['e2e_p50_ms'] / 1e3, 2)} / {_f(s['e2e_p99_ms'] / 1e3, 2)} | "
                     f"{goal} |")
    off, sat = res.get("offline"), res.get("saturation")
    lines.append("")
    if off:
        each = ", ".join(f"{r['tokens_per_s']:.1f}" for r in off["runs"])
        lines.append(f"**Offline engine** (`engine_worker.LLM` in the bench process, same engine settings, the "
                     f"prompts of `inf`, a cold prefix cache; {len(off['runs'])} run(s), one right before `inf` and "
                     f"the rest right after): {off['tokens_per_s']:.1f} output tok/s (runs: {each}; "
                     f"{off['output_tokens']} tokens, {off['steps']} steps).")
    if sat:
        verdict = "meets" if sat["ratio"] >= 0.95 else "misses"
        lines.append(f"**Gateway saturation / offline**: {sat['served_tokens_per_s']:.1f} / "
                     f"{sat['offline_tokens_per_s']:.1f} = **{100 * sat['ratio']:.1f}%** ({verdict} the >= 95% goal).")
    if res.get("log_lines_per_request") is not None:
        lines.append(f"**Log lines per request** (all of `kaiten up`'s output at its default level, during the "
                     f"measured phases): {res['log_lines_per_request']:.2f}.")
    idle = next((s for s in res["phases"] if s["phase"] == "idle"), None)
    if idle and idle["goal"].get("measured"):
        g = idle["goal"]
        lines += ["", f"**First token within one engine step + 20 ms (idle engine)**: {g['met']}/{g['measured']} "
                      f"requests ({100 * g['fraction']:.0f}%). Medians: the step that computed the first token "
                      f"{g['median_step_ms']:.1f} ms; TTFT minus that step {g['median_overhead_ms']:.1f} ms "
                      f"(p99 {g['p99_overhead_ms']:.1f} ms) ~ client to engine admission "
                      f"{g['median_to_engine_ms']:.1f} ms "
                      f"(gateway, Redis, the engine's loop) + engine queue {g['median_wait_ms']:.1f} ms + engine "
                      f"token to client {g['median_delivery_ms']:.1f} ms. Step = engine `first_token - scheduled` "
                      f"from the terminal "
                      f"delta, read on Redis pub/sub; prompts of the workload, max_tokens {a['probe_max_tokens']}."]
    steps = res.get("engine_step")
    if steps:
        lines += ["", f"Engine worker `engine.step` over its last {steps['count']} steps (worker log): "
                      f"p50 {steps['p50_ms']:.1f} ms, p99 {steps['p99_ms']:.1f} ms, max {steps['max_ms']:.1f} ms."]
    errs = {s["phase"]: s["error_kinds"] for s in res["phases"] if s["error_kinds"]}
    if errs:
        lines += ["", f"Errors by kind: `{json.dumps(errs)}`"]
    return "\n".join(lines) + "\n"


def plot(res: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    phases = [s for s in res["phases"] if s["phase"] != "idle"]
    if not phases:
        return
    x = list(range(len(phases)))
    labels = [str(s["rate"]) for s in phases]
    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5))
    ax = axes[0][0]
    ax.plot(x, [s["output_tokens_per_s"] for s in phases], "o-", label="gateway (streaming)")
    if res.get("offline"):
        ax.axhline(res["offline"]["tokens_per_s"], color="gray", ls="--", label="offline engine")
        ax.axhline(0.95 * res["offline"]["tokens_per_s"], color="gray", ls=":", label="95% of offline")
    ax.set_ylabel("output tokens/s")
    ax.legend(fontsize=8)
    for ax, key, title, scale in ((axes[0][1], "ttft", "TTFT (ms)", 1), (axes[1][0], "itl", "inter-token gap (ms)", 1),
                                  (axes[1][1], "e2e", "end-to-end latency (s)", 1e3)):
        ax.plot(x, [s[f"{key}_p50_ms"] / scale for s in phases], "o-", label="p50")
        ax.plot(x, [s[f"{key}_p99_ms"] / scale for s in phases], "s--", label="p99")
        ax.set_ylabel(title)
        ax.legend(fontsize=8)
        if key != "e2e":
            ax.set_yscale("log")
    for ax in axes.flat:
        ax.set_xticks(x, labels)
        ax.set_xlabel("request rate (req/s)")
        ax.grid(alpha=0.3)
    fig.suptitle(f"Kaiten serving: {res['model']}, {res['args']['num_requests']} requests per rate", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------------- main
def no_nan(obj):
    """JSON has no NaN: missing values become null."""
    if isinstance(obj, float) and math.isnan(obj):
        return None
    if isinstance(obj, dict):
        return {k: no_nan(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [no_nan(v) for v in obj]
    return obj


def parse_rates(text: str) -> list[float]:
    rates = []
    for part in text.split(","):
        part = part.strip().lower()
        try:
            r = math.inf if part == "inf" else float(part)
        except ValueError:
            raise SystemExit(f"--rates: {part!r} is neither a number nor 'inf'") from None
        if not r > 0:
            raise SystemExit(f"--rates: {part!r} must be > 0")
        rates.append(r)
    return rates


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="", help="model directory (default: SmolLM2; --quick: a tiny random model)")
    ap.add_argument("--quick", action="store_true", help="tiny random model, 16 requests, rates 2,8,inf, 4 probes")
    ap.add_argument("--num-requests", type=int, default=None, help="requests per rate (default 64; --quick 16)")
    ap.add_argument("--rates", default=None, help="comma-separated req/s, 'inf' = all at once (default 0.5,1,2,4,inf)")
    ap.add_argument("--probe-requests", type=int, default=None,
                    help="idle-engine TTFT probes, one at a time (default 16; --quick 4)")
    ap.add_argument("--probe-max-tokens", type=int, default=8, help="max_tokens of each probe")
    ap.add_argument("--num-threads", type=int, default=1, help="torch threads of the engine and the offline run")
    ap.add_argument("--kv-cache-memory", default="1GiB")
    ap.add_argument("--max-num-batched-tokens", type=int, default=512,
                    help="engine and offline token budget per step (default 512: on a 2-core CPU a 2048-token "
                         "SmolLM2 step takes over 10 s, the gateway's engine timeout)")
    ap.add_argument("--engine-timeout", type=float, default=None, help="the gateway's --engine-timeout (s)")
    ap.add_argument("--seed", type=int, default=0, help="the inf phase and offline run use this workload seed")
    ap.add_argument("--phase-timeout", type=float, default=900.0, help="seconds; unfinished requests count as errors")
    ap.add_argument("--ready-timeout", type=float, default=300.0)
    ap.add_argument("--offline-runs", type=int, default=2,
                    help="offline engine runs of the inf workload: one right before inf, the rest right after "
                         "(0: none)")
    ap.add_argument("--url", default="", help="use this running gateway instead of starting one (needs --model)")
    ap.add_argument("--redis-url", default="", help="with --url: its Redis, to read engine event times")
    ap.add_argument("--out", default="", help="output prefix (default bench/results/serve/serve, --quick serve.quick)")
    return ap


def resolve_args(args: argparse.Namespace) -> argparse.Namespace:
    args.num_requests = args.num_requests or (16 if args.quick else 64)
    args.rates = parse_rates(args.rates or ("2,8,inf" if args.quick else "0.5,1,2,4,inf"))
    args.probe_requests = args.probe_requests if args.probe_requests is not None else (4 if args.quick else 16)
    if args.num_requests < 1 or args.probe_requests < 0 or args.probe_max_tokens < 1 or args.offline_runs < 0:
        raise SystemExit("--num-requests and --probe-max-tokens must be >= 1, --probe-requests and "
                         "--offline-runs >= 0")
    if args.url and not args.model:
        raise SystemExit("--url needs --model (the served model's directory: vocabulary and offline baseline)")
    args.out = Path(args.out or (results_dir(__file__) / ("serve.quick" if args.quick else "serve")))
    if importlib.util.find_spec("matplotlib") is None:      # fail now, not after the whole run
        raise SystemExit("bench/serving/serve.py plots with matplotlib: pip install -e '.[bench]'")
    return args


def model_facts(model_dir: str) -> tuple[int, int]:
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    return int(cfg["vocab_size"]), int(cfg.get("max_position_embeddings") or 0)


async def served_model_name(url: str) -> str:
    async with _client(url, 30.0) as client:
        data = (await client.get("/v1/models")).json()["data"]
    if not data:
        raise RuntimeError(f"{url}/v1/models lists no model (no live engine?)")
    return data[0]["id"]


async def warm_up(url: str, model: str, vocab: int) -> None:
    """Two short requests, so the first measured one does not pay for lazy initialisation."""
    rng = random.Random(-1)
    reqs = [([rng.randrange(3, vocab) for _ in range(40)], 4) for _ in range(2)]
    results, _ = await run_sequential(url, model, reqs, 120.0)
    bad = [r.error for r in results if r.error]
    if bad:
        raise RuntimeError(f"warm-up failed: {bad[0]}")


def main(argv: list[str] | None = None) -> int:
    args = resolve_args(build_parser().parse_args(argv))
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))      # run the finally: stop the children
    if args.num_threads > 0:
        # Before torch is imported: with more OpenMP threads than torch uses, the offline baseline
        # ran slower here than the engine worker, which gets the same variable.
        os.environ["OMP_NUM_THREADS"] = str(args.num_threads)
    tmp = None
    if not args.model:
        if args.quick:
            from tests.support.tiny_model import build_tiny_model
            tmp = tempfile.mkdtemp(prefix="kaiten-bench-tiny-")
            args.model = str(build_tiny_model(Path(tmp) / "tiny", max_position_embeddings=1024))
        else:
            from shared.gguf_convert import ensure_default_model
            args.model = str(ensure_default_model())
    vocab, max_len = model_facts(args.model)
    if max_len and max_len < 512 + 256:
        raise SystemExit(f"{args.model}: max_position_embeddings {max_len} < 768 (512 prompt + 256 output tokens)")
    if args.num_threads > 0:
        import torch
        torch.set_num_threads(args.num_threads)
    cmd = "python bench/serving/serve.py " + " ".join(sys.argv[1:] if argv is None else argv)
    res = {"command": cmd.strip(), "model": Path(args.model).name, "cpu_count": os.cpu_count(),
           "cpu": cpu_name(), "date": time.strftime("%Y-%m-%d %H:%M"),
           "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "rates"}
           | {"rates": ["inf" if math.isinf(r) else r for r in args.rates]}, "phases": []}
    system = None
    tap = None
    try:
        url, redis_url = args.url, args.redis_url
        if not url:
            env = {"KAITEN_KV_CACHE_MEMORY": args.kv_cache_memory,
                   "KAITEN_MAX_NUM_BATCHED_TOKENS": str(args.max_num_batched_tokens),
                   "KAITEN_ENGINE_ID": "bench-engine"}
            if args.engine_timeout is not None:
                env["KAITEN_ENGINE_TIMEOUT"] = str(args.engine_timeout)
            system = System(args.model, args.num_threads, env)
            print(f"starting kaiten up (log: {system.log_path})", flush=True)
            system.start(args.ready_timeout)
            url, redis_url = system.url, system.redis_url
        tap = ReplyTap(redis_url) if redis_url else None
        times = tap.engine_times if tap else None
        model = asyncio.run(served_model_name(url))
        asyncio.run(warm_up(url, model, vocab))
        lines_before = system.log_lines() if system else 0
        res.update(run_phases(args, url, model, vocab, times))
        if system is not None:
            n_req = sum(p["requests"] for p in res["phases"])
            res["log_lines_per_request"] = (system.log_lines() - lines_before) / max(1, n_req)
    finally:
        if tap is not None:
            tap.close()
        if system is not None:
            system.stop()
            res["engine_step"] = system.engine_step_report()
            res["logs"] = str(system.workdir)
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
    off = res.get("offline")
    res["dtype"] = off["dtype"] if off else "auto"
    inf = next((s for s in res["phases"] if s["rate"] == "inf"), None)
    if off and inf:
        res["saturation"] = {"served_tokens_per_s": inf["output_tokens_per_s"],
                             "offline_tokens_per_s": off["tokens_per_s"],
                             "ratio": inf["output_tokens_per_s"] / off["tokens_per_s"]}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    Path(f"{args.out}.json").write_text(json.dumps(no_nan(res), indent=2, default=str))
    Path(f"{args.out}.md").write_text(render(res))
    plot(res, Path(f"{args.out}.png"))
    print(render(res))
    return 0


def run_phases(args, url: str, model: str, vocab: int, times: dict | None) -> dict:
    """idle probes, the finite rates (ascending), the offline baseline, then inf on the offline's prompts."""
    from engine_throughput import workload      # the offline benchmark's workload, reused
    out: dict = {"phases": []}
    if args.probe_requests:
        probes = [(p, args.probe_max_tokens) for p, _ in workload(args.probe_requests, vocab, args.seed + 1000)]
        results, wall = asyncio.run(run_sequential(url, model, probes, args.phase_timeout))
        out["phases"].append(report_phase("idle", None, results, wall, times))
    rates = sorted(args.rates)
    for k, rate in enumerate(rates):
        seed = args.seed if math.isinf(rate) else args.seed + 1 + k
        reqs = workload(args.num_requests, vocab, seed)
        offline = math.isinf(rate) and args.offline_runs > 0
        if offline:
            runs = [run_offline(args.model, reqs, args)]
        results, wall = asyncio.run(run_poisson(url, model, reqs, rate, seed, args.phase_timeout))
        out["phases"].append(report_phase(f"rate {rate}", rate, results, wall, times))
        if offline:
            runs += [run_offline(args.model, reqs, args) for _ in range(args.offline_runs - 1)]
            out["offline"] = combine_offline(runs)
    return out


def combine_offline(runs: list[dict]) -> dict:
    """Runs before and after the inf phase: a drift of the machine's other load cancels out."""
    tokens, wall = sum(r["output_tokens"] for r in runs), sum(r["wall_s"] for r in runs)
    return {"tokens_per_s": tokens / wall, "output_tokens": runs[0]["output_tokens"], "wall_s": wall / len(runs),
            "steps": runs[0]["steps"], "dtype": runs[0]["dtype"], "runs": runs}


def report_phase(name: str, rate: float | None, results: list[Result], wall: float, times: dict | None) -> dict:
    if times is not None:                 # the terminal deltas' event times may trail the [DONE] a little
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline and any(r.request_id and r.request_id not in times
                                                  for r in results if r.error is None):
            time.sleep(0.05)
    s = summarize(name, rate, results, wall, times)
    s["requests_detail"] = [asdict(r) | {"chunk_gaps_s": None, "engine": (times or {}).get(r.request_id),
                                         "num_chunks": len(r.chunk_gaps_s) + (not math.isnan(r.ttft_s))}
                            for r in results]
    print(f"{name}: {s['completed']}/{s['requests']} ok, {s['output_tokens_per_s']:.1f} tok/s, "
          f"TTFT p50 {_f(s['ttft_p50_ms'])} ms, ITL p50 {_f(s['itl_p50_ms'], 1)} ms, goal {s['goal']}", flush=True)
    return s


if __name__ == "__main__":
    sys.exit(main())
