"""CPU projections: nn.Linear (MKL GEMM) vs PackedLinear (oneDNN, weight reordered once at load).

Every projection of SmolLM2-135M (30 layers of qkv, o, gate_up, down, then the 49152-row output
layer) on a batch of `rows` token rows, fp32, the two interleaved in one process; median wall
time of one pass over all of them. Weights are far larger than the CPU caches, as in serving.

    .venv/bin/python bench/kernels/cpu_linear.py [--rows 1,8,64,512] [--threads 2]

Writes bench/results/cpu_linear/cpu_linear.{md,json}.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.common.machine import cpu_name, load_avg  # noqa: E402
from bench.common.results_files import results_dir  # noqa: E402
from bench.common.timing import median_ms  # noqa: E402
from engine_worker.model.packed_linear import PackedLinear  # noqa: E402

RESULTS = results_dir(__file__)
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)] * 30 + [(49152, 576)]   # (out, in)


@torch.inference_mode()
def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,8,64,512")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--runs", type=int, default=7)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    weights = [torch.randn(o, i) * 0.02 for o, i in SHAPES]
    packed = [PackedLinear(w, None) for w in weights]
    rows_out, before = [], load_avg()
    for rows in map(int, args.rows.split(",")):
        x = {i: torch.randn(rows, i) for i in (576, 1536)}
        plain, _ = median_ms(lambda: [F.linear(x[w.shape[1]], w) for w in weights], args.runs, warmup=1)
        fast, _ = median_ms(lambda: [p(x[w.shape[1]]) for w, p in zip(weights, packed)], args.runs, warmup=1)
        err = max((F.linear(x[w.shape[1]], w) - p(x[w.shape[1]])).abs().max().item() for w, p in zip(weights[:4], packed[:4]))
        rows_out.append({"rows": rows, "linear_ms": plain, "packed_ms": fast, "speedup": plain / fast, "max_abs_diff": err})
        print(rows_out[-1], flush=True)
    result = {"cpu": cpu_name(), "threads": args.threads, "torch": torch.__version__,
              "load_avg_before_after": [before, load_avg()], "rows": rows_out}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "cpu_linear.json").write_text(json.dumps(result, indent=2))
    lines = [f"# SmolLM2-135M projections on the CPU: nn.Linear vs PackedLinear (fp32, {args.threads} threads, "
             f"{result['cpu']}, torch {result['torch']})", "",
             f"Median of {args.runs} passes over all 121 projections; load average before/after "
             f"{result['load_avg_before_after']}.", "",
             "| rows | nn.Linear ms | PackedLinear ms | speedup | max abs diff |", "|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['rows']} | {r['linear_ms']:.1f} | {r['packed_ms']:.1f} | **{r['speedup']:.2f}x** | "
              f"{r['max_abs_diff']:.1e} |" for r in rows_out]
    (RESULTS / "cpu_linear.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
