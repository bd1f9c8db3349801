"""Failover with and without the shared KV store (issue #63): how long a stream pauses when its
engine is SIGKILLed mid-stream, and how many of the continuation's prompt tokens the surviving
engine computes.

    .venv/bin/python bench/kv_store/failover_pause.py [--model DIR] [--rounds 2] [--num-requests 4]
    .venv/bin/python bench/kv_store/failover_pause.py --quick      # tiny random model, slowed steps: checks the bench

Each round runs bench/serving/failover.py's SIGKILL round twice, once per mode, the order reversed
every other round: a private redis-server, two engine processes (with --kv-store-url on a second
redis-server, allkeys-lru, in the store mode) and a gateway; --num-requests greedy streams; once
every stream has --signal-after tokens, SIGKILL the engine serving most of them. Per moved stream:
the pause (from the last token its first engine delivered to the first its continuation
delivered, as this bench's subscriber on the reply channel sees them) and the continuation's
prompt tokens computed (prompt - cached - loaded, from its terminal delta). Medians over every
moved stream of every round.
"""
from __future__ import annotations

import argparse
import asyncio
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.common.machine import cpu_flags, cpu_id, cpu_name, load_avg  # noqa: E402
from bench.common.results_files import results_dir, write_results  # noqa: E402
from bench.common.timing import interleaved  # noqa: E402
from bench.serving import failover  # noqa: E402
from shared.launcher import start_local_redis  # noqa: E402

RESULTS = results_dir("kv_store")
MODES = ("no store", "store")


def moved_streams(tap: failover.ReplyTap, ids: list[str]) -> list[dict]:
    """Per moved stream: its pause (s) and its continuation's prompt tokens, cached and computed."""
    out = []
    for rid in ids:
        ds = [(t, d) for t, _, d in tap.of(rid) if d.token_ids or d.finish_reason]
        first = [t for t, d in ds if "~" not in d.request_id and d.token_ids]
        cont = [(t, d) for t, d in ds if "~" in d.request_id]
        if not cont:
            continue
        end = next(d for _, d in cont if d.finish_reason is not None)
        out.append({"pause_s": min(t for t, d in cont if d.token_ids) - max(first),
                    "prompt": end.num_prompt_tokens, "cached": end.num_cached_tokens,
                    "computed": end.num_prompt_tokens - end.num_cached_tokens})
    return out


def one_round(mode: str, args, prompts: list[list[int]]) -> dict:
    stack = failover.Stack(args.model, args.num_threads, args.step_delay, args.dtype)
    store = None
    if mode == "store":
        store, url = start_local_redis(workdir=str(stack.workdir), name="kv-store",
                                       extra=("--maxmemory", "1gb", "--maxmemory-policy", "allkeys-lru"))
        stack.engine_flags = ["--kv-store-url", url, "--kv-store-chunk-tokens", str(args.chunk_tokens)]
    try:
        r = stack.start_two_engines(args.ready_timeout)
        tap = failover.ReplyTap(stack.redis_url)
        try:
            args.seen = set()
            rnd = asyncio.run(failover.run_round(stack, tap, r, failover.Round("SIGKILL"), prompts, args))
            moved = moved_streams(tap, rnd.order)
        finally:
            tap.close()
    finally:
        stack.stop()
        if store is not None:
            store.signal(signal.SIGTERM)
            store.proc.wait(10)
    result = {"moved": moved, "streams_ok": rnd.streams_ok, "problems": rnd.stream_problems,
              "tokens": [rnd.tokens.get(rid, []) for rid in rnd.order]}
    print(mode, [(round(m["pause_s"], 2), m["computed"]) for m in moved], f"{rnd.streams_ok} ok", flush=True)
    return result


def med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def render(rep: dict) -> str:
    a, m = rep["args"], rep["meta"]
    lines = [f"CPU: {m['cpu']} ({m['cpu_id']}; {', '.join(m['flags'])}), load {m['load_before']} -> "
             f"{m['load_after']}. {m['model']}, {a['num_requests']} greedy streams of {a['max_tokens']} tokens, "
             f"SIGKILL after {a['signal_after']}; two engines of {a['num_threads']} torch thread(s); store chunks "
             f"of {a['chunk_tokens'] or 'the measured'} tokens; {a['rounds']} interleaved rounds; medians over "
             f"every moved stream.", "",
             "| failover | moved streams | pause p50 s | pause max s | continuation prompt tokens (median) "
             "| computed: median | computed: max | streams ok |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for mode in MODES:
        runs = rep["rounds"][mode]
        moved = [x for run in runs for x in run["moved"]]
        pauses, computed = [x["pause_s"] for x in moved], [x["computed"] for x in moved]
        ok = sum(run["streams_ok"] for run in runs)
        lines.append(f"| {mode} | {len(moved)} | {med(pauses):.2f} | {max(pauses, default=float('nan')):.2f} "
                     f"| {med([x['prompt'] for x in moved]):.0f} | {med(computed):.0f} "
                     f"| {max(computed, default=0)} | {ok} of {len(runs) * a['num_requests']} |")
    base = med([x["pause_s"] for run in rep["rounds"]["no store"] for x in run["moved"]])
    pause = med([x["pause_s"] for run in rep["rounds"]["store"] for x in run["moved"]])
    lines += ["", f"Pause with the store: {pause / base:.2f}x that without. Outputs: {rep['equal']}."]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="", help="model directory (default: SmolLM2; --quick: tiny)")
    ap.add_argument("--quick", action="store_true", help="tiny random model, steps slowed to 20 ms: checks the bench")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--num-requests", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=200)
    ap.add_argument("--signal-after", type=int, default=48, help="tokens every stream has before the SIGKILL")
    ap.add_argument("--num-threads", type=int, default=1, help="torch threads per engine")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--chunk-tokens", type=int, default=0, help="--kv-store-chunk-tokens (0: measured; --quick: 32)")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per round")
    ap.add_argument("--ready-timeout", type=float, default=600.0)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))      # run the finally: stop the children
    if args.quick and not args.model:
        from tests.support.tiny_model import build_tiny_model
        args.model = str(build_tiny_model(Path(tempfile.mkdtemp(prefix="kaiten-bench-tiny-")) / "tiny"))
        args.chunk_tokens = args.chunk_tokens or 32
    elif not args.model:
        from shared.gguf_convert import ensure_default_model
        args.model = str(ensure_default_model())
    args.step_delay = 0.02 if args.quick else 0.0
    out = Path(args.out or RESULTS / ("failover_pause_quick" if args.quick else "failover_pause"))
    prompts = failover.make_prompts(args.model, args.num_requests, 0)
    meta = {"cpu": cpu_name(), "cpu_id": cpu_id(), "flags": cpu_flags(), "load_before": load_avg(),
            "model": Path(args.model).name, "date": time.strftime("%Y-%m-%d %H:%M"),
            "command": "python bench/kv_store/failover_pause.py " + " ".join(sys.argv[1:])}
    rounds = interleaved(MODES, args.rounds, lambda mode: one_round(mode, args, prompts))
    meta["load_after"] = load_avg()
    first = rounds["no store"][0]["tokens"]
    equal = sum(run["tokens"] == first for mode in MODES for run in rounds[mode])
    rep = {"meta": meta, "args": {k: v for k, v in vars(args).items() if k != "seen"}, "rounds": rounds,
           "equal": f"{equal} of {args.rounds * len(MODES)} runs' tokens equal the first run's"}
    write_results(out, rep, render(rep))


if __name__ == "__main__":
    main()
