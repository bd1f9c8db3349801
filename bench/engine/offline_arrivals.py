"""The engine alone on a served run's arrivals: what serving costs at a concurrency.

`vllm bench serve --max-concurrency C` keeps C requests in flight and sends the next as one
finishes. This runs the same arrivals through `LLM.step` in one process (no gateway, Redis or
client): C random-token prompts of --input-len submitted, then a new one as each finishes, until
--num-prompts have finished with --output-len tokens each (greedy, ignore_eos); the model is a GGUF
file or folder, quantization auto, a token budget of --token-budget (a CPU server's default, not
the offline LLM's). Compare its output tok/s with bench/peers/peer_llamacpp.py's or
bench/serving/serve_step.py's for the same file and concurrency: the difference is the serving path's.

    .venv/bin/python bench/engine/offline_arrivals.py --model <GGUF> [--concurrency 32] [--num-prompts 64]
        [--input-len 256] [--output-len 128] [--token-budget 1024] [--out bench/results/offline_arrivals/offline_arrivals]

Writes <out>.md and <out>.json: output tok/s, and the steps split at --long-step seconds (those
that prefill a prompt chunk, roughly) into their count and time.
"""
from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.common.machine import cpu_flags, cpu_id, cpu_name, load_avg  # noqa: E402
from bench.common.results_files import results_dir, write_results  # noqa: E402
from engine_worker import LLM, SamplingParams  # noqa: E402
from kernels.cpu_ops_build import cpu_capability  # noqa: E402


def run(llm: LLM, args) -> tuple[int, float, list[float]]:
    """Output tokens, seconds and each step's seconds for the arrivals."""
    rng = random.Random(args.seed)
    vocab = llm.engine.vocab_size
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)

    def submit() -> None:
        llm.submit([rng.randrange(100, vocab) for _ in range(args.input_len)], params)

    submitted, finished, tokens, steps = min(args.concurrency, args.num_prompts), 0, 0, []
    for _ in range(submitted):
        submit()
    t0 = time.perf_counter()
    while finished < args.num_prompts:
        t = time.perf_counter()
        outs = llm.step()
        steps.append(time.perf_counter() - t)
        for out in outs:
            tokens += len(out.new_token_ids)
            if out.finished:
                finished += 1
                if submitted < args.num_prompts:
                    submit()
                    submitted += 1
    return tokens, time.perf_counter() - t0, steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="a GGUF file or a model folder")
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--token-budget", type=int, default=1024, help="as a CPU server's default")
    ap.add_argument("--long-step", type=float, default=0.3)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--dtype", default="auto", help="as `kaiten serve --dtype`")
    ap.add_argument("--out", default=str(results_dir(__file__) / "offline_arrivals"))
    args = ap.parse_args()
    before = load_avg()
    llm = LLM(args.model, dtype=args.dtype, quantization="auto", max_num_seqs=max(args.concurrency, 1),
              max_num_batched_tokens=args.token_budget)
    llm.generate([[100 + i for i in range(args.input_len)]] * 2,
                 SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))     # compiles, warms up
    tokens, seconds, steps = run(llm, args)
    long = [s for s in steps if s > args.long_step]
    short = [s for s in steps if s <= args.long_step]
    report = {"cpu": cpu_name(), "cpu_id": cpu_id(), "flags": " ".join(cpu_flags()), "isa": cpu_capability()[0],
              "dtype": str(llm.engine.runner.dtype).removeprefix("torch."),
              "model": Path(args.model).name, "concurrency": args.concurrency, "num_prompts": args.num_prompts,
              "input_len": args.input_len, "output_len": args.output_len, "load_avg_before": before,
              "load_avg_after": load_avg(), "output_tokens": tokens, "seconds": seconds,
              "output_tok_s": tokens / seconds, "steps": len(steps), "long_steps": len(long),
              "long_steps_s": sum(long), "short_steps": len(short), "short_steps_s": sum(short),
              "short_step_median_ms": 1e3 * statistics.median(short) if short else None}
    markdown = "\n".join([
        "# The engine alone on a served run's arrivals (bench/engine/offline_arrivals.py)\n",
        f"CPU: {report['cpu']} ({report['cpu_id']}; flags: {report['flags']}), extension ISA {report['isa']}, "
        f"dtype {report['dtype']} (--dtype {args.dtype}). "
        f"Load {before} before, {report['load_avg_after']} after. {report['model']}, quantization auto: "
        f"a token budget of {args.token_budget}, {args.concurrency} requests in flight, a new one as each finishes, {args.num_prompts} in all, "
        f"random {args.input_len}-token prompts, {args.output_len} tokens each (greedy, ignore_eos).\n",
        "| output tok/s | seconds | steps | steps over "
        f"{args.long_step} s (s) | other steps (s) | other steps' median ms |",
        "|---:|---:|---:|---:|---:|---:|",
        f"| {report['output_tok_s']:.1f} | {seconds:.1f} | {len(steps)} | {len(long)} ({sum(long):.1f}) | "
        f"{len(short)} ({sum(short):.1f}) | {report['short_step_median_ms'] or 0:.1f} |",
    ])
    write_results(args.out, report, markdown)


if __name__ == "__main__":
    main()
