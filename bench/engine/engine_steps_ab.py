"""The engine's decode and prefill steps in the working tree against a git revision, on one machine.

A kernel change is timed in the kernel alone by bench/kernels/kernel_ab.py; this times what it does to the
engine's steps. The revision is checked out as a git worktree (in ~/.cache/kaiten/engine_steps_ab,
its extension built there on first use), and each tree runs in its own process, the two
alternating --rounds times (the order reversed every other round). Each process, on --model (a
GGUF file, or the default model) with quantization auto, the given --dtype and prefix caching off:

  decode   --batch random prompts of --context tokens prefilled, 10 untimed steps, then the
           median of 30 decode steps;
  prefill  --prompts new prompts of --context tokens a step (max_tokens 1) under a token budget of
           prompts x context, 2 untimed steps, then the median of 5, in ms a prompt token.

--noise F runs a neighbour process busy F of one core in bursts (bench/common/cpu_noise.py) while
the steps are timed, as the gateway, Redis and the client load a served engine's cores.

The table gives each tree's median over the rounds and the ratio working tree / base (below 1:
the working tree is faster). KAITEN_CPU_ISA (kernels/cpu_ops_build.py) picks the C++ ops' build
for both, e.g. avx2 to time an AVX2 CPU's code on an AVX-512 one.

    .venv/bin/python bench/engine/engine_steps_ab.py --base REV [--model GGUF] [--dtype float32] [--batch 32]
        [--context 256] [--prompts 4] [--rounds 2] [--no-deterministic] [--noise 0.3] [--out NAME]

Writes bench/results/engine_steps_ab/<NAME>.{md,json} (default engine_steps_ab).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.common.results_files import results_dir  # noqa: E402
from bench.common.timing import measure_in_process  # noqa: E402

RESULTS = results_dir(__file__)
TREES = Path.home() / ".cache" / "kaiten" / "engine_steps_ab"


def measure(args) -> dict:
    """This tree's decode step (ms) and prefill (ms a prompt token); run inside the tree."""
    sys.path.insert(0, os.getcwd())
    from bench.common.cpu_noise import busy_neighbour
    from bench.engine.engine_throughput import step_until_decoding
    from engine_worker import LLM, SamplingParams
    from shared.gguf_convert import ensure_converted_gguf, ensure_default_model
    model = str(ensure_converted_gguf(args.model) if args.model.endswith(".gguf") else args.model or ensure_default_model())
    from shared.config import EngineConfig
    extra = {"deterministic": False} if args.no_deterministic and "deterministic" in EngineConfig.__dataclass_fields__ \
        else {}
    llm = LLM(model, dtype=args.dtype, quantization="auto", enable_prefix_caching=False, max_num_seqs=64,
              max_num_batched_tokens=args.prompts * args.context, kv_cache_memory="512MiB", **extra)
    rng = random.Random(0)
    vocab = llm.engine.vocab_size
    prompt = lambda: [rng.randrange(100, vocab) for _ in range(args.context)]   # noqa: E731

    def timed_step() -> float:
        t0 = time.perf_counter()
        llm.step()
        return time.perf_counter() - t0

    prefill = []
    with busy_neighbour(args.noise):
        for i in range(7):
            for _ in range(args.prompts):
                llm.submit(prompt(), SamplingParams(max_tokens=1, temperature=0.0))
            dt = timed_step()
            if i >= 2:
                prefill.append(dt * 1e3 / (args.prompts * args.context))
        for _ in range(args.batch):
            llm.submit(prompt(), SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True))
        step_until_decoding(llm)
        for _ in range(10):
            llm.step()
        decode = [timed_step() * 1e3 for _ in range(30)]
    return {"decode_ms": statistics.median(decode), "prefill_ms_per_token": statistics.median(prefill),
            "dtype": str(llm.engine.runner.dtype).removeprefix("torch.")}


def worktree(rev: str) -> Path:
    sha = subprocess.run(["git", "-C", str(ROOT), "rev-parse", rev], check=True, capture_output=True,
                         text=True).stdout.strip()
    path = TREES / sha[:12]
    if not path.exists():
        TREES.mkdir(parents=True, exist_ok=True)
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(path), sha], check=True,
                       capture_output=True)
    return path


def run_in(tree: Path, argv: list[str]) -> dict:
    return measure_in_process(Path(__file__).resolve(), argv, cwd=tree)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", default="HEAD", help="git revision to compare against")
    ap.add_argument("--model", default="", help="a GGUF file or a model folder (default: the default model)")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default="engine_steps_ab")
    ap.add_argument("--no-deterministic", action="store_true",
                    help="batch-invariant numerics off, in a tree whose engine has them (docs/deterministic.md)")
    ap.add_argument("--noise", type=float, default=0.0, help="a neighbour busy this fraction of one core")
    ap.add_argument("--measure", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.measure:
        print(json.dumps(measure(args)))
        return 0
    from bench.common.machine import cpu_flags, cpu_name, load_avg
    from bench.common.results_files import write_results
    from bench.common.timing import interleaved
    from kernels.cpu_ops_build import cpu_capability
    argv = ["--model", args.model, "--dtype", args.dtype, "--batch", str(args.batch), "--context",
            str(args.context), "--prompts", str(args.prompts), "--noise", str(args.noise)] + \
        ["--no-deterministic"] * args.no_deterministic
    trees = {"base": worktree(args.base), "working tree": ROOT}
    load0 = load_avg()
    runs: dict[str, list[dict]] = interleaved(trees, args.rounds, lambda name: run_in(trees[name], argv))
    med = {name: {k: statistics.median(x[k] for x in rs) for k in ("decode_ms", "prefill_ms_per_token")}
           for name, rs in runs.items()}
    dtype = runs["working tree"][0]["dtype"]
    lines = [f"# The engine's steps: the working tree against {args.base}\n",
             f"CPU: {cpu_name()} ({' '.join(cpu_flags())}), extension ISA {cpu_capability()[0]}, dtype {dtype}, "
             f"model {Path(args.model).name or 'the default model'} (quantization auto); load {load0} before, "
             f"{load_avg()} after. Each tree in its own process, alternating, {args.rounds} rounds, medians; a neighbour "
             f"process busy {args.noise:.0%} of a core.\n",
             "| step | base | working tree | ratio |", "|---|---:|---:|---:|"]
    for key, label in (("decode_ms", f"decode, {args.batch} x {args.context} (ms)"),
                       ("prefill_ms_per_token", f"prefill, {args.prompts} x {args.context} a step (ms a token)")):
        b, w = med["base"][key], med["working tree"][key]
        rounds = ", ".join(f"{x[key]:.3f}" for x in runs["base"]) + " / " + ", ".join(f"{x[key]:.3f}" for x in runs["working tree"])
        lines.append(f"| {label} | {b:.3f} | {w:.3f} | **{w / b:.2f}x** |")
        lines.append(f"| (rounds, base / working tree) | {rounds} | | |")
    report = {"cpu": cpu_name(), "flags": cpu_flags(), "isa": cpu_capability()[0], "base": args.base,
              "args": vars(args), "runs": runs, "median": med}
    write_results(RESULTS / args.out, report, "\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
