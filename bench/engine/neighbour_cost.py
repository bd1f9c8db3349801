"""What a served stream's neighbours cost the engine's step: decode steps of the default model
(or --model) at --batch rows, alone and beside a process busy --fraction of one core in bursts
every --period seconds (bench/common/cpu_noise.py), alternating in one process, medians of --rounds
rounds of --steps steps. Serving puts such neighbours on the engine's cores: the gateway, Redis,
the engine's own I/O thread and the client each wake up for every token (bench/serving/serve_step.py
measures their CPU a token). The step's increase is set against the neighbour's CPU a step: more
than 1 means the engine's threads lose more than the time the neighbour takes from them.

    .venv/bin/python bench/engine/neighbour_cost.py [--model GGUF] [--batch 1] [--fraction 0.15]
        [--period 0.012] [--rounds 16] [--steps 30] [--out neighbour_cost]

Writes bench/results/neighbour_cost/<out>.{md,json}.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.common.cpu_noise import busy_neighbour  # noqa: E402
from bench.common.machine import cpu_flags, cpu_name, load_avg  # noqa: E402
from bench.common.results_files import results_dir, write_results  # noqa: E402
from bench.common.timing import interleaved, step_ms  # noqa: E402

RESULTS = results_dir(__file__)


def engine(model: str, args):
    from bench.engine.engine_throughput import start_decoding
    from engine_worker import LLM
    llm = LLM(model, dtype=args.dtype, max_num_seqs=max(64, args.batch), kv_cache_memory="1GiB",
              enable_prefix_caching=False)
    start_decoding(llm, args.batch, args.rounds * 2 * (args.steps + 1) + 50, low=100)
    for _ in range(10):
        llm.step()
    return llm


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="", help="a GGUF file or a model folder (default: the default model)")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--fraction", type=float, default=0.15, help="of one core the neighbour is busy")
    ap.add_argument("--period", type=float, default=0.012, help="seconds between the neighbour's bursts")
    ap.add_argument("--rounds", type=int, default=16)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--out", default="neighbour_cost")
    args = ap.parse_args()
    from shared.gguf_convert import ensure_converted_gguf, ensure_default_model
    model = str(ensure_converted_gguf(args.model) if args.model.endswith(".gguf")
                else args.model or ensure_default_model())
    load0 = load_avg()
    llm = engine(model, args)

    def run(name: str) -> float:
        with busy_neighbour(args.fraction if name == "beside the neighbour" else 0.0, args.period):
            time.sleep(0.03)                        # the neighbour is up and bursting
            return step_ms(llm, args.steps)
    t = interleaved(["alone", "beside the neighbour"], args.rounds, run)
    alone, beside = statistics.median(t["alone"]), statistics.median(t["beside the neighbour"])
    ratios = [b / a for a, b in zip(t["alone"], t["beside the neighbour"])]
    taken = args.fraction * beside                 # the neighbour's CPU in one step (ms)
    text = "\n".join([
        f"# Decode steps alone and beside a busy neighbour, {Path(model).name}, {args.batch} row(s)\n",
        f"CPU: {cpu_name()} ({' '.join(cpu_flags())}), {torch.get_num_threads()} threads, dtype "
        f"{llm.engine.runner.dtype}; load {load0} before, {load_avg()} after. The neighbour is busy "
        f"{args.fraction:.0%} of one core in bursts every {args.period * 1e3:.0f} ms; {args.rounds} alternating "
        f"rounds of {args.steps} steps, medians.\n",
        "| alone ms | beside it ms | ratio (rounds' median) | rounds slower | step's increase / neighbour's CPU a step |",
        "|---:|---:|---:|---:|---:|",
        f"| {alone:.2f} | {beside:.2f} | {statistics.median(ratios):.3f} | {sum(r > 1 for r in ratios)} of "
        f"{len(ratios)} | {(beside - alone) / taken:.2f} ({beside - alone:.2f} / {taken:.2f} ms) |"])
    write_results(RESULTS / args.out, {"cpu": cpu_name(), "flags": cpu_flags(), "args": vars(args), "ms": t}, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
