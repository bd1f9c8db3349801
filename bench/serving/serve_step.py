"""Where one stream's served TPOT goes: the engine's own step, measured while it serves and alone.

For each GGUF file: `kaiten serve` on it, the stock `vllm bench serve` client at --concurrency
(default 1; --prompts random 256-token prompts, 128 output tokens, ignore_eos, greedy) for --rounds runs,
the engine's step and Redis-round histograms (kaiten:engine_step_duration_seconds,
kaiten:engine_redis_round_seconds, from its /metrics) read before and after each run; then, with
the server stopped, the same engine's decode step in one process (bench/weights/quant_decode.py's
decode_ms: context 256, 7 rounds x 8 steps). The served step's mean includes the 8 prefill steps.
Around each run it also reads every server process's and thread's CPU time and involuntary context
switches from /proc (bench/common/proc_cpu.py): what the gateway, Redis and the engine's own threads
spend a token, and how often the engine's threads are preempted.

    .venv/bin/python bench/serving/serve_step.py [--files q4_1,q8_0] [--rounds 2] [--prompts 8]
    .venv/bin/python bench/serving/serve_step.py --files q8_0 --concurrency 32 --prompts 64 --out bench/results/serve_step/serve_step_c32

Writes bench/results/serve_step/serve_step.{md,json}.
"""
from __future__ import annotations

import argparse
import os
import re
import sys
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.common import proc_cpu  # noqa: E402
from bench.common.machine import cpu_flags, cpu_name, load_avg  # noqa: E402
from bench.common.results_files import results_dir, write_results  # noqa: E402
from bench.peers.peer_llamacpp import LLAMA_PEER, gguf_path  # noqa: E402
from bench.peers.peer_offline import DEFAULT_PEER  # noqa: E402
from bench.peers.peer_serve import bench_client, start_server, stop_server  # noqa: E402
from shared.gguf_convert import ensure_converted_gguf  # noqa: E402
from shared.launcher import free_port  # noqa: E402

RESULTS = results_dir(__file__)

HISTOGRAMS = ("kaiten:engine_step_duration_seconds", "kaiten:engine_redis_round_seconds")


def scrape(metrics_url: str) -> dict[str, tuple[float, float]]:
    """(sum, count) of each histogram."""
    text = urllib.request.urlopen(metrics_url, timeout=10).read().decode()
    out = {}
    for name in HISTOGRAMS:
        total = re.search(re.escape(name) + r"_sum\{[^}]*\} (\S+)", text)
        count = re.search(re.escape(name) + r"_count\{[^}]*\} (\S+)", text)
        out[name] = (float(total.group(1)), float(count.group(1)))
    return out


def served(gguf: str, tokenizer: str, args) -> list[dict]:
    port, metrics_port = free_port(), free_port()
    os.environ["KAITEN_METRICS_PORT"] = str(metrics_port)          # the engine's /metrics, inherited
    srv = start_server("serve_step", [sys.executable, "-m", "shared.cli", "serve", "--port", str(port), "--model", gguf,
                                      "--quantization", "auto", "--log-level", "WARNING"], "/ready", port, tokenizer, args)
    metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
    runs = []
    try:
        for rnd in range(args.rounds):
            before, cpu_before = scrape(metrics_url), proc_cpu.snapshot(srv.proc.pid)
            res = bench_client(str(args.peer), srv.url, Path(tokenizer).name, tokenizer, args.concurrency,
                               args.prompts, args, seed=100 + rnd)
            after, cpu_after = scrape(metrics_url), proc_cpu.snapshot(srv.proc.pid)
            mean = {k: (after[k][0] - before[k][0]) / max(1.0, after[k][1] - before[k][1]) * 1e3 for k in HISTOGRAMS}
            tokens = args.prompts * args.output_len
            cpu = proc_cpu.by_role(proc_cpu.difference(cpu_before, cpu_after))
            runs.append({"tpot_p50_ms": res.get("median_tpot_ms"), "output_tok_s": res.get("output_throughput"),
                         "error": res.get("error"),
                         "step_mean_ms": mean[HISTOGRAMS[0]], "round_mean_ms": mean[HISTOGRAMS[1]],
                         "cpu_ms_per_token": {k: round(sec * 1e3 / tokens, 3) for k, (sec, _) in cpu.items()},
                         "preemptions_per_token": {k: round(n / tokens, 3) for k, (_, n) in cpu.items()}})
            print(gguf, runs[-1], flush=True)
    finally:
        stop_server(srv)
    return runs


