"""How many rows of x should take int8 activations: the default model served as stored, one engine
per value of quant_layers.INT8_ROWS (for every dtype), in one process, alternating.

Each engine decodes B random prompts of --context tokens (rounds of --steps steps, alternating
between the engines; median step time), prefills --prompts prompts of --length tokens (ms a prompt
token, median of --rounds rounds) and scores quant_decode's fixed text (perplexity).

    .venv/bin/python bench/weights/int8_rows.py [--rows 16,all] [--batch 8,16,32] [--model PATH] [--dtype auto]

Writes bench/results/int8_rows/int8_rows_<model stem>_<dtype>.md and .json.
"""
from __future__ import annotations

import argparse
import random
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.common.machine import cpu_flags, cpu_name, load_avg  # noqa: E402
from bench.common.results_files import results_dir, write_results  # noqa: E402
from bench.weights.perplexity import int8_rows  # noqa: E402
from bench.weights.quant_decode import decode_ms, perplexity  # noqa: E402
from bench.weights.quant_prefill import prefill_ms_per_token  # noqa: E402
from engine_worker import LLM  # noqa: E402
from kernels.cpu_ops_build import cpu_capability  # noqa: E402

EVERY = 1 << 30


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="none,16,all", help="INT8_ROWS values: a number, all, or none")
    ap.add_argument("--batch", default="8,16,32")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--length", type=int, default=256)
    ap.add_argument("--model", default=None, help="a GGUF file or model folder (default: the default model)")
    ap.add_argument("--dtype", default="auto")
    args = ap.parse_args()
    from shared.gguf_convert import ensure_default_model
    model = args.model or str(ensure_default_model())
    load0 = load_avg()
    engines = {}
    for value in args.rows.split(","):
        rows = {"all": EVERY, "none": None}[value] if value in ("all", "none") else int(value)
        with int8_rows(rows):
            engines[value] = LLM(model, quantization="auto", dtype=args.dtype, max_num_seqs=64, kv_cache_memory="1GiB")
    dtype = str(next(iter(engines.values())).engine.runner.dtype).removeprefix("torch.")
    table = {name: {"perplexity": perplexity(llm)} for name, llm in engines.items()}
    for b in (int(x) for x in args.batch.split(",")):
        for name, ms in decode_ms(engines, b, args.context, args.rounds, args.steps).items():
            table[name][f"B={b} step ms"] = ms
    rng = random.Random(0)
    prefill = {name: [] for name in engines}
    for _ in range(args.rounds):    # new prompts each round: none is in the prefix cache
        prompts = [[rng.randrange(3, 49152) for _ in range(args.length)] for _ in range(args.prompts)]
        for name, llm in engines.items():
            prefill[name].append(prefill_ms_per_token(llm, prompts))
    base = next(iter(engines))
    for name in engines:
        table[name]["prompt token ms"] = statistics.median(prefill[name])
    cols = [c for c in table[base] if c != "perplexity"]
    lines = [f"# int8 activations by rows of x: {Path(model).name}, {dtype}\n",
             f"CPU: {cpu_name()} ({' '.join(cpu_flags())}), {torch.get_num_threads()} threads, extension ISA "
             f"{cpu_capability()[0]}, torch {torch.__version__}; load {load0} before, {load_avg()} after. "
             f"INT8_ROWS for every dtype, one engine each, alternating; decode at context {args.context}, median of "
             f"{args.rounds} rounds x {args.steps} steps; prefill {args.prompts} prompts of {args.length}, median of "
             f"{args.rounds} rounds. Ratio: this time / INT8_ROWS={base}'s.\n",
             "| INT8_ROWS | perplexity | " + " | ".join(cols) + " |", "|---|---:|" + "---:|" * len(cols)]
    for name, row in table.items():
        cells = [f"{row[c]:.3g} ({row[c] / table[base][c]:.2f}x)" for c in cols]
        lines.append(f"| {name} | {row['perplexity']:.3f} | " + " | ".join(cells) + " |")
    out = results_dir(__file__) / f"int8_rows_{Path(model).stem.replace('.', '_')}_{dtype}"
    write_results(out, {"rows": table, "model": model, "dtype": dtype}, "\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
