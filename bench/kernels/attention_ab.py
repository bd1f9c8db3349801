"""kaiten_cpu::paged_attention of the working tree against the same kernel at another git revision
(--base), in one process (bench/common/base_kernel.py says why and how the base is built): SmolLM2-135M's
attention (9 query heads, 3 kv heads, head_dim 64, fp32 queries, blocks of 16), 30 layers a step,
each layer its own cache on huge pages with a 3 MiB read between layers, so the KV rows come from
memory as in a step. Cases: decode steps (sequences x context) and prefill steps (prompts x
tokens, each a new causal chunk over its own context). The two kernels alternate, the order
reversed every round; medians of the rounds.

    .venv/bin/python bench/kernels/attention_ab.py [--base HEAD] [--threads 1,2] [--rounds 7] [--out NAME]

Writes bench/results/attention_ab/<NAME>.md (default attention_ab).
"""
from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.common.base_kernel import base_ops  # noqa: E402
from bench.common.machine import cpu_flags, cpu_name, load_avg  # noqa: E402
from bench.common.results_files import results_dir  # noqa: E402
from engine_worker.model.host_memory import zeros_on_huge_pages  # noqa: E402
from kernels.cpu_ops_build import cpu_capability, load_cpu_ops  # noqa: E402

RESULTS = results_dir(__file__)
LAYERS, BLOCKS, BS, HKV, D, HQ = 30, 4096, 16, 3, 64, 9
# (kind, sequences, new tokens a sequence, context a sequence)
CASES = [("decode", 32, 1, 384), ("decode", 1, 1, 1024), ("prefill", 4, 256, 256), ("prefill", 1, 512, 1024)]
CACHE_DTYPES = {"fp32": torch.float32, "fp16": torch.float16}


def step_args(batch: int, new: int, ctx: int) -> tuple:
    """(q, cu_seqlens_q, seqlens_k, block_tables) of a step: `batch` sequences of `new` query
    tokens each, the last `new` of a `ctx`-token context, on random blocks."""
    rng = random.Random(batch * 100_000 + new * 1000 + ctx)
    nblk = -(-ctx // BS)
    blocks = rng.sample(range(BLOCKS), nblk * batch)
    tables = torch.tensor([blocks[i * nblk:(i + 1) * nblk] for i in range(batch)], dtype=torch.int32)
    cu = torch.arange(0, (batch + 1) * new, new, dtype=torch.int32)
    lens = torch.full((batch,), ctx, dtype=torch.int32)
    return torch.randn(batch * new, HQ, D), cu, lens, tables


def step_ms(op, caches, flush, args) -> float:
    """One step's kernel time summed over the layers (the flush between layers not timed)."""
    q, cu, lens, tables = args
    total = 0.0
    for k, v in caches:
        flush.sum()
        t0 = time.perf_counter()
        op(q, k, v, cu, lens, tables, D ** -0.5)
        total += time.perf_counter() - t0
    return total * 1e3


def interleaved_medians(ops: dict, cases: list, cache_dtypes: dict, threads: list[int], rounds: int) -> dict:
    """Median ms of a step of every op, {(threads, case, cache dtype, op name): ms}: the ops
    interleaved round by round, their order reversed every other round, after a warm-up round."""
    torch.manual_seed(0)
    caches = {name: [(zeros_on_huge_pages((BLOCKS, BS, HKV, D), dt).normal_(),
                      zeros_on_huge_pages((BLOCKS, BS, HKV, D), dt).normal_()) for _ in range(LAYERS)]
              for name, dt in cache_dtypes.items()}
    flush = torch.randn(3 << 18)
    inputs = {case: step_args(*case[1:]) for case in cases}
    times: dict[tuple, list[float]] = {}
    for rnd in range(rounds + 1):                       # round 0 warms up
        order = list(ops.items()) if rnd % 2 else list(reversed(ops.items()))
        for n in threads:
            torch.set_num_threads(n)
            for case in cases:
                for cname in cache_dtypes:
                    for name, op in order:
                        ms = step_ms(op, caches[cname], flush, inputs[case])
                        if rnd:
                            times.setdefault((n, case, cname, name), []).append(ms)
    return {key: statistics.median(v) for key, v in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", default="HEAD", help="git revision of the base kernel")
    ap.add_argument("--threads", default=f"{torch.get_num_threads()},1")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--out", default="attention_ab")
    args = ap.parse_args()
    load_cpu_ops()
    ops = {"base": base_ops(args.base, "paged_attention_cpu.cpp").paged_attention,
           "working tree": torch.ops.kaiten_cpu.paged_attention}
    load0 = load_avg()
    threads = [int(t) for t in args.threads.split(",")]
    med = interleaved_medians(ops, CASES, CACHE_DTYPES, threads, args.rounds)
    lines = [f"# paged_attention: the working tree against {args.base}, in one process\n",
             f"CPU: {cpu_name()} ({' '.join(cpu_flags())}), kernel ISA {cpu_capability()[0]}, torch "
             f"{torch.__version__}; load {load0} before, {load_avg()} after. SmolLM2-135M's attention, {LAYERS} "
             f"layers a step, fp32 queries; median of {args.rounds} interleaved rounds. ms a step; ratio: "
             "working tree / base.\n",
             "| threads | step | cache | base ms | working tree ms | ratio |", "|---:|---|---|---:|---:|---:|"]
    for n in threads:
        for kind, batch, new, ctx in CASES:
            shape = f"{batch} x {ctx}" if kind == "decode" else f"{batch} x {new} tokens at {ctx}"
            for cname in CACHE_DTYPES:
                b, w = med[(n, (kind, batch, new, ctx), cname, "base")], med[(n, (kind, batch, new, ctx), cname, "working tree")]
                lines.append(f"| {n} | {kind} {shape} | {cname} | {b:.2f} | {w:.2f} | {w / b:.3f} |")
    out = RESULTS / f"{args.out}.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
