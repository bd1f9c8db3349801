"""The engine's steps with --deterministic (the default) against --no-deterministic: each engine in
its own process, the two alternating --rounds times (the order reversed every other round), medians
over the rounds. (Two engines in one process were not a fair pair: on a 2-core Zen 4 they put the
deterministic prefill at 1.09x in 7 rounds, separate processes at 1.03x in 2, and one-off runs of
a process each way at 0.91x; a process's memory placement moves its steps by 10-30%.)
Per process, after a round that warms up:

  decode   --batch random prompts of --context tokens prefilled, 5 untimed steps, then the median
           of 20 decode steps (ms a step; batch 1 is the TPOT of one stream);
  prefill  --prompts new prompts of --context tokens in one step (max_tokens 1), the median of 3,
           in ms a prompt token.

Prefix caching is off, so every round prefills. --enforce-eager runs the eager forward (a cold
compile of two engines takes minutes on a small machine).

    .venv/bin/python bench/engine/deterministic_cost.py [--model PATH] [--quantization auto] [--dtype float32]
        [--batch 1,32] [--context 256] [--prompts 4] [--rounds 3] [--enforce-eager] [--out NAME]

Writes bench/results/batch_invariance/<NAME>.md (default deterministic_cost).
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.common.machine import cpu_flags, cpu_name, load_avg  # noqa: E402
from bench.common.results_files import RESULTS  # noqa: E402
from bench.common.timing import interleaved, measure_in_process  # noqa: E402
from engine_worker import LLM, SamplingParams  # noqa: E402


def prompts(n: int, length: int, vocab: int, rng: random.Random) -> list[list[int]]:
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(n)]


def timed_step(llm: LLM) -> float:
    t0 = time.perf_counter()
    llm.step()
    return time.perf_counter() - t0


def decode_ms(llm: LLM, batch: int, context: int, vocab: int, rng: random.Random) -> float:
    for p in prompts(batch, context, vocab, rng):
        llm.submit(p, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
    while llm.engine.scheduler.waiting or any(s.num_computed_tokens < s.num_prompt_tokens
                                              for s in llm.engine.scheduler.running):
        llm.step()
    for _ in range(5):
        llm.step()
    ms = statistics.median(timed_step(llm) * 1e3 for _ in range(20))
    while llm.engine.has_unfinished():
        llm.step()
    return ms


def prefill_ms(llm: LLM, n: int, context: int, vocab: int, rng: random.Random) -> float:
    times = []
    for _ in range(3):
        for p in prompts(n, context, vocab, rng):
            llm.submit(p, SamplingParams(max_tokens=1, temperature=0.0))
        times.append(timed_step(llm) * 1e3 / (n * context))
        while llm.engine.has_unfinished():
            llm.step()
    return statistics.median(times)


def measure(args, deterministic: bool) -> dict[str, float]:
    """One engine's steps (run in its own process): {step: ms}."""
    llm = LLM(args.model, deterministic=deterministic, dtype=args.dtype, quantization=args.quantization,
              enable_prefix_caching=False, enforce_eager=args.enforce_eager,
              max_num_batched_tokens=max(args.prompts * args.context, 1024))
    vocab = llm.engine.runner.model_config.vocab_size
    out = {}
    for rnd in range(2):                                # round 0 warms up
        rng = random.Random(rnd)
        for b in (int(b) for b in args.batch.split(",")):
            out[f"decode {b} x {args.context}"] = decode_ms(llm, b, args.context, vocab, rng)
        out[f"prefill {args.prompts} x {args.context} (ms a token)"] = prefill_ms(llm, args.prompts, args.context,
                                                                                  vocab, rng)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="")
    ap.add_argument("--quantization", default="auto")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--batch", default="1,32")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--out", default="deterministic_cost")
    ap.add_argument("--measure", choices=["deterministic", "no-deterministic"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.measure:
        print(json.dumps(measure(args, args.measure == "deterministic")))
        return
    load0 = load_avg()
    runs = interleaved(["no-deterministic", "deterministic"], args.rounds,
                       lambda name: measure_in_process(__file__, [name, *sys.argv[1:]]))
    times = {(step, name): [r[step] for r in rs] for name, rs in runs.items() for step in rs[0]}
    med = {key: statistics.median(v) for key, v in times.items()}
    model = args.model or "the default model (SmolLM2-135M-Instruct Q4_1)"
    lines = ["# The engine with --deterministic against --no-deterministic, each in its own process\n",
             f"CPU: {cpu_name()} ({' '.join(cpu_flags())}), torch {torch.__version__}, {torch.get_num_threads()} "
             f"threads; load {load0} before, {load_avg()} after. {model}, quantization {args.quantization}, "
             f"dtype {args.dtype}, {'eager' if args.enforce_eager else 'compiled'}; medians of {args.rounds} "
             "alternating rounds (each value: a process). ratio: deterministic / no-deterministic.\n",
             "| step | no-deterministic (rounds) | deterministic (rounds) | ratio |", "|---|---:|---:|---:|"]
    for step in dict.fromkeys(k[0] for k in med):
        off, on = med[(step, "no-deterministic")], med[(step, "deterministic")]
        rounds = lambda name: ", ".join(f"{v:.3f}" for v in times[(step, name)])  # noqa: E731
        lines.append(f"| {step} | {off:.3f} ({rounds('no-deterministic')}) | {on:.3f} ({rounds('deterministic')}) "
                     f"| {on / off:.3f} |")
    out = RESULTS / "batch_invariance" / f"{args.out}.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
