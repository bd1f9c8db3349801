"""Preemption under KV pressure: swap through the shared KV store against recompute. One engine in
this process, a KV cache too small for the batch (--cache-share of what it needs), --seqs greedy
sequences of --prompt + --output tokens; without a store a preempted sequence is computed again,
with one (a local redis-server, emptied before each run) it reads its written chunks back.

The two run in interleaved rounds (the order reversed every other round) and each is reported by
its median: throughput (output tokens per wall second, and per CPU second of this process -- the
engine and its store threads -- plus the redis-server: on a loaded machine the steadier figure),
preemptions, chunks written and tokens loaded; and whether every output equals a run with a cache
large enough that nothing is preempted.

    .venv/bin/python bench/kv_store/swap.py [--model DIR] [--seqs 6] [--prompt 32] [--output 224] [--rounds 3] [--eager]
"""
from __future__ import annotations

import argparse
import os
import random
import signal
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.common import proc_cpu  # noqa: E402
from bench.common.machine import cpu_flags, cpu_id, cpu_name, load_avg  # noqa: E402
from bench.common.results_files import results_dir, write_results  # noqa: E402
from bench.common.timing import interleaved  # noqa: E402

RESULTS = results_dir("kv_store")
MODES = ("recompute", "swap")


def tree_cpu_s() -> float:
    """CPU seconds so far of this process's threads and its children (the redis-server)."""
    return sum(s for s, _ in proc_cpu.snapshot(os.getpid()).values())


def run(model: str, url: str, prompts: list[list[int]], output: int, memory: int, eager: bool, threads: int) -> dict:
    from engine_worker.engine.llm_engine import LLMEngine
    from engine_worker.engine.sampling_params import SamplingParams
    from engine_worker.kv_store.redis_store import attach_kv_store
    from shared.config import EngineConfig
    engine = LLMEngine(EngineConfig(model=model, dtype="float32", kv_cache_memory=str(memory), enforce_eager=eager,
                                    kv_store_url=url, max_num_seqs=len(prompts), num_threads=threads))
    attach_kv_store(engine)
    outs = {f"s{i}": [] for i in range(len(prompts))}
    cpu0, t0 = tree_cpu_s(), time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add_request(f"s{i}", p, SamplingParams(temperature=0.0, max_tokens=output, ignore_eos=True))
    while engine.has_unfinished():
        for o in engine.step():
            outs[o.request_id] += o.new_token_ids
    if engine.kv is not None:
        engine.kv.connector.close()                 # its queued writes are part of its cost
    wall, cpu = time.perf_counter() - t0, tree_cpu_s() - cpu0
    st = engine.stats()
    return {"wall_s": wall, "cpu_s": cpu, "tok_s": len(prompts) * output / wall, "preemptions": st.num_preemptions,
            "loaded_tokens": st.kv_store_loaded_tokens, "saved_chunks": st.kv_store_saved_chunks,
            "blocks": st.num_blocks, "outputs": outs}


