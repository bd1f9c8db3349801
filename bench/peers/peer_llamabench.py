"""One stream's decode without serving: Kaiten's in-process step against `llama-bench` on the same
GGUF file, in alternating rounds.

Where llama-server cannot start with its weights repacked for the CPU (a Xeon VM with AMX: it dies
on an illegal instruction, so bench/peers/peer_llamacpp.py serves it with --no-repack), llama-bench
still can: this measures what llama.cpp's repacked kernels make of one stream on the machine, and
its default layout too. Each round runs, per file, `llama-bench -t <threads> -p 0 -n <tokens> -d
<context>` (ms a generated token after a <context>-token prompt) with --repack 1 and 0, and
Kaiten's decode step at batch 1 over the same context (bench/weights/quant_decode.py's decode_ms:
--quantization auto, the engine's default threads), the engines staying loaded between rounds.
The tables give medians over rounds. With --context 0 llama-bench prefills nothing and Kaiten's
prompt is one token (llama-bench's repacked weights have crashed here on any prefill: -d 256).

    .venv/bin/python bench/peers/peer_llamabench.py [--files q8_0,q4_1] [--rounds 3] --out bench/results/peer_llamabench/peer_llamabench_<cpu>

Writes <out>.{md,json} with the CPU's flags.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.common.machine import cpu_flags, cpu_name, load_avg  # noqa: E402
from bench.common.results_files import results_dir, write_results  # noqa: E402
from bench.common.timing import interleaved  # noqa: E402
from bench.peers.peer_llamacpp import LLAMA_PEER, gguf_path  # noqa: E402
from kernels.cpu_ops_build import cpu_capability  # noqa: E402
from shared.gguf_convert import ensure_converted_gguf  # noqa: E402

RESULTS = results_dir(__file__)


KEYS = ("kaiten", "repack", "no_repack")    # Kaiten's step; llama-bench with --repack 1 and 0


def llama_bench_ms(peer: Path, gguf: str, repack: int, args) -> float | None:
    """ms a generated token (llama-bench's mean over --reps), or None where it failed."""
    cmd = ["bash", str(peer), "bin", "llama-bench", "-m", gguf, "-t", str(args.threads), "-p", "0",
           "-n", str(args.tokens), "-d", str(args.context), "-r", str(args.reps), "--repack", str(repack), "-o", "json"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    try:
        test = json.loads(proc.stdout)[0]
    except (ValueError, IndexError):
        print(f"llama-bench --repack {repack} failed (exit {proc.returncode}): {proc.stderr.strip()[-300:]}")
        return None
    return test["avg_ns"] / 1e6 / test["n_gen"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--files", default="q8_0,q4_1")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--context", type=int, default=256, help="tokens before the timed ones (0: none)")
    ap.add_argument("--tokens", type=int, default=128, help="tokens a llama-bench run generates")
    ap.add_argument("--steps", type=int, default=64, help="Kaiten's timed decode steps a round")
    ap.add_argument("--reps", type=int, default=2, help="llama-bench's repetitions a run")
    ap.add_argument("--threads", type=int, default=2, help="llama-bench's threads (Kaiten: one per core)")
    ap.add_argument("--llama-peer", default=str(LLAMA_PEER))
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--out", default=str(RESULTS / "peer_llamabench"))
    args = ap.parse_args()

    from bench.weights.quant_decode import decode_ms
    from engine_worker import LLM
    peer = Path(args.llama_peer)
    files = {kind: gguf_path(peer, kind) for kind in args.files.split(",")}
    engines = {kind: LLM(str(ensure_converted_gguf(g)), quantization="auto", kv_cache_memory="512MiB")
               for kind, g in files.items()}
    report = {"cpu": cpu_name(), "flags": " ".join(cpu_flags()), "isa": cpu_capability()[0],
              "load_avg_before": load_avg(), "args": vars(args)}

    def one_round(kind: str) -> dict[str, float | None]:
        ms = {"kaiten": decode_ms({kind: engines[kind]}, 1, max(1, args.context), 1, args.steps)[kind],
              "repack": llama_bench_ms(peer, files[kind], 1, args),
              "no_repack": llama_bench_ms(peer, files[kind], 0, args)}
        print(f"{kind}: {ms}", flush=True)
        return ms
    rounds = interleaved(files, args.rounds, one_round)
    report["rounds"] = {kind: {key: [r[key] for r in rs] for key in KEYS} for kind, rs in rounds.items()}
    report["load_avg_after"] = load_avg()
    write_results(args.out, report, markdown(report, args))


def median(xs: list[float | None]) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def markdown(rep: dict, args) -> str:
    fmt = lambda x: "failed" if x is None else f"{x:.2f}"  # noqa: E731
    lines = ["# One stream's decode in process: Kaiten's step against llama-bench on the same GGUF\n",
             f"CPU: {rep['cpu']} (flags: {rep['flags']}). Load {rep['load_avg_before']} before, "
             f"{rep['load_avg_after']} after. Kaiten: extension ISA {rep['isa']}, --quantization auto, dtype auto, "
             f"its decode step at batch 1 after a {max(1, args.context)}-token prompt ({args.steps} steps a round, median). "
             f"llama.cpp: `llama-bench -t {args.threads} -p 0 -n {args.tokens} -d {args.context} -r {args.reps}`, "
             "ms a generated token, with its weights repacked for the CPU (--repack 1, its default) and as stored "
             f"(--repack 0). {args.rounds} alternating rounds; medians, and each round's values.\n",
             "| file | Kaiten step ms | llama-bench ms, repacked | llama-bench ms, as stored | Kaiten / repacked "
             "| Kaiten / as stored | rounds (Kaiten; repacked; as stored) |",
             "|---|---:|---:|---:|---:|---:|---|"]
    for kind, runs in rep["rounds"].items():
        k, rp, nr = (median(runs[x]) for x in KEYS)
        ratio = lambda a, b: "" if a is None or b is None else f"{a / b:.2f}x"  # noqa: E731
        each = "; ".join(", ".join(fmt(x) for x in runs[key]) for key in KEYS)
        lines.append(f"| {kind} | {fmt(k)} | {fmt(rp)} | {fmt(nr)} | {ratio(k, rp)} | {ratio(k, nr)} | {each} |")
    lines.append("\n(A ratio under 1: Kaiten's step takes less time than llama.cpp's token.)")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
