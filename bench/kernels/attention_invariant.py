"""The cost of batch-invariant attention: kaiten_cpu::paged_attention with invariant=True (the
--deterministic default: every row's scores the decode way, keys in fixed segments, no split by
threads, no flash_attention) against invariant=False, one build, in one process. SmolLM2-135M's
attention (9 query heads, 3 kv heads, head_dim 64, fp32 queries, blocks of 16), 30 layers a step,
each layer its own cache with a 3 MiB read between layers (bench/kernels/attention_ab.py's
setup). The two alternate, the order reversed every round; medians of the rounds.

    .venv/bin/python bench/kernels/attention_invariant.py [--threads 2,1] [--rounds 7] [--kinds decode,prefill]
        [--out NAME]

Writes bench/results/batch_invariance/<NAME>.md (default attention_invariant).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.common.machine import cpu_flags, cpu_name, load_avg  # noqa: E402
from bench.common.results_files import RESULTS  # noqa: E402
from bench.kernels.attention_ab import CACHE_DTYPES, LAYERS, interleaved_medians  # noqa: E402
from kernels.cpu_ops_build import cpu_capability, load_cpu_ops  # noqa: E402

# (kind, sequences, new tokens a sequence, context a sequence): c=1 decodes, where the split by
# threads mattered, a 32-sequence decode step, prefill chunks
CASES = [("decode", 1, 1, 300), ("decode", 1, 1, 1024), ("decode", 32, 1, 384), ("prefill", 4, 256, 256),
         ("prefill", 1, 512, 1024)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", default=f"{torch.get_num_threads()},1")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--kinds", default="decode,prefill", help="the steps to time")
    ap.add_argument("--out", default="attention_invariant")
    args = ap.parse_args()
    cases = [c for c in CASES if c[0] in args.kinds.split(",")]
    load_cpu_ops()
    op = torch.ops.kaiten_cpu.paged_attention
    ops = {"invariant": lambda *a: op(*a, 0, True), "fastest": lambda *a: op(*a, 0, False)}
    load0 = load_avg()
    threads = [int(t) for t in args.threads.split(",")]
    med = interleaved_medians(ops, cases, CACHE_DTYPES, threads, args.rounds)
    lines = ["# paged_attention: invariant (--deterministic) against the fastest plan, in one process\n",
             f"CPU: {cpu_name()} ({' '.join(cpu_flags())}), kernel ISA {cpu_capability()[0]}, torch "
             f"{torch.__version__}; load {load0} before, {load_avg()} after. SmolLM2-135M's attention, {LAYERS} "
             f"layers a step, fp32 queries; median of {args.rounds} interleaved rounds. ms a step; ratio: "
             "invariant / fastest.\n",
             "| threads | step | cache | fastest ms | invariant ms | ratio |", "|---:|---|---|---:|---:|---:|"]
    for n in threads:
        for case in cases:
            kind, batch, new, ctx = case
            shape = f"{batch} x {ctx}" if kind == "decode" else f"{batch} x {new} tokens at {ctx}"
            for cname in CACHE_DTYPES:
                f, i = med[(n, case, cname, "fastest")], med[(n, case, cname, "invariant")]
                lines.append(f"| {n} | {kind} {shape} | {cname} | {f:.2f} | {i:.2f} | {i / f:.3f} |")
    out = RESULTS / "batch_invariance" / f"{args.out}.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
