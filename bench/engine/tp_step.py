"""Tensor parallelism on the CPU: N ranks of one thread against one process of N threads, on the
same cores; decode step time at batch 1 and 32, a prefill, and the all-reduce's share of a step.

Each arm is a process of its own (torch's thread count and a rank's core pinning are per process),
started once, that measures a round when the driver says so; the driver alternates the arms round
by round (a loaded machine drifts) and reports each figure's median over the rounds, and the load
average before and after.

    .venv/bin/python bench/engine/tp_step.py [--model DIR] [--quantization auto|none] [--rounds 5]

Writes OUT.json and OUT.md (default bench/results/tensor_parallel/tp_step).
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

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.common.machine import cpu_id, cpu_name, load_avg  # noqa: E402
from bench.common.results_files import RESULTS, write_results  # noqa: E402

FIGURES = ("decode_b1_ms", "decode_b32_ms", "prefill_ms", "allreduce_share_b1", "allreduce_share_b32",
           "allreduce_busy_share_b1", "allreduce_busy_share_b32")


# ---------------------------------------------------------------------- an arm (its own process)
def _decode(llm, batch: int, context: int, steps: int) -> tuple[float, float, float]:
    """(median step s, the all-reduce's share of the steps' time, its share without waiting)."""
    from bench.engine.engine_throughput import start_decoding
    comm = llm.engine.runner.ranks.comm if llm.engine.runner.ranks else None
    ids = start_decoding(llm, batch, steps + 4, context)
    for _ in range(2):
        llm.step()
    before, times = comm.stats() if comm else (0, 0, 0), []
    for _ in range(steps):
        t0 = time.perf_counter()
        llm.step()
        times.append(time.perf_counter() - t0)
    after = comm.stats() if comm else (0, 0, 0)
    for rid in ids:
        llm.engine.abort_request(rid)
    llm.step()
    total = sum(times) * 1e9
    op, wait = after[1] - before[1], after[2] - before[2]
    return statistics.median(times), op / total, (op - wait) / total


def _prefill(llm, tokens: int, reps: int) -> float:
    from engine_worker import SamplingParams
    rng, times = random.Random(1), []
    for _ in range(reps):
        prompt = [rng.randrange(3, llm.engine.vocab_size) for _ in range(tokens)]
        t0 = time.perf_counter()
        llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def arm(args) -> None:
    from engine_worker import LLM
    tp = args.arm
    llm = LLM(args.model, quantization=args.quantization, kv_cache_memory="512MiB", max_num_seqs=32,
              max_num_batched_tokens=args.prefill, enable_prefix_caching=False,
              num_threads=args.cores if tp == 1 else 1, tensor_parallel_size=tp)
    print(json.dumps({"ready": True, "dtype": str(llm.engine.runner.dtype)}), flush=True)
    for line in sys.stdin:
        if line.strip() != "round":
            break
        b1 = _decode(llm, 1, args.context, args.steps)
        b32 = _decode(llm, 32, args.context, max(4, args.steps // 2))
        row = {"decode_b1_ms": 1e3 * b1[0], "decode_b32_ms": 1e3 * b32[0],
               "prefill_ms": 1e3 * _prefill(llm, args.prefill, 3),
               "allreduce_share_b1": b1[1], "allreduce_share_b32": b32[1],
               "allreduce_busy_share_b1": b1[2], "allreduce_busy_share_b32": b32[2]}
        print(json.dumps(row), flush=True)
    llm.engine.runner.close()


# ---------------------------------------------------------------------- the driver
def drive(args) -> None:
    arms = {}
    for tp in (1, args.cores):
        cmd = [sys.executable, __file__, "--arm", str(tp), *sys.argv[1:]]
        arms[tp] = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        ready = json.loads(arms[tp].stdout.readline())
        print(f"arm tp={tp} ready ({ready['dtype']})", flush=True)
    load_before = load_avg()
    rows: dict[int, list[dict]] = {tp: [] for tp in arms}
    for r in range(args.rounds):
        for tp in (arms if r % 2 == 0 else reversed(list(arms))):
            arms[tp].stdin.write("round\n")
            arms[tp].stdin.flush()
            rows[tp].append(json.loads(arms[tp].stdout.readline()))
            print(f"round {r} tp={tp}: {rows[tp][-1]}", flush=True)
    load_after = load_avg()
    for p in arms.values():
        p.stdin.close()
        p.wait()
    medians = {tp: {k: statistics.median(row[k] for row in rs) for k in FIGURES} for tp, rs in rows.items()}
    report = {"cpu": cpu_name(), "cpu_id": cpu_id(), "cores": sorted(os.sched_getaffinity(0)),
              "model": Path(args.model).name or "default", "quantization": args.quantization,
              "context": args.context, "prefill_tokens": args.prefill, "rounds": args.rounds,
              "load_before": load_before, "load_after": load_after, "medians": medians, "rounds_raw": rows}
    write_results(args.out, report, render(report))


def render(rep: dict) -> str:
    one, tp = rep["medians"][1], rep["medians"][max(rep["medians"])]
    n = max(rep["medians"])
    lines = [f"{rep['cpu']} ({rep['cpu_id']}), cores {rep['cores']}; model {rep['model']}, quantization "
             f"{rep['quantization']}; {rep['rounds']} interleaved rounds, medians; load average "
             f"{rep['load_before']} before, {rep['load_after']} after.", "",
             f"| figure | 1 process, {n} threads | {n} ranks, 1 thread each | ratio |", "|---|---:|---:|---:|"]
    for key, name in (("decode_b1_ms", f"decode step, batch 1 (context {rep['context']}), ms"),
                      ("decode_b32_ms", f"decode step, batch 32 (context {rep['context']}), ms"),
                      ("prefill_ms", f"prefill of {rep['prefill_tokens']} tokens, ms")):
        lines.append(f"| {name} | {one[key]:.2f} | {tp[key]:.2f} | **{tp[key] / one[key]:.2f}x** |")
    for b in ("b1", "b32"):
        lines.append(f"| all-reduce share of a decode step, {b} (in the op / copying and summing) | | "
                     f"{100 * tp['allreduce_share_' + b]:.1f}% / {100 * tp['allreduce_busy_share_' + b]:.1f}% | |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="")
    ap.add_argument("--quantization", default="auto")
    ap.add_argument("--cores", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--prefill", type=int, default=512)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--arm", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=str(RESULTS / "tensor_parallel" / "tp_step"))
    args = ap.parse_args()
    if args.arm:
        arm(args)
    else:
        drive(args)


if __name__ == "__main__":
    main()
