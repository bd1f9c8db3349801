"""Decode step time at batch B against the memory floor.

A decode step must read every weight once, so it cannot beat weight bytes / memory bandwidth.
The bandwidth is measured in the same run (a device-to-device copy of a large buffer, read plus
write). The step is the engine's whole step (schedule, forward, sample), the median over
--steps steps once all B sequences have prefilled --context tokens. The second floor adds the
KV bytes the step's attention reads.

    .venv/bin/python bench/engine/decode_step.py --device cuda [--attention-backend triton] [--enforce-eager]
    .venv/bin/python bench/engine/decode_step.py --device cpu --batch 1 --context 256 [--enforce-eager]
    (on the CPU --enforce-eager runs the eager model instead of the torch.compile'd one)
    .venv/bin/python bench/engine/decode_step.py --render bench/results/gpu_check   # one table of every run

Writes OUT.json and OUT.md (default bench/results/decode_step/decode_step).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.common.machine import cpu_name  # noqa: E402
from bench.common.results_files import results_dir  # noqa: E402
from bench.engine.engine_throughput import start_decoding  # noqa: E402
from engine_worker import LLM  # noqa: E402

RESULTS = results_dir(__file__)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_bandwidth(device: torch.device, nbytes: int, runs: int = 20) -> float:
    """Bytes/s of a large copy, counting the read and the write."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).normal_()
    dst = torch.empty_like(src)
    times = []
    for _ in range(runs + 2):
        sync(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        sync(device)
        times.append(time.perf_counter() - t0)
    return 2 * nbytes / statistics.median(times[2:])


def measure(args) -> dict:
    device = torch.device(args.device)
    llm = LLM(args.model, dtype=args.dtype, device=args.device, attention_backend=args.attention_backend,
              enforce_eager=args.enforce_eager, max_num_seqs=max(args.batch, 1),
              kv_cache_memory=args.kv_cache_memory)
    engine, runner = llm.engine, llm.engine.runner
    start_decoding(llm, args.batch, args.steps + 8, args.context)
    for _ in range(3):                                   # warm-up decode steps
        llm.step()
    times = []
    for _ in range(args.steps):
        sync(device)
        t0 = time.perf_counter()
        llm.step()
        sync(device)
        times.append(time.perf_counter() - t0)
    assert len(engine.scheduler.running) == args.batch, "the batch shrank during the measurement"

    cfg = runner.model_config
    weight_bytes = sum(p.numel() * p.element_size() for p in runner.model.parameters())
    ctx = args.context + 3 + args.steps // 2             # mean context over the timed steps
    elem = torch.tensor([], dtype=runner.dtype).element_size()
    kv_bytes = args.batch * ctx * cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * elem
    bw = copy_bandwidth(device, args.bandwidth_bytes)
    step = statistics.median(times)
    return {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_name(),
        "model": Path(engine.config.model).name, "dtype": str(runner.dtype).removeprefix("torch."),
        "attention_backend": runner.backend.name, "cuda_graphs": runner.graphs is not None,
        "compiled": runner.compiled is not None,
        "batch": args.batch, "context": args.context, "steps": args.steps,
        "step_ms_median": 1e3 * step, "step_ms_p90": 1e3 * sorted(times)[int(0.9 * len(times))],
        "weight_bytes": weight_bytes, "kv_bytes_per_step": kv_bytes, "copy_bandwidth_gbs": bw / 1e9,
        "floor_ms_weights": 1e3 * weight_bytes / bw, "floor_ms_weights_kv": 1e3 * (weight_bytes + kv_bytes) / bw,
        "ratio_to_weight_floor": step / (weight_bytes / bw),
        "ratio_to_weight_kv_floor": step / ((weight_bytes + kv_bytes) / bw),
        "output_tokens_per_s": args.batch / step,
    }


def render(rows: list[dict]) -> str:
    lines = ["| device | dtype | attention | CUDA graphs / compiled | batch x context | step ms (p50 / p90) | "
             "floor: weights ms | step / floor | floor: weights+KV ms | step / floor | copy GB/s | tok/s |",
             "|---|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(
            f"| {r['device']} | {r['dtype']} | {r['attention_backend']} | {'on' if r['cuda_graphs'] else 'off'} / {'yes' if r.get('compiled') else 'no'} | "
            f"{r['batch']} x {r['context']} | {r['step_ms_median']:.2f} / {r['step_ms_p90']:.2f} | "
            f"{r['floor_ms_weights']:.3f} | **{r['ratio_to_weight_floor']:.2f}x** | {r['floor_ms_weights_kv']:.3f} | "
            f"{r['ratio_to_weight_kv_floor']:.2f}x | {r['copy_bandwidth_gbs']:.0f} | {r['output_tokens_per_s']:.0f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--attention-backend", default="auto")
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--kv-cache-memory", default="auto")
    ap.add_argument("--bandwidth-bytes", type=int, default=1 << 30)
    ap.add_argument("--out", default=str(RESULTS / "decode_step"))
    ap.add_argument("--render", metavar="DIR", help="print one table of every decode_step*.json under DIR")
    args = ap.parse_args()
    if args.render:
        rows = [json.loads(p.read_text()) for p in sorted(Path(args.render).glob("**/decode_step*.json"))]
        print(render(rows), end="")
        return
    if not args.model:
        from shared.gguf_convert import ensure_default_model
        args.model = str(ensure_default_model())
    row = measure(args)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(f"{args.out}.json").write_text(json.dumps(row, indent=2))
    Path(f"{args.out}.md").write_text(render([row]))
    print(render([row]), end="")


if __name__ == "__main__":
    main()
