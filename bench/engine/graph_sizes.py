"""Decode steps of the compiled forward as the engine traces it, one dynamic size per length (every
layer's KV pool sharing the pool's block count: 5 sizes a SmolLM2 step), against a trace with a size
of its own for every tensor, as before (67 sizes: 60 of them the KV pools'), in one process.

Two engines on the same model are built, one traced each way (the second with shape_id dropped from
torch._dynamo's mark_unbacked and a fresh compiled copy), and the rounds alternate between them,
--steps decode steps of --batch requests each, the order reversed every round. The engine built
second runs a few percent slower whichever it is, so the bench runs twice, in a new process each
time, building the engines in both orders; the ratio it reports is the geometric mean of the two
runs' medians of the rounds' ratios.

    .venv/bin/python bench/engine/graph_sizes.py [--model GGUF] [--batch 1] [--rounds 30] [--steps 20]
        [--dtype auto] [--out NAME]

Writes bench/results/graph_sizes/<NAME>.{md,json} (default graph_sizes).
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.common.machine import cpu_flags, cpu_name, load_avg  # noqa: E402
from bench.common.results_files import results_dir, write_results  # noqa: E402
from bench.common.timing import interleaved, step_ms  # noqa: E402

RESULTS = results_dir(__file__)


def build(model: str, args, shared_sizes: bool):
    """An engine decoding --batch requests, its forward traced with shared sizes or one per tensor."""
    import torch._dynamo.decorators as decorators
    from bench.engine.engine_throughput import start_decoding
    from engine_worker import LLM
    from engine_worker.model import compiled_forward

    mark_unbacked = decorators.mark_unbacked
    if not shared_sizes:
        decorators.mark_unbacked = lambda t, index, shape_id=None, **kw: mark_unbacked(t, index, **kw)
    compiled_forward.COMPILED_LAYER_CACHE.clear()           # a trace of its own
    try:
        llm = LLM(model, dtype=args.dtype, kv_cache_memory="512MiB", enable_prefix_caching=False)
    finally:
        decorators.mark_unbacked = mark_unbacked
    start_decoding(llm, args.batch, args.rounds * (args.steps + 1) + 50, low=100)
    return llm


def run_order(args, model: str, shared_first: bool) -> dict:
    """One process's rounds: {"shared": [ms...], "per tensor": [ms...], "dtype": ...}."""
    first = build(model, args, shared_first)
    second = build(model, args, not shared_first)
    engines = {"shared": first, "per tensor": second} if shared_first else {"shared": second, "per tensor": first}
    for llm in engines.values():
        for _ in range(10):
            llm.step()
    times: dict = interleaved(engines, args.rounds, lambda name: step_ms(engines[name], args.steps))
    times["dtype"] = str(first.engine.runner.dtype).removeprefix("torch.")
    return times


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="", help="a GGUF file or a model folder (default: the default model)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--out", default="graph_sizes")
    ap.add_argument("--order", choices=["shared-first", "per-tensor-first"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    from shared.gguf_convert import ensure_converted_gguf, ensure_default_model
    model = str(ensure_converted_gguf(args.model) if args.model.endswith(".gguf")
                else args.model or ensure_default_model())
    if args.order:                              # a child: one order, its times as JSON on stdout
        print(json.dumps(run_order(args, model, args.order == "shared-first")))
        return 0
    load0 = load_avg()
    rows, ratios, runs = [], [], {}
    for order in ("shared-first", "per-tensor-first"):
        out = subprocess.run([sys.executable, __file__, *sys.argv[1:], "--order", order], check=True,
                             capture_output=True, text=True).stdout
        t = runs[order] = json.loads(out.strip().splitlines()[-1])
        r = [s / p for s, p in zip(t["shared"], t["per tensor"])]
        ratios.append(statistics.median(r))
        rows.append(f"| {order} | {statistics.median(t['shared']):.3f} | {statistics.median(t['per tensor']):.3f} "
                    f"| {ratios[-1]:.3f} | {sum(x < 1 for x in r)} of {len(r)} |")
        print(rows[-1], flush=True)
    text = "\n".join([
        f"# Decode steps, one dynamic size per length against one per tensor, {Path(model).name}, "
        f"{t['dtype']}, batch {args.batch}\n",
        f"CPU: {cpu_name()} ({' '.join(cpu_flags())}); load {load0} before, {load_avg()} after. Context 256; ms a "
        f"step, the median over {args.rounds} rounds of {args.steps} steps, the two engines alternating in "
        f"one process; each order of building them in a process of its own.\n",
        "| engines built | shared sizes | a size per tensor | ratio (median of the rounds') | rounds faster shared |",
        "|---|---:|---:|---:|---:|", *rows,
        f"\nGeometric mean of the two orders' ratios: **{math.sqrt(ratios[0] * ratios[1]):.3f}**\n"])
    write_results(RESULTS / args.out, {"model": Path(model).name, "batch": args.batch, "runs": runs}, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
