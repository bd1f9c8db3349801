"""One stream's decode attention on the CPU: the C++ kernel's 30 layers of a step, all threads
against one thread, in one run.

A single decode has as many work items as kv heads (3 for SmolLM2-135M), too few for the threads;
the kernel splits them over the context and merges the parts (paged_attention_cpu.cpp,
split_decodes). Each layer has a cache of its own, and a 3 MiB buffer is read between layers
(about a layer's quantized weights), so the KV rows come from memory as in a step. Also a batch
of 4 and of 32 decodes (no split) as a check that batched steps keep their speed. Each case runs
on an fp32 cache and on an fp16 one (--kv-cache-dtype float16, widened to fp32 as read, fp32
queries), both on huge pages as the engine's. Rounds alternate the thread counts; the table gives
the medians.

    .venv/bin/python bench/kernels/attention_one_stream.py [--rounds 5]

Writes bench/results/attention_one_stream/attention_one_stream.{md,json}.
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

from bench.common.machine import cpu_flags, cpu_name, load_avg  # noqa: E402
from bench.common.results_files import results_dir, write_results  # noqa: E402
from engine_worker.model.host_memory import zeros_on_huge_pages  # noqa: E402
from kernels.cpu_ops_build import cpu_capability, load_cpu_ops  # noqa: E402

RESULTS = results_dir(__file__)
LAYERS, BLOCKS, BS, HKV, D, HQ = 30, 4096, 16, 3, 64, 9
CASES = [(1, 256), (1, 1024), (4, 1024), (32, 384)]     # (sequences, context)
CACHE_DTYPES = {"fp32": torch.float32, "fp16": torch.float16}


def decode_meta(batch: int, ctx: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """cu_seqlens_q, seqlens_k and block tables of `batch` decodes at context `ctx`, each on its
    own random blocks of the cache (the same for the same case)."""
    rng = random.Random(batch * 100_000 + ctx)
    nblk = -(-ctx // BS)
    blocks = rng.sample(range(BLOCKS), nblk * batch)
    tables = torch.tensor([blocks[i * nblk:(i + 1) * nblk] for i in range(batch)], dtype=torch.int32)
    return torch.arange(batch + 1, dtype=torch.int32), torch.full((batch,), ctx, dtype=torch.int32), tables


def step_ms(caches, flush, batch: int, ctx: int, reps: int) -> float:
    """Median over reps of the kernel's time summed over the layers (the flush is not timed)."""
    cu, lens, tables = decode_meta(batch, ctx)
    q = torch.randn(batch, HQ, D)
    totals = []
    for _ in range(reps):
        total = 0.0
        for k, v in caches:
            flush.sum()
            t0 = time.perf_counter()
            torch.ops.kaiten_cpu.paged_attention(q, k, v, cu, lens, tables, D ** -0.5)
            total += time.perf_counter() - t0
        totals.append(total * 1e3)
    return statistics.median(totals)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--out", default=str(RESULTS / "attention_one_stream"))
    args = ap.parse_args()
    load_cpu_ops()
    torch.manual_seed(0)
    load0 = load_avg()
    def cache(dtype):
        return zeros_on_huge_pages((BLOCKS, BS, HKV, D), dtype).normal_()
    caches = {name: [(cache(dt), cache(dt)) for _ in range(LAYERS)] for name, dt in CACHE_DTYPES.items()}
    flush = torch.randn(3 << 18)
    threads = torch.get_num_threads()
    runs: dict[str, list[float]] = {}
    for rnd in range(args.rounds):
        for n in ((threads, 1) if rnd % 2 == 0 else (1, threads)):
            torch.set_num_threads(n)
            for batch, ctx in CASES:
                for name in CACHE_DTYPES:
                    runs.setdefault(f"{name}:{batch}x{ctx}@{n}", []).append(
                        step_ms(caches[name], flush, batch, ctx, args.reps))
    torch.set_num_threads(threads)
    med = {k: round(statistics.median(v), 3) for k, v in runs.items()}
    result = {"cpu": cpu_name(), "flags": cpu_flags(), "isa": cpu_capability()[0], "threads": threads,
              "load_before": load0, "load_after": load_avg(), "rounds": args.rounds, "median_ms": med, "runs": runs}
    lines = ["# One stream's decode attention: all threads against one\n",
             f"CPU: {cpu_name()} ({' '.join(cpu_flags())}), kernel ISA {result['isa']}, torch {torch.__version__}; "
             f"load {load0} before, {result['load_after']} after. SmolLM2-135M's attention (9 query heads, 3 kv "
             f"heads, head_dim 64, fp32 queries, block 16), {LAYERS} layers, caches on huge pages, a 3 MiB read "
             f"between layers; median of {args.rounds} alternating rounds of the median of {args.reps} steps.\n",
             f"| sequences x context | fp32 cache, {threads} threads ms | 1 thread ms | {threads} / 1 "
             f"| fp16 cache, {threads} threads ms | 1 thread ms | fp16 / fp32, {threads} threads |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for batch, ctx in CASES:
        a, b = med[f"fp32:{batch}x{ctx}@{threads}"], med[f"fp32:{batch}x{ctx}@1"]
        c, d = med[f"fp16:{batch}x{ctx}@{threads}"], med[f"fp16:{batch}x{ctx}@1"]
        lines.append(f"| {batch} x {ctx} | {a:.2f} | {b:.2f} | {a / b:.2f} | {c:.2f} | {d:.2f} | {c / a:.2f} |")
    write_results(args.out, result, "\n".join(lines))


if __name__ == "__main__":
    main()
