"""bf16-stored weights in an fp32 model on SmolLM2-135M's shapes: kaiten_cpu::bf16_linear (widened
in registers, and widened chunks into at::mm) against the fp32-widened weight in PackedLinear
(oneDNN, what the engine ran before) and in F.linear (MKL). Picks bf16_layers.MIN_DENSE_ROWS.

Each shape is timed as its copies (30 per projection, 1 lm_head), so the weights stream from
memory as in a decode step; methods run interleaved, round after round (bench/kernels/quant_linear.py's
measure), and the median of the rounds is reported.

    .venv/bin/python bench/kernels/bf16_linear.py [--rows 1,2,4,8,12,16,24,32,64,256] [--rounds 7] [--threads 2]

Writes bench/results/bf16_linear/bf16_linear.md and .json.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.common.machine import cpu_flags, cpu_name, load_avg  # noqa: E402
from bench.common.results_files import results_dir  # noqa: E402
from bench.kernels.quant_linear import SHAPES, measure  # noqa: E402
from engine_worker.model.packed_linear import PackedLinear  # noqa: E402
from kernels.cpu_ops_build import cpu_capability, load_cpu_ops  # noqa: E402

RESULTS = results_dir(__file__)
DIRECT, DENSE = 1 << 30, 1
BASE = "fp32 oneDNN (packed)"


def methods(weights: list[torch.Tensor], m: int) -> dict:
    """name -> a function running one pass over the copies, on `m` rows."""
    x = torch.randn(m, weights[0].shape[1])
    packed = [PackedLinear(w.float(), None) for w in weights]
    wide = [w.float() for w in weights]
    op = torch.ops.kaiten_cpu.bf16_linear
    return {BASE: lambda: [p(x) for p in packed],
            "fp32 F.linear": lambda: [F.linear(x, w) for w in wide],
            "bf16 registers": lambda: [op(x, w, None, DIRECT) for w in weights],
            "bf16 chunks+mm": lambda: [op(x, w, None, DENSE) for w in weights]}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,2,4,8,12,16,24,32,64,256")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    load_cpu_ops()
    rows = [int(r) for r in args.rows.split(",")]
    meta = {"cpu": cpu_name(), "flags": cpu_flags(), "threads": args.threads, "isa": cpu_capability()[0],
            "torch": torch.__version__, "load_before": load_avg(), "rounds": args.rounds}
    results = []
    for label, (n, k, copies) in SHAPES.items():
        weights = [(torch.randn(n, k) * 0.02).bfloat16() for _ in range(copies)]
        for m in rows:
            t = measure(methods(weights, m), args.rounds)
            results.append({"shape": label, "copies": copies, "rows": m, "ms": t})
            print(label, m, " ".join(f"{name}={v:.3f}" for name, v in t.items()), flush=True)
    meta["load_after"] = load_avg()
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "bf16_linear.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1) + "\n")
    (RESULTS / "bf16_linear.md").write_text(render(meta, results, rows))
    return 0


def render(meta: dict, results: list[dict], rows: list[int]) -> str:
    names = list(results[0]["ms"])
    lines = ["# bf16-stored weights, fp32 activations, SmolLM2-135M shapes\n",
             f"CPU: {meta['cpu']} ({', '.join(meta['flags'])}), {meta['threads']} threads, extension ISA "
             f"{meta['isa']}, torch {meta['torch']}, load average {meta['load_before']} before, "
             f"{meta['load_after']} after, {meta['rounds']} interleaved rounds.\n",
             f"Median ms of one pass over the copies; in brackets: {BASE} time / this time (>1 is faster).\n"]
    by_rows = {m: {name: 0.0 for name in names} for m in rows}
    for shape in dict.fromkeys(r["shape"] for r in results):
        lines += [f"\n## {shape}\n", "| rows | " + " | ".join(names) + " |", "|---:" * (len(names) + 1) + "|"]
        for r in (r for r in results if r["shape"] == shape):
            base = r["ms"][BASE]
            lines.append(f"| {r['rows']} | " + " | ".join(f"{v:.3f} ({base / v:.2f}x)" for v in r["ms"].values()) + " |")
            for name, v in r["ms"].items():
                by_rows[r["rows"]][name] += v
    lines += ["\n## All shapes (one decode step's projections)\n", "| rows | " + " | ".join(names) + " |",
              "|---:" * (len(names) + 1) + "|"]
    for m, t in by_rows.items():
        lines.append(f"| {m} | " + " | ".join(f"{v:.2f} ({t[BASE] / v:.2f}x)" for v in t.values()) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
