"""kaiten_cpu::quant_linear of the working tree against the same kernel at another git revision
(--base), in one process (bench/common/base_kernel.py says why and how the base is built). Each shape is
timed as --copies copies of random weights (gguf's own quantizer), so they stream from memory as in
a step; the two kernels alternate, the order reversed every round, and the median of the rounds is
reported, by default through the int8 method (int8 activations in every row) on fp32 x; --dtype
bfloat16 gives the kernels x as a bf16 model's engine does.

    .venv/bin/python bench/kernels/kernel_ab.py [--base HEAD] [--also REV,REV] [--formats Q8_0,Q4_1]
        [--rows 1,8,32,256] [--threads 1,2] [--method int8|registers|dense] [--dtype float32|bfloat16]
        [--rounds 15] [--noise 0.1] [--out NAME]

--also times more revisions in the same rounds (variants kept on a branch, say), each a column and a
ratio against the base, as the working tree is.

--five-bit times the working tree's kernel on two layouts of the same Q5_0/Q5_1/Q5_K weights
instead: the int8 tiles they took before ("base") against the 5-bit tiles (engine_worker/model/
quant_tiles.py), with --formats Q5_0 say; no other revision is built.

--noise F runs a neighbour process busy F of one core in bursts (bench/common/cpu_noise.py) throughout, as
the gateway, Redis and the client load a served engine's cores: how much a kernel's threads lose
when one of them is preempted.

Writes bench/results/kernel_ab/<NAME>.md (default kernel_ab).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.common.base_kernel import base_ops  # noqa: E402
from bench.common.cpu_noise import busy_neighbour  # noqa: E402
from bench.common.machine import cpu_flags, cpu_name, load_avg  # noqa: E402
from bench.common.results_files import results_dir  # noqa: E402
from bench.kernels.quant_linear import NEVER, SHAPES, quantized  # noqa: E402
from engine_worker.model.quant_layers import QuantLinear  # noqa: E402
from kernels.cpu_ops_build import cpu_capability, load_cpu_ops  # noqa: E402

RESULTS = results_dir(__file__)
# (min_dense_rows, int8_rows) forcing each method
METHODS = {"int8": (NEVER, NEVER), "registers": (NEVER, 0), "dense": (0, 0)}


def interleaved(runs: dict, x: torch.Tensor, method: str, rounds: int, clock=time.perf_counter) -> dict[str, float]:
    """Median seconds of one pass over the layers, per (op, layers) of `runs`; they alternate, in
    reversed order every other round."""
    args = METHODS[method]
    times = {name: [] for name in runs}
    for r in range(rounds + 1):
        order = list(runs.items()) if r % 2 else list(reversed(runs.items()))
        for name, (op, layers) in order:
            t0 = clock()
            for q in layers:
                op(x, q.tiles, *q.op_args, *args)
            if r:                                       # round 0 warms up
                times[name].append(clock() - t0)
    return {name: statistics.median(t) for name, t in times.items()}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", default="HEAD", help="git revision of the base kernel")
    ap.add_argument("--also", default="", help="comma-separated git revisions timed beside the base")
    ap.add_argument("--formats", default="Q8_0,Q4_1")
    ap.add_argument("--shapes", default="qkv 960x576,gate_up 3072x576,down 576x1536",
                    help="comma-separated keys of bench/kernels/quant_linear.py's SHAPES")
    ap.add_argument("--rows", default="1,8,32,256")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--method", default="int8", choices=list(METHODS))
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="x's dtype")
    ap.add_argument("--copies", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--noise", type=float, default=0.0, help="a neighbour busy this fraction of one core")
    ap.add_argument("--cpu-time", action="store_true",
                    help="the calling thread's CPU time, not wall time (one thread: a loaded machine's preemptions left out)")
    ap.add_argument("--five-bit", action="store_true", help="the int8 tiles against the 5-bit ones, no revisions")
    ap.add_argument("--out", default="kernel_ab")
    args = ap.parse_args()
    load_cpu_ops()
    if args.cpu_time and args.threads != "1":
        ap.error("--cpu-time times the calling thread: --threads 1 only")
    clock = time.thread_time if args.cpu_time else time.perf_counter
    also = [rev for rev in args.also.split(",") if rev]
    if args.five_bit:
        ops = {"base": torch.ops.kaiten_cpu.quant_linear, "working tree": torch.ops.kaiten_cpu.quant_linear}
        title = "5-bit tiles against the int8 tiles (base), both the working tree's kernel"
    else:
        ops = {"base": base_ops(args.base, "quant_linear_cpu.cpp").quant_linear}
        ops.update({rev: base_ops(rev, "quant_linear_cpu.cpp", f"_also{i}").quant_linear for i, rev in enumerate(also)})
        ops["working tree"] = torch.ops.kaiten_cpu.quant_linear
        title = f"the working tree{''.join(f', {rev}' for rev in also)} against {args.base}"
    others = [name for name in ops if name != "base"]
    lines = [f"# quant_linear: {title}, in one process\n",
             f"CPU: {cpu_name()} ({' '.join(cpu_flags())}), extension ISA {cpu_capability()[0]}, torch "
             f"{torch.__version__}, load before {load_avg()}. Method: {args.method}; {args.dtype} x; {args.copies} copies of "
             f"each shape; median of {args.rounds} interleaved rounds of {'thread CPU' if args.cpu_time else 'wall'} time; a neighbour process busy {args.noise:.0%} of a "
             "core. GMAC/s; ratio: each against the base.\n",
             "| threads | format | shape | rows | base GMAC/s | " + " | ".join(f"{o} GMAC/s | ratio" for o in others) + " |",
             "|---:|---|---|---:|---:|" + "---:|---:|" * len(others)]
    for threads in (int(t) for t in args.threads.split(",")):
        torch.set_num_threads(threads)
        for fmt in args.formats.split(","):
            for label in args.shapes.split(","):
                n, k, _ = SHAPES[label]
                weights = [quantized(fmt, n, k, seed) for seed in range(args.copies)]
                layers = [QuantLinear(p) for p in weights]
                base_layers = [QuantLinear(p, five_bit=False) for p in weights] if args.five_bit else layers
                runs = {name: (op, base_layers if name == "base" else layers) for name, op in ops.items()}
                for m in (int(r) for r in args.rows.split(",")):
                    with busy_neighbour(args.noise):
                        t = interleaved(runs, torch.randn(m, k, dtype=getattr(torch, args.dtype)), args.method, args.rounds, clock)
                    g = {name: args.copies * n * k * m / s / 1e9 for name, s in t.items()}
                    cells = " | ".join(f"{g[o]:.1f} | {g[o] / g['base']:.2f}" for o in others)
                    row = f"| {threads} | {fmt} | {label} | {m} | {g['base']:.1f} | {cells} |"
                    lines.append(row)
                    print(row, flush=True)
    lines.append(f"\nLoad after: {load_avg()}.")
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{args.out}.md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
