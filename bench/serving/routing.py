"""Cache-aware routing against the shared queue: prompt tokens computed as engines are added.

The workload of issue 20, as a chat user deploys Kaiten: one gateway, N engines (one torch thread
each) on one Redis; U users share one system prompt of about W words, each holds a T-turn chat that
resends its whole history every turn (as chat clients do), A tokens per answer, greedy. For each N
and each policy (``--routing queue``: the shared stream; ``prefix``: cache-aware) it starts a fresh
Redis, engines and gateway, runs the users concurrently through the streaming chat API and reads the
engines' own prefix-cache counters (the heartbeat's copy of their /metrics): prompt tokens looked
up, served from the cache, computed (the difference), requests per engine, and the clients' TTFT.

    .venv/bin/python bench/serving/routing.py                 # SmolLM2, N = 1, 2, 4: bench/results/routing/routing.{md,json}
    .venv/bin/python bench/serving/routing.py --quick         # the tiny random model: checks the bench
    .venv/bin/python bench/serving/routing.py --engines 1,4 --policies prefix,prefix+store
                                                              # + the engines share a KV store (docs/kv_store.md)

A policy ending in ``+store`` also starts a KV store (a second redis-server, allkeys-lru) that the
engines share; their "computed" then leaves out the prompt tokens they loaded from it.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import shlex
import signal
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.common.machine import cpu_flags, cpu_name, load_avg  # noqa: E402
from bench.common.results_files import results_dir  # noqa: E402
from bench.serving.failover import Stack, fresh_heartbeats, wait_heartbeat  # noqa: E402

RESULTS = results_dir(__file__)
WORDS = ("the river ledger harbor quiet signal amber north engine garden copper lantern winter market orbit "
         "meadow paper canyon violet thunder mirror station cedar harvest compass silver valley beacon").split()
TOPICS = ["tides", "bread", "glaciers", "chess", "bees", "volcanoes", "jazz", "maps", "owls", "comets",
          "silk", "coral"]


@dataclass(slots=True)
class Run:
    engines: int
    policy: str
    looked_up: int = 0
    cached: int = 0
    computed: int = 0
    hit_rate: float = 0.0
    requests_per_engine: list[int] = field(default_factory=list)
    ttft_p50: float | None = None
    ttft_p90: float | None = None
    wall_s: float = 0.0
    errors: int = 0
    shared_tokens: int = 0      # the prompt prefix every user shares, in full KV blocks


def floor(runs: list[Run], r: Run) -> int | None:
    """The fewest prompt tokens `r` could compute with every engine that served holding its own copy
    of the shared prefix: the single engine's count plus one shared-prefix prefill per further engine."""
    one = next((x.computed for x in runs if x.engines == 1 and x.policy in (r.policy, r.policy.partition("+")[0])),
               None)
    if one is None:
        return None
    return one + (sum(1 for n in r.requests_per_engine if n) - 1) * r.shared_tokens


def system_prompt(words: int) -> str:
    rng = random.Random(0)
    sentences, n = [], 0
    while n < words:
        k = rng.randint(8, 16)
        sentences.append(" ".join(rng.choice(WORDS) for _ in range(k)).capitalize() + ".")
        n += k
    return "You are a helpful assistant. Keep these notes in mind: " + " ".join(sentences)


def pct(xs: list[float], q: float) -> float | None:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else None


async def chat_turn(client, model: str, messages: list[dict], max_tokens: int) -> tuple[str, float | None, str]:
    """One streamed chat turn: (answer, TTFT s, error)."""
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True}
    t0, ttft, text = time.perf_counter(), None, ""
    async with client.stream("POST", "/v1/chat/completions", json=body) as resp:
        if resp.status_code != 200:
            return "", None, f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
        async for line in resp.aiter_lines():
            if not line.startswith("data:") or line.strip() == "data: [DONE]":
                continue
            ev = json.loads(line[5:])
            if "error" in ev:
                return text, ttft, str(ev["error"])
            piece = "".join(c["delta"].get("content") or "" for c in ev.get("choices", []))
            if piece and ttft is None:
                ttft = time.perf_counter() - t0
            text += piece
    return text, ttft, ""


async def user(client, model: str, u: int, system: str, args, ttfts: list[float], errors: list[str]) -> None:
    messages = [{"role": "system", "content": system}]
    for k in range(args.turns):
        messages.append({"role": "user", "content": f"Question {k + 1}: tell me something about "
                                                    f"{TOPICS[(u + k) % len(TOPICS)]}."})
        answer, ttft, err = await chat_turn(client, model, messages, args.answer_tokens)
        if err:
            errors.append(err)
            return
        ttfts.append(ttft if ttft is not None else float("nan"))
        messages.append({"role": "assistant", "content": answer})


