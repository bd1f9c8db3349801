"""Where a decode step's time goes on the default model served quantized (--quantization auto).

B requests of --context random tokens are prefilled, then --steps decode steps run under
torch.profiler (after untimed warm-up steps); the table splits the mean step time into
kaiten_cpu::quant_linear per weight shape (qkv, o, gate_up, down, lm_head), the attention ops,
and the rest (norms, rope, activations, sampling, the engine's Python).

    .venv/bin/python bench/quant_step_profile.py [--batch 1] [--context 256] [--steps 40] [--threads 0]

Writes bench/results/quant_step_profile_b<B>.md.
"""
from __future__ import annotations

import argparse
import random
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.engine_throughput import step_until_decoding  # noqa: E402
from bench.machine import cpu_flags, cpu_name, load_avg  # noqa: E402
from engine_worker import LLM, SamplingParams  # noqa: E402
from engine_worker.model.quant_tiles import TILE_ROWS  # noqa: E402
from kernels.cpu_attention import cpu_capability  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
NAMES = {960: "qkv", 576: "o or down", 3072: "gate_up", 49152: "lm_head"}   # by output features


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: one per core)")
    ap.add_argument("--model", default="", help="a GGUF file or a model folder (default: the default model)")
    args = ap.parse_args()
    from shared.gguf_convert import ensure_converted_gguf, ensure_default_model
    load0 = load_avg()
    model = ensure_converted_gguf(args.model) if args.model.endswith(".gguf") else args.model or ensure_default_model()
    llm = LLM(str(model), max_num_seqs=64, kv_cache_memory="512MiB", quantization="auto",
              num_threads=args.threads)
    rng = random.Random(0)
    params = SamplingParams(temperature=0, max_tokens=args.steps + 20, ignore_eos=True)
    for _ in range(args.batch):
        llm.submit([rng.randrange(3, 49152) for _ in range(args.context)], params)
    step_until_decoding(llm)
    for _ in range(10):
        llm.step()
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        for _ in range(args.steps):
            llm.step()
    step_ms = (time.perf_counter() - t0) * 1e3 / args.steps
    parts: dict[str, float] = defaultdict(float)
    for e in prof.key_averages(group_by_input_shape=True):
        if e.key == "kaiten_cpu::quant_linear":
            n, k = e.input_shapes[1][0] * TILE_ROWS, e.input_shapes[0][-1]     # tiles [n / TILE_ROWS, bytes]
            parts[f"quant_linear {NAMES.get(n, n)} ({n}x{k})"] += e.self_cpu_time_total / 1e3 / args.steps
        elif e.key.startswith("kaiten_cpu::") and "linear" not in e.key:
            parts[e.key] += e.self_cpu_time_total / 1e3 / args.steps
    rest = step_ms - sum(parts.values())
    lines = [f"# Decode step profile, {Path(str(model)).name} quantized, B={args.batch}, context {args.context}\n",
             f"CPU: {cpu_name()} ({' '.join(cpu_flags())}), {torch.get_num_threads()} threads, extension ISA "
             f"{cpu_capability()[0]}, torch {torch.__version__}; load {load0} before, {load_avg()} after. "
             f"Mean of {args.steps} steps under torch.profiler (its overhead is in 'rest').\n",
             "| part | ms a step | share |", "|---|---:|---:|"]
    for name, ms in sorted(parts.items(), key=lambda kv: -kv[1]):
        lines.append(f"| {name} | {ms:.2f} | {ms / step_ms:.0%} |")
    lines += [f"| rest (norms, rope, silu, sampling, Python) | {rest:.2f} | {rest / step_ms:.0%} |",
              f"| **step** | **{step_ms:.2f}** | |"]
    text = "\n".join(lines) + "\n"
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"quant_step_profile_b{args.batch}{'_' + Path(args.model).stem if args.model else ''}.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
