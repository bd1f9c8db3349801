"""The eager calls around a decode step's compiled layers, one token, in microseconds.

The compiled forward (engine_worker/model/compiled_forward.py) runs the embedding's lookup, the
step's rotary cos/sin and the final norm eagerly, on the serving thread, while the other OpenMP
threads wait: every microsecond here is one of the step's. Each is timed on --model (a GGUF file
or a model folder, quantization auto, default the default model), the median of --rounds rounds
of --calls calls. The quantized embedding is timed both ways: kaiten_cpu::dequantize_rows (what
QuantEmbedding calls) and quant_tiles.dequantize (the Python dequantizer it called before).

    .venv/bin/python bench/engine/eager_parts.py [--model GGUF] [--rounds 7] [--calls 2000] [--out NAME]

Writes bench/results/eager_parts/<NAME>.{md,json} (default eager_parts).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.common.machine import cpu_flags, cpu_name, load_avg  # noqa: E402
from bench.common.results_files import results_dir, write_results  # noqa: E402

RESULTS = results_dir(__file__)


def per_call_us(fn, calls: int, rounds: int) -> float:
    for _ in range(50):
        fn()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(times)


def parts(model, calls: int, rounds: int) -> dict[str, float]:
    from engine_worker.model.quant_layers import QuantEmbedding
    ids, pos = torch.tensor([1234]), torch.tensor([300])
    x = model.embed(ids)
    out = {"embedding lookup": per_call_us(lambda: model.embed(ids), calls, rounds)}
    if isinstance(model.embed_tokens, QuantEmbedding):
        table = model.embed_tokens.table
        out["embedding lookup, Python dequantizer"] = per_call_us(lambda: table.dequantize(ids), calls, rounds)
    out["rotary cos/sin"] = per_call_us(lambda: [rope(pos, x.dtype) for rope in model.ropes], calls, rounds)
    out["final norm"] = per_call_us(lambda: model.norm(x), calls, rounds)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--out", default="eager_parts")
    args = ap.parse_args()
    from engine_worker import LLM
    from shared.gguf_convert import ensure_converted_gguf, ensure_default_model
    model = str(ensure_converted_gguf(Path(args.model)) if args.model.endswith(".gguf")
                else args.model or ensure_default_model())
    llm = LLM(model, quantization="auto", enable_prefix_caching=False, max_num_seqs=8, kv_cache_memory="256MiB")
    with torch.inference_mode():
        us = parts(llm.engine.runner.model, args.calls, args.rounds)
    report = {"cpu": cpu_name(), "flags": " ".join(cpu_flags()), "load_avg": load_avg(), "model": model,
              "threads": torch.get_num_threads(), "rounds": args.rounds, "calls": args.calls, "us": us}
    lines = [f"Eager parts of a one-token decode step, {Path(model).name}, {report['cpu']}, "
             f"{report['threads']} threads, load {report['load_avg']}: median of {args.rounds} rounds of "
             f"{args.calls} calls.\n", "| part | us a call |", "|---|---:|"]
    lines += [f"| {name} | {v:.1f} |" for name, v in us.items()]
    write_results(RESULTS / args.out, report, "\n".join(lines))


if __name__ == "__main__":
    main()