def shared_prefix_tokens(client, model: str, system: str, block_size: int) -> int:
    """Full blocks of the prompt prefix two users' first turns share (rendered by the gateway)."""
    ids = [client.post("/tokenize", json={"model": model, "add_generation_prompt": True, "messages": [
        {"role": "system", "content": system}, {"role": "user", "content": f"Question 1: about {t}."}]}).json()["tokens"]
           for t in TOPICS[:2]]
    n = next((i for i, (a, b) in enumerate(zip(*ids)) if a != b), min(map(len, ids)))
    return n // block_size * block_size


def prefix_counts(hbs: dict[str, dict]) -> tuple[int, int, dict[str, int]]:
    """Prompt tokens looked up, those not computed (prefix-cache hits and loads from a KV store),
    requests per engine."""
    looked = sum(int(h.get("prefix_cache_queries", 0)) for h in hbs.values())
    hits = sum(int(h.get("prefix_cache_hits", 0)) + int(h.get("kv_store_loaded_tokens", 0)) for h in hbs.values())
    return looked, hits, {e: int(h.get("counters", {}).get("requests", 0)) for e, h in hbs.items()}


def run_one(n: int, policy: str, args) -> Run:
    import httpx
    import redis
    from shared.launcher import start_local_redis
    routing, _, store = policy.partition("+")
    stack = Stack(args.model, args.threads, 0.0, args.dtype,
                  engine_flags=["--metrics-port", "0", "--max-num-seqs", str(args.max_num_seqs)],
                  gateway_flags=["--routing", routing, *shlex.split(args.routing_flags)])
    print(f"N={n} routing={policy}: logs in {stack.workdir}", flush=True)
    run = Run(n, policy)
    kv_store = None
    try:
        if store:
            kv_store, url = start_local_redis(name="kv-store", workdir=str(stack.workdir),
                                              extra=("--maxmemory", "2gb", "--maxmemory-policy", "allkeys-lru"))
            stack.engine_flags += ["--kv-store-url", url]
        stack.start_redis()
        ids = [f"eng-{i}" for i in range(n)]
        for e in ids:
            stack.start_engine(e)
        stack.start_gateway()
        r = redis.Redis.from_url(stack.redis_url)
        for e in ids:
            wait_heartbeat(stack, r, e, args.start_timeout)
        stack.wait_ready(n, args.start_timeout)
        before = prefix_counts(fresh_heartbeats(r, ids))
        system, ttfts, errors = system_prompt(args.system_words), [], []
        model = httpx.get(stack.url + "/v1/models", trust_env=False).json()["data"][0]["id"]
        with httpx.Client(base_url=stack.url, trust_env=False) as c:
            block_size = int(fresh_heartbeats(r, ids)[ids[0]]["block_size"])
            run.shared_tokens = shared_prefix_tokens(c, model, system, block_size)

        async def main():
            async with httpx.AsyncClient(base_url=stack.url, trust_env=False, timeout=600,
                                         limits=httpx.Limits(max_connections=args.users)) as c:
                await asyncio.gather(*(user(c, model, u, system, args, ttfts, errors) for u in range(args.users)))
        t0 = time.perf_counter()
        asyncio.run(main())
        run.wall_s = round(time.perf_counter() - t0, 2)
        after = prefix_counts(fresh_heartbeats(r, ids))
        run.looked_up, run.cached = after[0] - before[0], after[1] - before[1]
        run.computed = run.looked_up - run.cached
        run.hit_rate = round(run.cached / run.looked_up, 3) if run.looked_up else 0.0
        run.requests_per_engine = [after[2][e] - before[2].get(e, 0) for e in ids]
        run.ttft_p50, run.ttft_p90 = pct(ttfts, 0.5), pct(ttfts, 0.9)
        run.errors = len(errors)
        if errors:
            print(f"  {len(errors)} errors, e.g. {errors[0]}", flush=True)
    finally:
        stack.stop()
        if kv_store is not None:
            kv_store.signal(signal.SIGTERM)
            kv_store.proc.wait(10)
    print(f"  computed {run.computed} of {run.looked_up} (hit rate {run.hit_rate}), per engine "
          f"{run.requests_per_engine}, TTFT p50/p90 {run.ttft_p50}/{run.ttft_p90}", flush=True)
    return run