def alone(model_dir: str, batch: int) -> float:
    from bench.weights.quant_decode import decode_ms
    from engine_worker import LLM
    llm = LLM(model_dir, max_num_seqs=64, kv_cache_memory="512MiB")
    return decode_ms({"alone": llm}, batch, 256, 7, 8)["alone"]


def cpu_table(report: dict) -> list[str]:
    """CPU ms and preemptions (involuntary context switches) per output token, by process and
    thread, the runs' mean."""
    lines = ["\nCPU time per output token while serving, by process and thread (the runs' mean; an engine's "
             "busiest threads besides its main one are its OpenMP workers and the I/O thread; preemptions are "
             "involuntary context switches; the client, not shown, is the same for every server):\n",
             "| file | process / thread | CPU ms per token | preemptions per token |", "|---|---|---:|---:|"]
    for kind, r in report["files"].items():
        runs = r["served"]
        keys = sorted({k for run in runs for k in run["cpu_ms_per_token"]})
        for k in keys:
            ms = sum(run["cpu_ms_per_token"].get(k, 0.0) for run in runs) / len(runs)
            pre = sum(run["preemptions_per_token"].get(k, 0.0) for run in runs) / len(runs)
            lines.append(f"| {kind} | {k} | {ms:.3f} | {pre:.3f} |")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--files", default="q4_1,q8_0")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--concurrency", type=int, default=1)
    ap.add_argument("--peer", default=str(DEFAULT_PEER), help="the client's script")
    ap.add_argument("--out", default=str(RESULTS / "serve_step"))
    args = ap.parse_args()
    args.input_len, args.output_len, args.timeout, args.ready_timeout = 256, 128, 1800, 900
    report = {"cpu": cpu_name(), "flags": " ".join(cpu_flags()), "load_avg_before": load_avg(), "files": {}}
    for kind in args.files.split(","):
        gguf = gguf_path(LLAMA_PEER, kind)
        model_dir = str(ensure_converted_gguf(gguf))
        report["files"][kind] = {"served": served(gguf, model_dir, args),
                                 "alone_step_ms": alone(model_dir, args.concurrency)}
    report["load_avg_after"] = load_avg()
    lines = [f"# Served at concurrency {args.concurrency}: the client's TPOT against the engine's own step\n",
             f"CPU: {report['cpu']} (flags: {report['flags']}). Load {report['load_avg_before']} before, "
             f"{report['load_avg_after']} after. `kaiten serve --quantization auto`, the stock client at concurrency "
             f"{args.concurrency}, "
             f"{args.prompts} prompts of 256 tokens, 128 out, {args.rounds} runs; the served step's mean includes the "
             "prefill steps. Alone: the same model in one process, decode steps of as many rows as the concurrency at "
             "context 256, median.\n",
             "| file | client TPOT p50 ms (runs) | output tok/s (runs) | served step mean ms | Redis round mean ms "
             "| step alone ms |",
             "|---|---|---|---|---|---:|"]
    for kind, r in report["files"].items():
        fmt = lambda key: ", ".join(f"{run[key]:.2f}" for run in r["served"] if run[key] is not None)  # noqa: E731
        lines.append(f"| {kind} | {fmt('tpot_p50_ms')} | {fmt('output_tok_s')} | {fmt('step_mean_ms')} "
                     f"| {fmt('round_mean_ms')} "
                     f"| {r['alone_step_ms']:.2f} |")
    lines += cpu_table(report)
    write_results(args.out, report, "\n".join(lines))


if __name__ == "__main__":
    main()
