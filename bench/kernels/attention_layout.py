"""Would a head-major KV cache speed up decode attention? The engine's cache is token-major within a
block ([blocks, 16, Hkv, D]: a tile's 16 rows of one kv head are 128 bytes every 384 on SmolLM2).
A head-major block ([blocks, Hkv, 16, D]) keeps a tile of one kv head contiguous. It is simulated
here without touching the kernel: Hkv caches of one kv head each ([blocks, 16, 1, D]), each met by
its G query heads in its own call, hold exactly the head-major bytes of each (block, kv head). The
two give the same output (checked), and the rounds alternate them; each step is the 30 layers'
kernel time, as bench/kernels/attention_one_stream.py times it (fp16 caches on huge pages, a read between
layers).

    .venv/bin/python bench/kernels/attention_layout.py [--batch 32] [--context 384] [--rounds 15] [--threads 0]

Writes bench/results/attention_layout/attention_layout.{md,json}.
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
from bench.kernels.attention_one_stream import BLOCKS, BS, D, HKV, HQ, LAYERS, decode_meta  # noqa: E402
from engine_worker.model.host_memory import zeros_on_huge_pages  # noqa: E402
from kernels.cpu_ops_build import cpu_capability, load_cpu_ops  # noqa: E402

RESULTS = results_dir(__file__)

G = HQ // HKV


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--context", type=int, default=384)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--threads", type=int, default=0, help="0: torch's default")
    ap.add_argument("--out", default=str(RESULTS / "attention_layout"))
    args = ap.parse_args()
    load_cpu_ops()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    load0 = load_avg()
    token_major = [tuple(zeros_on_huge_pages((BLOCKS, BS, HKV, D), torch.float16).normal_() for _ in "kv")
                   for _ in range(LAYERS)]
    head_major = [[tuple(zeros_on_huge_pages((BLOCKS, BS, 1, D), torch.float16) for _ in "kv") for _ in range(HKV)]
                  for _ in range(LAYERS)]
    for layer, heads in zip(token_major, head_major):
        for h, pair in enumerate(heads):
            for dst, src in zip(pair, layer):
                dst.copy_(src[:, :, h:h + 1])
    meta = decode_meta(args.batch, args.context)
    q = torch.randn(args.batch, HQ, D)
    q_heads = [q[:, G * h:G * (h + 1)].contiguous() for h in range(HKV)]
    attend = lambda qq, k, v: torch.ops.kaiten_cpu.paged_attention(qq, k, v, *meta, D ** -0.5)   # noqa: E731
    same = torch.equal(attend(q, *token_major[0]),
                       torch.cat([attend(q_heads[h], *head_major[0][h]) for h in range(HKV)], 1))
    flush = torch.randn(3 << 18)

    def step(layout: str) -> float:
        total = 0.0
        for layer in range(LAYERS):
            flush.sum()
            t0 = time.perf_counter()
            if layout == "token-major":
                attend(q, *token_major[layer])
            else:
                for h in range(HKV):
                    attend(q_heads[h], *head_major[layer][h])
            total += time.perf_counter() - t0
        return total * 1e3

    runs: dict[str, list[float]] = {"token-major": [], "head-major": []}
    for rnd in range(args.rounds):
        for layout in (runs if rnd % 2 == 0 else reversed(list(runs))):
            runs[layout].append(step(layout))
    med = {k: statistics.median(v) for k, v in runs.items()}
    ratios = [h / t for t, h in zip(runs["token-major"], runs["head-major"])]
    report = {"cpu": cpu_name(), "flags": cpu_flags(), "isa": cpu_capability()[0], "threads": torch.get_num_threads(),
              "batch": args.batch, "context": args.context, "rounds": args.rounds, "same_output": same,
              "load_before": load0, "load_after": load_avg(), "median_ms": med, "runs": runs}
    lines = ["# Decode attention: token-major against head-major KV blocks\n",
             f"CPU: {cpu_name()} ({' '.join(cpu_flags())}), kernel ISA {report['isa']}, {report['threads']} threads, "
             f"torch {torch.__version__}; load {load0} before, {report['load_after']} after. {args.batch} sequences at "
             f"{args.context}, fp16 caches on huge pages, {LAYERS} layers; head-major simulated as {HKV} one-head "
             f"caches, one call each (same output: {same}). Median of {args.rounds} alternating rounds.\n",
             "| layout | ms a step | / token-major (median of rounds) |", "|---|---:|---:|",
             f"| token-major (the engine's) | {med['token-major']:.2f} | |",
             f"| head-major | {med['head-major']:.2f} | {statistics.median(ratios):.3f}x |"]
    write_results(args.out, report, "\n".join(lines))


if __name__ == "__main__":
    main()
