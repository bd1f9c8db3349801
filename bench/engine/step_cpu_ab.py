"""The CPU time of the engine's decode steps, this checkout against another (--baseline DIR, e.g.
`git worktree add --detach /tmp/main-base main`), on a machine too busy for wall times: one OpenMP
thread (no spin-waits on preempted threads), and the step's thread CPU time (time.thread_time),
which the neighbours' load stretches far less than its wall time.

Each checkout runs in its own process (its Inductor cache warm after the first), the two
alternating --rounds times: the default model (or --model), a decode of 1 request of --context
random tokens, then 31 more (a batch of 32); the median of 40 steps each.

    .venv/bin/python bench/engine/step_cpu_ab.py --baseline DIR [--model DIR] [--rounds 2] [--out NAME]
    .venv/bin/python bench/engine/step_cpu_ab.py --region-layers 6,15,30 [--baseline DIR] ...

--region-layers runs this checkout once per value of compiled_forward.REGION_LAYERS (the most
layers a compiled region holds), the first the baseline where no --baseline is given.

Writes bench/results/step_cpu_ab/<NAME>.{md,json} (default step_cpu_ab).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.common.machine import cpu_flags, cpu_id, cpu_name, load_avg  # noqa: E402
from bench.common.results_files import results_dir, write_results  # noqa: E402

RESULTS = results_dir(__file__)
CHILD = r"""
import json, statistics, sys, time
from engine_worker import LLM
from engine_worker.model import compiled_forward
if sys.argv[3]:
    compiled_forward.REGION_LAYERS = int(sys.argv[3])
from bench.engine.engine_throughput import start_decoding

def measure(llm, steps=40):
    for _ in range(3):
        llm.step()
    ts = []
    for _ in range(steps):
        t0 = time.thread_time(); llm.step(); ts.append(time.thread_time() - t0)
    return statistics.median(ts) * 1e3

context = int(sys.argv[2])
t0 = time.perf_counter()
llm = LLM(sys.argv[1], kv_cache_memory="256MiB", enable_prefix_caching=False)
load = time.perf_counter() - t0
start_decoding(llm, 1, 2000, context=context)
b1 = measure(llm)
start_decoding(llm, 31, 2000, context=context)
print(json.dumps({"load_s": load, "b1_cpu_ms": b1, "b32_cpu_ms": measure(llm)}))
"""


def run(checkout: Path, model: str, context: int, region_layers: str = "") -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(checkout)}
    out = subprocess.run([sys.executable, "-c", CHILD, model, str(context), region_layers], cwd=checkout, env=env,
                         capture_output=True, text=True, timeout=1800)
    if out.returncode:
        raise RuntimeError(f"{checkout}: {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--baseline", type=Path)
    ap.add_argument("--region-layers", default="", help="REGION_LAYERS values for this checkout, e.g. 6,15,30")
    ap.add_argument("--model", default="", help="a model folder (default: the default model)")
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default="step_cpu_ab")
    args = ap.parse_args()
    from shared.gguf_convert import ensure_default_model
    model = args.model or str(ensure_default_model())
    if not args.baseline and not args.region_layers:
        ap.error("give --baseline, --region-layers or both")
    trees = {"baseline": (args.baseline.resolve(), "")} if args.baseline else {}
    sizes = args.region_layers.split(",") if args.region_layers else [""]
    for i, size in enumerate(sizes):
        name = f"this checkout, {size}-layer regions" if size else "this checkout"
        trees[name] = (ROOT, size)
    meta = {"cpu": cpu_name(), "cpu_id": cpu_id(), "flags": cpu_flags(), "load_before": load_avg(),
            "model": Path(model).name, "context": args.context, "rounds": args.rounds}
    runs: dict = {name: [] for name in trees}
    for r in range(args.rounds):
        for name in (list(trees) if r % 2 == 0 else list(trees)[::-1]):
            runs[name].append(run(*trees[name][:1], model, args.context, trees[name][1]))
            print(name, runs[name][-1], flush=True)
    meta["load_after"] = load_avg()
    rows = {name: {k: statistics.median(x[k] for x in rs) for k in rs[0]} for name, rs in runs.items()}
    write_results(RESULTS / args.out, {"meta": meta, "rows": rows, "runs": runs}, render(meta, rows))
    return 0


def render(meta: dict, rows: dict) -> str:
    base = rows[next(iter(rows))]           # the first: --baseline, else the first --region-layers
    lines = ["# Decode steps' CPU time, this checkout against a baseline\n",
             f"CPU: {meta['cpu']} ({meta['cpu_id']}; {', '.join(meta['flags'])}); load average "
             f"{meta['load_before']} before, {meta['load_after']} after. {meta['model']}, one OpenMP thread, "
             f"thread CPU time of a decode step (median of 40), context {meta['context']}, medians of "
             f"{meta['rounds']} alternating rounds.\n",
             "| checkout | engine built s (wall) | 1 stream ms | ratio | 32 streams ms | ratio |",
             "|---|---:|---:|---:|---:|---:|"]
    for name, r in rows.items():
        lines.append(f"| {name} | {r['load_s']:.0f} | {r['b1_cpu_ms']:.2f} | {r['b1_cpu_ms'] / base['b1_cpu_ms']:.2f}x | "
                     f"{r['b32_cpu_ms']:.1f} | {r['b32_cpu_ms'] / base['b32_cpu_ms']:.2f}x |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