def median(runs: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="", help="a model directory (default: the default SmolLM2)")
    ap.add_argument("--seqs", type=int, default=6)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--output", type=int, default=224, help="long outputs: sequences outgrow the cache while "
                                                            "they decode, so running ones are preempted")
    ap.add_argument("--cache-share", type=float, default=0.5, help="the KV cache, as a share of what the batch needs")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds of recompute and swap")
    ap.add_argument("--eager", action="store_true", help="the eager forward (no torch.compile)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: one per core)")
    ap.add_argument("--out", default=str(RESULTS / "swap"))
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))      # run the finally: stop the redis-server
    os.environ.setdefault("KAITEN_TEST_REDIS", "process")
    import redis

    from engine_worker.engine.llm_engine import LLMEngine
    from shared.config import EngineConfig
    from shared.model_source import resolve_model
    from tests.support.redis_server import RedisServer
    model = str(resolve_model(args.model))
    probe = LLMEngine(EngineConfig(model=model, dtype="float32", kv_cache_memory="64MiB", enforce_eager=True))
    block_bytes, vocab = probe.kv_layout().block_bytes, probe.vocab_size
    del probe
    need = args.seqs * -(-(args.prompt + args.output) // 16)
    memory = int(need * args.cache_share) * block_bytes
    rng = random.Random(0)
    prompts = [[rng.randrange(100, vocab - 100) for _ in range(args.prompt)] for _ in range(args.seqs)]
    load_before = load_avg()
    server = RedisServer().start()
    try:
        plenty = run(model, "", prompts, args.output, 2 * need * block_bytes, args.eager, args.threads)

        def one(mode: str) -> dict:
            redis.Redis.from_url(server.url).flushall()      # each swap run starts from an empty store
            r = run(model, server.url if mode == "swap" else "", prompts, args.output, memory, args.eager,
                    args.threads)
            r["outputs_equal"] = r.pop("outputs") == plenty["outputs"]
            print(mode, {k: round(v, 2) if isinstance(v, float) else v for k, v in r.items()}, flush=True)
            return r
        rounds = interleaved(MODES, args.rounds, one)
    finally:
        server.stop()
    plenty.pop("outputs")
    meta = {"cpu": cpu_name(), "cpu_id": cpu_id(), "flags": cpu_flags(), "load_before": load_before,
            "load_after": load_avg(), "model": Path(model).name, "eager": args.eager, **vars(args),
            "cache_blocks_needed": need}
    md = [f"CPU: {meta['cpu']} ({meta['cpu_id']}; {', '.join(meta['flags'])}), load {load_before} -> "
          f"{meta['load_after']}. {meta['model']}, fp32, {'eager' if args.eager else 'compiled'} forward, "
          f"{args.threads or 'default'} torch thread(s); "
          f"{args.seqs} greedy sequences of {args.prompt} + {args.output} tokens in a cache of "
          f"{rounds['recompute'][0]['blocks']} blocks ({args.cache_share:.0%} of the {need} they need); "
          f"medians of {args.rounds} interleaved rounds. CPU s: this process (engine, store threads) and "
          f"the redis-server.", "",
          "| preempted sequences | output tok/s | vs recompute | wall s | CPU s | tok per CPU s | vs recompute "
          "| preemptions | chunks written | tokens loaded | outputs equal to unpreempted |",
          "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for runs in (plenty, *rounds["recompute"], *rounds["swap"]):
        runs["tok_cpu_s"] = args.seqs * args.output / runs["cpu_s"]
    base, base_cpu = median(rounds["recompute"], "tok_s"), median(rounds["recompute"], "tok_cpu_s")
    rows = [("none (a cache for all, one run)", [plenty]), ("recomputed (no store)", rounds["recompute"]),
            ("swapped through the store", rounds["swap"])]
    for name, runs in rows:
        equal = "" if runs is rows[0][1] else f"{sum(r['outputs_equal'] for r in runs)} of {len(runs)}"
        md.append(f"| {name} | {median(runs, 'tok_s'):.2f} | {median(runs, 'tok_s') / base:.2f}x "
                  f"| {median(runs, 'wall_s'):.1f} | {median(runs, 'cpu_s'):.1f} | {median(runs, 'tok_cpu_s'):.1f} "
                  f"| {median(runs, 'tok_cpu_s') / base_cpu:.2f}x | {median(runs, 'preemptions'):.0f} "
                  f"| {median(runs, 'saved_chunks'):.0f} | {median(runs, 'loaded_tokens'):.0f} | {equal} |")
    md += ["", "Per round (tok/s): " + "; ".join(
        f"{m} " + ", ".join(f"{r['tok_s']:.2f}" for r in rounds[m]) for m in MODES)]
    write_results(args.out, {"meta": meta, "unpreempted": plenty, **rounds}, "\n".join(md))


if __name__ == "__main__":
    main()