def render(rep: dict) -> str:
    runs = [Run(**r) for r in rep["runs"]]
    base = {r.policy: r.computed for r in runs if r.engines == 1}
    for r in runs:              # a store changes nothing for one engine: compare with its routing alone
        base.setdefault(r.policy, base.get(r.policy.partition("+")[0]))
    lines = ["# Cache-aware routing: prompt tokens computed as engines are added", "",
             f"`{rep['command']}`, {rep['date']}, model {rep['model']} ({rep['dtype']}), {rep['cpu']} "
             f"({rep['cores']} cores; {rep['flags']}), load average {rep['load_avg_before']} before, "
             f"{rep['load_avg_after']} after.", "",
             f"Workload: {rep['args']['users']} users share a system prompt of {rep['args']['system_words']} words; "
             f"each holds a {rep['args']['turns']}-turn chat resending its history, {rep['args']['answer_tokens']} "
             f"tokens per answer, greedy, users concurrent. One gateway; engines of {rep['args']['threads']} torch "
             "thread each. Counts are the engines' own prefix-cache counters. Floor: the single engine's "
             f"count plus, per further engine that served, one prefill of the {runs[0].shared_tokens if runs else 0} "
             "prompt tokens all users share (in full KV blocks): about what an engine fleet computes when "
             "every engine serves and no engine has another's KV blocks.", "",
             "| engines | routing | prompt tokens looked up | served from cache | hit rate | computed | vs 1 engine "
             "| floor | requests per engine (max / mean) | TTFT p50 s | TTFT p90 s | wall s | errors |",
             "|---:|---|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|"]
    for r in runs:
        ratio = f"{r.computed / base[r.policy]:.2f}x" if base.get(r.policy) else "-"
        per = r.requests_per_engine
        spread = f"{per} ({max(per) / (sum(per) / len(per)):.2f})" if per and sum(per) else str(per)
        f = (lambda x: f"{x:.3f}" if x is not None else "-")
        lines.append(f"| {r.engines} | {r.policy} | {r.looked_up} | {r.cached} | {r.hit_rate:.3f} | {r.computed} "
                     f"| {ratio} | {floor(runs, r) or '-'} | {spread} | {f(r.ttft_p50)} | {f(r.ttft_p90)} | {r.wall_s} | {r.errors} |")
    return "\n".join(lines) + "\n"


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="", help="model directory (default: the default SmolLM2)")
    ap.add_argument("--quick", action="store_true", help="the tiny random model, fewer users: checks the bench")
    ap.add_argument("--engines", default="1,2,4", help="engine counts, comma-separated")
    ap.add_argument("--policies", default="queue,prefix", help="routing policies, comma-separated")
    ap.add_argument("--users", type=int, default=8)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--system-words", type=int, default=450)
    ap.add_argument("--answer-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per engine")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--start-timeout", type=float, default=900.0,
                    help="seconds for the engines to start (several compile at once on few cores)")
    ap.add_argument("--routing-flags", default="", help="more gateway flags, e.g. \"--routing-balance-abs-threshold 2\"")
    ap.add_argument("--out", default="", help="results path without suffix (default bench/results/routing/routing)")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    tmp = None
    if args.quick and not args.model:
        from tests.support.tiny_model import build_tiny_model
        tmp = tempfile.mkdtemp(prefix="kaiten-bench-tiny-")
        args.model = str(build_tiny_model(Path(tmp) / "tiny"))
        # The tiny model has 512 positions and a byte-level vocabulary: a short chat.
        args.users, args.system_words, args.turns = min(args.users, 4), min(args.system_words, 12), min(args.turns, 3)
        args.answer_tokens = min(args.answer_tokens, 16)
    elif not args.model:
        from shared.gguf_convert import ensure_default_model
        args.model = str(ensure_default_model())
    out = Path(args.out or RESULTS / ("routing.quick" if args.quick else "routing"))
    cmd = "python bench/serving/routing.py " + " ".join(sys.argv[1:] if argv is None else argv)
    rep = {"command": cmd.strip(), "model": Path(args.model).name, "dtype": args.dtype, "cpu": cpu_name(),
           "flags": " ".join(cpu_flags()), "cores": os.cpu_count(), "load_avg_before": load_avg(),
           "date": time.strftime("%Y-%m-%d %H:%M"), "args": vars(args), "runs": []}
    try:
        for n in [int(x) for x in args.engines.split(",")]:
            for policy in args.policies.split(","):
                rep["runs"].append(asdict(run_one(n, policy, args)))
    finally:           # the runs that finished are kept, whatever stopped the rest
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
        rep["load_avg_after"] = load_avg()
        write(out, rep)
    return 0 if not any(r["errors"] for r in rep["runs"]) else 1


def write(out: Path, rep: dict) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    # Not with_suffix: it would turn "<name>.quick" into "<name>.json", the full run's results.
    Path(f"{out}.json").write_text(json.dumps(rep, indent=1))
    Path(f"{out}.md").write_text(render(rep))
    print(render(rep))


if __name__ == "__main__":
    sys.exit(main())
