"""Preemption under KV pressure: swap through the shared KV store against recompute. One engine in
this process, a KV cache too small for the batch (--cache-share of what it needs), --seqs greedy
sequences of --prompt + --output tokens; without a store a preempted sequence is computed again,
with one (a local redis-server) it reads its written chunks back. Reports throughput (output
tokens/s), preemptions, tokens loaded, and whether every output equals a run with a cache large
enough that nothing is preempted.

    .venv/bin/python bench/kv_store/swap.py [--model DIR] [--seqs 8] [--prompt 256] [--output 128] [--eager]
"""
from __future__ import annotations

import argparse
import os
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.common.machine import cpu_flags, cpu_id, cpu_name, load_avg  # noqa: E402
from bench.common.results_files import results_dir, write_results  # noqa: E402

RESULTS = results_dir("kv_store")


def run(model: str, url: str, prompts: list[list[int]], output: int, memory: int, eager: bool) -> dict:
    from engine_worker.engine.llm_engine import LLMEngine
    from engine_worker.engine.sampling_params import SamplingParams
    from engine_worker.kv_store.redis_store import attach_kv_store
    from shared.config import EngineConfig
    engine = LLMEngine(EngineConfig(model=model, dtype="float32", kv_cache_memory=str(memory), enforce_eager=eager,
                                    kv_store_url=url,
                                    max_num_seqs=len(prompts)))
    attach_kv_store(engine)
    outs = {f"s{i}": [] for i in range(len(prompts))}
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add_request(f"s{i}", p, SamplingParams(temperature=0.0, max_tokens=output, ignore_eos=True))
    while engine.has_unfinished():
        for o in engine.step():
            outs[o.request_id] += o.new_token_ids
    wall = time.perf_counter() - t0
    st = engine.stats()
    if engine.kv is not None:
        engine.kv.connector.close()
    return {"wall_s": wall, "tok_s": len(prompts) * output / wall, "preemptions": st.num_preemptions,
            "loaded_tokens": st.kv_store_loaded_tokens, "blocks": st.num_blocks, "outputs": outs}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="", help="a model directory (default: the default SmolLM2)")
    ap.add_argument("--seqs", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--output", type=int, default=128)
    ap.add_argument("--cache-share", type=float, default=0.6, help="the KV cache, as a share of what the batch needs")
    ap.add_argument("--eager", action="store_true", help="the eager forward (no torch.compile)")
    ap.add_argument("--out", default=str(RESULTS / "swap"))
    args = ap.parse_args()
    os.environ.setdefault("KAITEN_TEST_REDIS", "process")
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
    plenty = run(model, "", prompts, args.output, 2 * need * block_bytes, args.eager)
    recompute = run(model, "", prompts, args.output, memory, args.eager)
    server = RedisServer().start()
    try:
        swap = run(model, server.url, prompts, args.output, memory, args.eager)
    finally:
        server.stop()
    unpreempted = plenty.pop("outputs")
    same = {"swap_equals_unpreempted": swap.pop("outputs") == unpreempted,
            "recompute_equals_unpreempted": recompute.pop("outputs") == unpreempted}
    meta = {"cpu": cpu_name(), "cpu_id": cpu_id(), "flags": cpu_flags(), "load_before": load_before,
            "load_after": load_avg(), "model": Path(model).name, "eager": args.eager, **vars(args),
            "cache_blocks_needed": need, "outputs_equal": same}
    md = [f"CPU: {meta['cpu']} ({meta['cpu_id']}; {', '.join(meta['flags'])}), load {load_before} -> "
          f"{meta['load_after']}. {meta['model']}, {'eager' if args.eager else 'compiled'} forward; {args.seqs} "
          f"greedy sequences of {args.prompt} + {args.output} tokens in a cache of {recompute['blocks']} blocks "
          f"({args.cache_share:.0%} of the {need} they need). Outputs equal to a run without preemption: "
          f"swapped {same['swap_equals_unpreempted']}, recomputed {same['recompute_equals_unpreempted']}.", "",
          "| preempted sequences | output tok/s | wall s | preemptions | tokens loaded |", "|---|---:|---:|---:|---:|"]
    for name, r in (("none (a cache for all)", plenty), ("recomputed (no store)", recompute),
                    ("swapped through the store", swap)):
        md.append(f"| {name} | {r['tok_s']:.1f} | {r['wall_s']:.1f} | {r['preemptions']} | {r['loaded_tokens']} |")
    write_results(args.out, {"meta": meta, "unpreempted": plenty, "recompute": recompute, "swap": swap}, "\n".join(md))


if __name__ == "__main__":
    main()
