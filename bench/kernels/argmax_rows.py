"""Greedy sampling's argmax over the default model's 49152 logits: kaiten_cpu::argmax_rows (the
sampler's, kernels/csrc/argmax_cpu.cpp) against torch.argmax, at 1 and 32 rows (one stream, a
32-row decode step), alternating, median of --rounds rounds of --calls calls each.

    .venv/bin/python bench/kernels/argmax_rows.py [--rows 1,32] [--rounds 15] [--calls 50] [--out argmax_rows]

Writes bench/results/argmax_rows/<out>.{md,json}.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.common.machine import cpu_flags, cpu_name, load_avg  # noqa: E402
from bench.common.results_files import results_dir, write_results  # noqa: E402
from bench.common.timing import interleaved  # noqa: E402
from kernels.cpu_ops_build import cpu_capability, load_cpu_ops  # noqa: E402

RESULTS = results_dir(__file__)
VOCAB = 49152


def call_ms(fn, x: torch.Tensor, calls: int) -> float:
    t0 = time.perf_counter()
    for _ in range(calls):
        fn(x)
    return (time.perf_counter() - t0) / calls * 1e3


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,32")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--calls", type=int, default=50)
    ap.add_argument("--out", default="argmax_rows")
    args = ap.parse_args()
    load_cpu_ops()
    ops = {"torch.argmax": lambda x: x.argmax(-1), "kaiten_cpu::argmax_rows": torch.ops.kaiten_cpu.argmax_rows}
    load0 = load_avg()
    runs = {}
    lines = ["# argmax over 49152 fp32 logits a row: the extension's op against torch.argmax\n",
             f"CPU: {cpu_name()} ({' '.join(cpu_flags())}), extension ISA {cpu_capability()[0]}, "
             f"{torch.get_num_threads()} threads, torch {torch.__version__}. Median of {args.rounds} alternating "
             f"rounds of {args.calls} calls on random logits.\n",
             "| rows | torch.argmax ms | argmax_rows ms | ratio |", "|---:|---:|---:|---:|"]
    for rows in (int(r) for r in args.rows.split(",")):
        x = torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(rows))
        assert torch.equal(ops["kaiten_cpu::argmax_rows"](x), x.argmax(-1))
        t = runs[rows] = interleaved(list(ops), args.rounds, lambda name: call_ms(ops[name], x, args.calls))
        a, b = statistics.median(t["torch.argmax"]), statistics.median(t["kaiten_cpu::argmax_rows"])
        lines.append(f"| {rows} | {a:.3f} | {b:.3f} | {b / a:.3f} |")
    lines.append(f"\nLoad {load0} before, {load_avg()} after.")
    write_results(RESULTS / args.out, {"cpu": cpu_name(), "flags": cpu_flags(), "isa": cpu_capability()[0],
                                       "ms_by_rows": runs}, "\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
