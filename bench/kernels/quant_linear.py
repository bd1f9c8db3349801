"""Weight-only quantized projections on SmolLM2-135M's shapes: kaiten_cpu::quant_linear (its
methods: registers with x exact, int8 activations where the build has them (a row at a time
against each tile up to 8 rows, 16 on AVX-512, then the int8 panel GEMM), the dense method: its
own bf16 GEMM for bf16 x on AVX512-BF16 without AMX, else dequantized chunks into at::mm) against
the dense PackedLinear (oneDNN) in the same dtype and PyTorch's own
aten._weight_int4pack_mm_for_cpu / aten._weight_int8pack_mm (bf16 x).

Each shape is timed as 30 copies (one per layer; the output layer once), so the weights stream
from memory as in a decode step; methods run interleaved, round after round, and the median of
the rounds is reported. Random Q4_1 and Q8_0 weights (gguf's own quantizer).

    .venv/bin/python bench/kernels/quant_linear.py [--rows 1,4,8,16,32,64,256] [--rounds 7] [--threads 2] [--dtype bfloat16]
    .venv/bin/python bench/kernels/quant_linear.py --formats Q8_0 --rows 1024 --methods "int8 activations" \
        --shapes "gate_up 3072x576,gate_up+16 3088x576,down 576x1536" --out bench/results/quant_linear/quant_linear_stride_<cpu>

--methods keeps the methods whose names contain one of its comma-separated words (the dense
baseline always runs). Writes bench/results/quant_linear/quant_linear_<dtype>.md (--out: <out>.md), with each
shape's GMAC/s.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.common.machine import cpu_flags, cpu_name, load_avg  # noqa: E402
from bench.common.results_files import results_dir  # noqa: E402
from engine_worker.model.packed_linear import PackedLinear  # noqa: E402
from engine_worker.model.quant_layers import QuantLinear  # noqa: E402
from kernels.cpu_ops_build import cpu_capability, int8_activations_built, load_cpu_ops  # noqa: E402
from shared.gguf_quant import PackedWeight, repack  # noqa: E402

RESULTS = results_dir(__file__)
SHAPES = {"qkv 960x576": (960, 576, 30), "o 576x576": (576, 576, 30), "gate_up 3072x576": (3072, 576, 30),
          "down 576x1536": (576, 1536, 30), "lm_head 49152x576": (49152, 576, 1),
          # gate_up widened by 16 rows: its fp32 output rows 12352 bytes apart, not a multiple of 4 KiB
          # as gate_up's 12288 are (a probe, not a SmolLM2 shape: gate_up made 1.5x down's time per
          # multiply in a Zen 3's prefill, 1.0x on a Xeon; does the stride do it?)
          "gate_up+16 3088x576": (3088, 576, 30)}   # (N, K, copies)
NEVER = 1 << 30     # min_dense_rows: registers always (0: dense chunks always)


def quantized(fmt: str, n: int, k: int, seed: int) -> PackedWeight:
    import gguf
    w = np.random.default_rng(seed).standard_normal((n, k), dtype=np.float32) * 0.02
    qtype = gguf.GGMLQuantizationType[fmt]
    return repack(gguf.quants.quantize(w, qtype), fmt)


def methods(fmt: str, weights: list[PackedWeight], dense: list[PackedLinear], m: int, dtype: torch.dtype) -> dict:
    """name -> a function running one pass over the copies, on `m` rows."""
    layers = [QuantLinear(p) for p in weights]
    n, k = weights[0].shape
    x, xb = torch.randn(m, k).to(dtype), torch.randn(m, k).bfloat16()
    out = {"oneDNN (dequantized)": lambda: [d(x) for d in dense],
           "quant_linear registers": lambda: [torch.ops.kaiten_cpu.quant_linear(x, q.tiles, *q.op_args, NEVER)
                                              for q in layers],
           "quant_linear dense method": lambda: [torch.ops.kaiten_cpu.quant_linear(x, q.tiles, *q.op_args, 0)
                                              for q in layers]}
    if int8_activations_built():
        out["quant_linear int8 activations"] = lambda: [
            torch.ops.kaiten_cpu.quant_linear(x, q.tiles, *q.op_args, NEVER, NEVER) for q in layers]
    q = [{name: torch.from_numpy(getattr(p, name)) for name in ("qweight", "scales", "mins")
          if getattr(p, name) is not None} for p in weights]
    if fmt == "Q4_1":   # aten int4: values 0..15 with (q - 8) * scale + zero, zero = min + 8 scale
        packed = [torch.ops.aten._convert_weight_to_int4pack_for_cpu(
            torch.cat([p["qweight"].view(n, -1, 16) & 0x0F, p["qweight"].view(n, -1, 16) >> 4], -1).view(n, k).int(), 1)
            for p in q]
        sz = [torch.stack([p["scales"], p["mins"] + 8 * p["scales"]], -1).transpose(0, 1).contiguous().bfloat16() for p in q]
        out["aten int4pack_mm (bf16 x)"] = lambda: [torch.ops.aten._weight_int4pack_mm_for_cpu(xb, p, 32, s)
                                                    for p, s in zip(packed, sz)]
    else:               # aten int8: per-channel scales only, so not Q8_0's per-32 ones (speed only)
        w8 = [p["qweight"] for p in q]
        s8 = [p["scales"][:, 0].bfloat16().contiguous() for p in q]
        out["aten int8pack_mm (bf16 x, per-channel)"] = lambda: [torch.ops.aten._weight_int8pack_mm(xb, w, s)
                                                                 for w, s in zip(w8, s8)]
    return out


def measure(fns: dict, rounds: int) -> dict[str, float]:
    times = {name: [] for name in fns}
    for fn in fns.values():
        fn()
    for _ in range(rounds):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(t) * 1e3 for name, t in times.items()}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,4,8,16,32,64,256")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--formats", default="Q4_1,Q8_0")
    ap.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated keys of SHAPES")
    ap.add_argument("--methods", default="", help="comma-separated words: only methods named with one")
    ap.add_argument("--out", default=str(RESULTS / "quant_linear_{dtype}"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    load_cpu_ops()
    lines = [f"# quant_linear on SmolLM2-135M shapes, {args.dtype} activations\n",
             f"CPU: {cpu_name()} ({' '.join(cpu_flags())}), {args.threads} threads, "
             f"extension ISA {cpu_capability()[0]}, torch {torch.__version__}, load before {load_avg()}.\n",
             "Median ms of one pass over the copies (30 per projection shape, 1 for lm_head); ratio: "
             f"dense {args.dtype} time / this time (>1 is faster than dense), and the multiplies a second.\n"]
    for fmt in args.formats.split(","):
        for label in args.shapes.split(","):
            n, k, copies = SHAPES[label]
            lines.append(f"\n## {fmt} {label} x{copies}\n")
            weights = [quantized(fmt, n, k, seed) for seed in range(copies)]
            dense = [PackedLinear(torch.from_numpy(p.dequantize()).to(dtype), None) for p in weights]
            for m in (int(r) for r in args.rows.split(",")):
                fns = methods(fmt, weights, dense, m, dtype)
                words = [w for w in args.methods.split(",") if w]
                fns = {name: fn for name, fn in fns.items()
                       if name.startswith("oneDNN") or not words or any(w in name for w in words)}
                t = measure(fns, args.rounds)
                base = t["oneDNN (dequantized)"]
                if not lines[-1].startswith("|"):
                    lines += ["| rows | " + " | ".join(t) + " |", "|---:|" + "---:|" * len(t)]
                gmac = m * n * k * copies / 1e6        # per ms
                cells = [f"{v:.3f} ({base / v:.2f}x, {gmac / v:.1f} GMAC/s)" for v in t.values()]
                lines.append(f"| {m} | " + " | ".join(cells) + " |")
                print(fmt, label, m, " ".join(f"{k}={v:.3f}" for k, v in t.items()), flush=True)
    out = Path(args.out.format(dtype=args.dtype)).with_suffix(".md")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
