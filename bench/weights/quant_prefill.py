"""Prefill speed of the default model served quantized (--quantization auto: the GGUF's matrices
multiplied as stored, by the kernel's GEMMs) against the same file dequantized (none: oneDNN on
prepacked dense weights), in the dtype auto picks.

Both engines live in one process, with prefix caching off. Each round, each engine in turn
prefills the same --prompts random prompts of --length tokens (max_tokens 1) under a step budget of
--budget tokens; the median over rounds of its time per prompt token is reported, and the ratio
quantized / dequantized (<1: the quantized engine is faster).

    .venv/bin/python bench/weights/quant_prefill.py [--prompts 16] [--length 256] [--budget 1024] [--rounds 3]

Writes bench/results/quant_prefill/quant_prefill.md.
"""
from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.common.machine import cpu_flags, cpu_name, load_avg  # noqa: E402
from bench.common.results_files import results_dir  # noqa: E402
from engine_worker import LLM, SamplingParams  # noqa: E402
from kernels.cpu_ops_build import cpu_capability  # noqa: E402
from shared.config import CPU_TOKEN_BUDGET  # noqa: E402
from shared.gguf_convert import ensure_default_model  # noqa: E402

RESULTS = results_dir(__file__)
ENGINES = {"quantized (auto)": "auto", "dequantized (none)": "none"}


def prefill_ms_per_token(llm: LLM, prompts: list[list[int]]) -> float:
    t0 = time.perf_counter()
    out = llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0.0))
    assert all(c.finish_reason for c in out)
    return (time.perf_counter() - t0) * 1e3 / sum(len(p) for p in prompts)


def prefill_rounds(engines: dict[str, LLM], prompts: int, length: int, rounds: int,
                   reverse_every_other: bool = False) -> dict[str, list[float]]:
    """Each engine's ms a prompt token in each of `rounds` rounds (after an untimed warm-up round):
    every round new random prompts, prefilled by each engine in turn (the order reversed in every
    other round if asked)."""
    rng = random.Random(0)
    vocab = next(iter(engines.values())).engine.vocab_size
    times: dict[str, list[float]] = {name: [] for name in engines}
    for r in range(rounds + 1):                      # round 0 warms up
        batch = [[rng.randrange(100, vocab) for _ in range(length)] for _ in range(prompts)]
        order = list(engines)[::-1] if reverse_every_other and r % 2 == 0 else list(engines)
        for name in order:
            ms = prefill_ms_per_token(engines[name], batch)
            if r:
                times[name].append(ms)
    return times


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--length", type=int, default=256)
    ap.add_argument("--budget", type=int, default=CPU_TOKEN_BUDGET, help="max_num_batched_tokens")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    model = str(ensure_default_model())
    engines = {name: LLM(model, quantization=q, enable_prefix_caching=False, max_num_batched_tokens=args.budget)
               for name, q in ENGINES.items()}
    load_before = load_avg()
    times = prefill_rounds(engines, args.prompts, args.length, args.rounds)
    med = {name: statistics.median(t) for name, t in times.items()}
    ratio = med["quantized (auto)"] / med["dequantized (none)"]
    dtype = str(next(iter(engines.values())).engine.runner.dtype).removeprefix("torch.")
    lines = ["# Prefill: quantized weights as stored against dequantized\n",
             f"CPU: {cpu_name()} ({' '.join(cpu_flags())}), extension ISA {cpu_capability()[0]}, "
             f"dtype {dtype}, load before {load_before}, after {load_avg()}.\n",
             f"{args.prompts} random prompts of {args.length} tokens, max_tokens 1, budget {args.budget} tokens "
             f"a step, prefix caching off; median of {args.rounds} rounds (engines alternating).\n",
             "| engine | ms a prompt token (median) | rounds |", "|---|---:|---|"]
    for name, t in times.items():
        lines.append(f"| {name} | {med[name]:.3f} | {', '.join(f'{v:.3f}' for v in t)} |")
    lines.append(f"\nquantized / dequantized: **{ratio:.2f}x** the time.")
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "quant_prefill.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
