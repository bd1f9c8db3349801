"""Where a step's time goes on the default model served quantized (--quantization auto).

Decode (default): B requests of --context random tokens are prefilled, then --steps decode steps
run under torch.profiler (after untimed warm-up steps). Prefill (--prefill P): each step prefills
P new prompts of --context tokens (max_tokens 1, prefix caching off, a token budget of P x
context). The table splits the mean step time into kaiten_cpu::quant_linear per weight shape
(qkv, o, gate_up, down, lm_head), the attention ops, and the rest (norms, rope, activations,
sampling, the engine's Python), and gives the median of as many steps timed without the profiler
first: the profiler's overhead is not spread evenly over the ops (on a Xeon's prefill step gate_up
took 1.8x its time alone under it, while the step without it was the sum of the parts' own times).

    .venv/bin/python bench/weights/quant_step_profile.py [--batch 1] [--context 256] [--steps 40] [--threads 0]
        [--prefill 0] [--dtype auto] [--model GGUF] [--out bench/results/quant_step_profile/NAME]

Writes bench/results/quant_step_profile/quant_step_profile_b<B>[_<model>].md (_p<P> for prefill), or --out.md.
"""
from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.common.machine import cpu_flags, cpu_name, load_avg  # noqa: E402
from bench.common.results_files import results_dir  # noqa: E402
from bench.engine.engine_throughput import step_until_decoding  # noqa: E402
from engine_worker import LLM, SamplingParams  # noqa: E402
from engine_worker.model.quant_tiles import TILE_ROWS  # noqa: E402
from kernels.cpu_ops_build import cpu_capability  # noqa: E402

RESULTS = results_dir(__file__)
NAMES = {960: "qkv", 576: "o or down", 3072: "gate_up", 49152: "lm_head"}   # by output features


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: one per core)")
    ap.add_argument("--model", default="", help="a GGUF file or a model folder (default: the default model)")
    ap.add_argument("--prefill", type=int, default=0, help="profile prefill steps of this many prompts")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--out", default="", help="results path without .md (default: by batch and model)")
    args = ap.parse_args()
    from shared.gguf_convert import ensure_converted_gguf, ensure_default_model
    load0 = load_avg()
    model = ensure_converted_gguf(args.model) if args.model.endswith(".gguf") else args.model or ensure_default_model()
    budget = args.prefill * args.context if args.prefill else 0
    llm = LLM(str(model), max_num_seqs=64, kv_cache_memory="512MiB", quantization="auto", dtype=args.dtype,
              num_threads=args.threads, enable_prefix_caching=not args.prefill, max_num_batched_tokens=budget)
    rng = random.Random(0)
    prompt = lambda: [rng.randrange(3, 49152) for _ in range(args.context)]   # noqa: E731
    step = prefill_step(llm, prompt, args.prefill) if args.prefill else decode_step(llm, prompt, args)
    for _ in range(10 if not args.prefill else 2):
        step()
    plain_ms = statistics.median(step() for _ in range(args.steps)) * 1e3
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        step_ms = sum(step() for _ in range(args.steps)) * 1e3 / args.steps
    parts: dict[str, float] = defaultdict(float)
    for e in prof.key_averages(group_by_input_shape=True):
        if e.key == "kaiten_cpu::quant_linear":
            n, k = e.input_shapes[1][0] * TILE_ROWS, e.input_shapes[0][-1]     # tiles [n / TILE_ROWS, bytes]
            parts[f"quant_linear {NAMES.get(n, n)} ({n}x{k})"] += e.self_cpu_time_total / 1e3 / args.steps
        elif e.key.startswith("kaiten_cpu::") and "linear" not in e.key:
            parts[e.key] += e.self_cpu_time_total / 1e3 / args.steps
    rest = step_ms - sum(parts.values())
    kind = f"Prefill step profile, {args.prefill} prompts" if args.prefill else f"Decode step profile, B={args.batch}"
    lines = [f"# {kind}, {Path(str(model)).name} quantized, {llm.engine.runner.dtype}, context {args.context}\n",
             f"CPU: {cpu_name()} ({' '.join(cpu_flags())}), {torch.get_num_threads()} threads, extension ISA "
             f"{cpu_capability()[0]}, torch {torch.__version__}; load {load0} before, {load_avg()} after. "
             f"Mean of {args.steps} steps under torch.profiler; the same steps without it: {plain_ms:.2f} ms "
             f"(median). The profiler's overhead lands unevenly: on a Xeon's prefill step nearly all of it fell "
             "on gate_up, which took its own time alone without it (bench/kernels/quant_linear.py).\n",
             "| part | ms a step | share |", "|---|---:|---:|"]
    for name, ms in sorted(parts.items(), key=lambda kv: -kv[1]):
        lines.append(f"| {name} | {ms:.2f} | {ms / step_ms:.0%} |")
    lines += [f"| rest (norms, rope, silu, sampling, Python) | {rest:.2f} | {rest / step_ms:.0%} |",
              f"| **step** | **{step_ms:.2f}** | |", f"| step without the profiler (median) | {plain_ms:.2f} | |"]
    text = "\n".join(lines) + "\n"
    name = f"p{args.prefill}" if args.prefill else f"b{args.batch}"
    out = Path(args.out + ".md") if args.out else \
        RESULTS / f"quant_step_profile_{name}{'_' + Path(args.model).stem if args.model else ''}.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(text)
    return 0


def decode_step(llm: LLM, prompt, args):
    """A timed decode step of args.batch requests, once their prompts are computed. Their budget
    lasts the warm-up and both timed passes (without the profiler, then under it)."""
    for _ in range(args.batch):
        llm.submit(prompt(), SamplingParams(temperature=0, max_tokens=2 * args.steps + 20, ignore_eos=True))
    step_until_decoding(llm)
    return lambda: timed(llm.step)


def prefill_step(llm: LLM, prompt, prompts: int):
    """A timed step that prefills `prompts` new prompts (their submission not timed)."""
    def step() -> float:
        for _ in range(prompts):
            llm.submit(prompt(), SamplingParams(temperature=0, max_tokens=1))
        return timed(llm.step)
    return step


def timed(f) -> float:
    t0 = time.perf_counter()
    f()
    return time.perf_counter() - t0


if __name__ == "__main__":
    sys.exit(main())
