"""Prefill steps on a KV cache whose pages are backed at first touch against one an idle engine
backed first (LLMEngine.between_steps, host_memory.Prefault), each in its own process, the two
alternating --rounds times. Per process: the default model (quantization auto), prefix caching off,
--steps steps of --prompts new prompts of --context tokens (max_tokens 1), each step's ms a prompt
token and its minor page faults.

    .venv/bin/python bench/engine/kv_prefault.py [--rounds 3] [--steps 9] [--kv-cache-memory 512MiB] [--out NAME]

Writes bench/results/kv_prefault/<NAME>.md (default kv_prefault).
"""
from __future__ import annotations

import argparse
import json
import random
import resource
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.common.machine import cpu_flags, cpu_name, load_avg  # noqa: E402
from bench.common.results_files import results_dir  # noqa: E402
from bench.common.timing import interleaved, measure_in_process  # noqa: E402

RESULTS = results_dir(__file__)


def measure(args) -> dict:
    from engine_worker import LLM, SamplingParams
    from shared.gguf_convert import ensure_default_model
    llm = LLM(str(ensure_default_model()), quantization="auto", enable_prefix_caching=False, max_num_seqs=64,
              max_num_batched_tokens=args.prompts * args.context, kv_cache_memory=args.kv_cache_memory)
    t0 = time.perf_counter()
    while args.prefault and llm.engine.between_steps():
        pass
    prefault_s = time.perf_counter() - t0
    rng = random.Random(0)
    vocab = llm.engine.vocab_size
    ms, faults = [], []
    for _ in range(args.steps):
        for _ in range(args.prompts):
            llm.submit([rng.randrange(100, vocab) for _ in range(args.context)], SamplingParams(max_tokens=1, temperature=0.0))
        f0, t0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, time.perf_counter()
        llm.step()
        ms.append((time.perf_counter() - t0) * 1e3 / (args.prompts * args.context))
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
        while llm.engine.has_unfinished():
            llm.step()
    return {"ms": ms, "faults": faults, "prefault_s": prefault_s, "dtype": str(llm.engine.runner.dtype)}


def excess(ms: list[float]) -> float:
    """The share of the steps' time above their median step's (faults' stalls, mostly)."""
    return (sum(ms) - len(ms) * statistics.median(ms)) / sum(ms)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=9)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--kv-cache-memory", default="512MiB")
    ap.add_argument("--out", default="kv_prefault")
    ap.add_argument("--prefault", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--measure", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.measure:
        print(json.dumps(measure(args)))
        return 0
    load0 = load_avg()
    argv = [f"--steps={args.steps}", f"--prompts={args.prompts}", f"--context={args.context}",
            f"--kv-cache-memory={args.kv_cache_memory}"]
    extra = {"first touch": [], "prefaulted when idle": ["--prefault"]}
    runs = interleaved(extra, args.rounds, lambda name: measure_in_process(__file__, argv + extra[name], cwd=ROOT))
    lines = [f"# Prefill steps: KV pages backed at first touch against backed by an idle engine first\n",
             f"CPU: {cpu_name()} ({' '.join(cpu_flags())}); load {load0} before, {load_avg()} after; the default "
             f"model, dtype {runs['first touch'][0]['dtype']}, KV cache {args.kv_cache_memory}, {args.steps} steps of "
             f"{args.prompts} x {args.context} prompt tokens a process, each way in its own process, {args.rounds} "
             "alternating rounds.\n",
             "| KV pages | mean ms a token (rounds) | median | slowest step | faults a step (max) | steps' time over "
             "their process's median step | backing s |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    means = {}
    for name, rs in runs.items():
        mean = [statistics.fmean(r["ms"]) for r in rs]
        means[name] = statistics.median(mean)
        lines.append(f"| {name} | {means[name]:.3f} ({', '.join(f'{m:.3f}' for m in mean)}) | "
                     f"{statistics.median(statistics.median(r['ms']) for r in rs):.3f} | "
                     f"{max(max(r['ms']) for r in rs):.3f} | {max(max(r['faults'][1:]) for r in rs)} | "
                     f"{statistics.median(excess(r['ms'][1:]) for r in rs):.1%} | "
                     f"{statistics.median(r['prefault_s'] for r in rs):.2f} |")
    lines.append(f"\nMean step time, prefaulted / first touch: {means['prefaulted when idle'] / means['first touch']:.3f}x. "
                 "The time over the median (the median over rounds of: the steps' total less their count times "
                 "the process's median step, over the steps' total) does not move with the machine's speed, which "
                 "changes between processes; faults and that excess count from the second step (the first maps "
                 "the step's scratch too).")
    out = RESULTS / f"{args.out}.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
