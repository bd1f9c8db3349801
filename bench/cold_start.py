"""Cold and warm start of `kaiten serve`: seconds to GET /ready and to the first streamed token,
with empty caches and again with the caches the first start left, then the TTFT and TPOT of the
first --requests requests after /ready (all sent at once), after the cold start and after the
warm one, against the same batch sent again
once the engine has no compilation left in the background (the steady state; /v1/status
"compiling"), for this checkout and, as the baseline, another one (--baseline: e.g.
`git worktree add /tmp/main-base main`), in the same run.

Fresh caches are new folders for TORCH_EXTENSIONS_DIR, TORCHINDUCTOR_CACHE_DIR, XDG_CACHE_HOME
and KAITEN_MODELS_DIR; --models-dir keeps a converted model (no download) and --extensions-dir
keeps built C++ kernels, where the run measures the compile part alone.

    .venv/bin/python bench/cold_start.py [--baseline DIR] [--model GGUF] [--requests 32]
        [--models-dir DIR] [--extensions-dir DIR] [--out NAME]

Writes bench/results/cold_start/<NAME>.{md,json} (default cold_start).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common.machine import cpu_flags, cpu_id, cpu_name, load_avg  # noqa: E402
from bench.common.results_files import results_dir, write_results  # noqa: E402

RESULTS = results_dir(__file__)
PROMPT = "Write a short story about a lighthouse keeper."
MAX_TOKENS = 64


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stream_times(base: str, max_tokens: int = MAX_TOKENS) -> tuple[float, float]:
    """(TTFT s, TPOT s) of one streamed greedy completion."""
    body = json.dumps({"prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0,
                       "ignore_eos": True, "stream": True}).encode()
    req = urllib.request.Request(base + "/v1/completions", body, {"Content-Type": "application/json"})
    start = time.perf_counter()
    first = last = None
    tokens = 0
    with urllib.request.urlopen(req, timeout=600) as resp:
        for line in resp:
            if not line.startswith(b"data: {"):
                continue
            last = time.perf_counter()
            first = first or last
            tokens += 1
    if first is None:
        raise RuntimeError("no token streamed")
    return first - start, (last - first) / max(1, tokens - 1)


def batch_times(base: str, n: int) -> list[tuple[float, float]]:
    """n streamed requests sent at once: each one's (TTFT, TPOT)."""
    out: list = [None] * n

    def one(i: int) -> None:
        out[i] = stream_times(base)
    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def start(checkout: Path, env: dict, port: int, log_path: Path) -> tuple[subprocess.Popen, float, float]:
    """`kaiten serve` in `checkout`: the process, seconds to /ready, seconds to the first token."""
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "shared.cli", "serve", "--port", str(port)], cwd=checkout,
                            env={**env, "PYTHONPATH": str(checkout)}, stdout=log_path.open("w"),
                            stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"kaiten serve exited: see {log_path}")
        try:
            with urllib.request.urlopen(base + "/ready", timeout=2) as r:
                if r.status == 200:
                    break
        except OSError:
            pass
        time.sleep(0.1)
    ready = time.perf_counter() - t0
    ttft, _ = stream_times(base, 1)
    return proc, ready, ready + ttft


def wait_compiled(base: str, timeout: float = 1800) -> float:
    """perf_counter() once the engine has no compilation going on in the background (a checkout
    that compiles before /ready: at once)."""
    deadline = time.perf_counter() + timeout
    while time.perf_counter() < deadline:
        with urllib.request.urlopen(base + "/v1/status", timeout=10) as r:
            if not json.load(r).get("compiling"):
                return time.perf_counter()
        time.sleep(0.5)
    raise RuntimeError("the engine still compiles")


def stop(proc: subprocess.Popen) -> None:
    os.killpg(proc.pid, signal.SIGINT)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


def p99(xs: list[float]) -> float:
    return sorted(xs)[min(len(xs) - 1, round(0.99 * (len(xs) - 1)))]


def summary(times: list[tuple[float, float]]) -> dict:
    ttft, tpot = [t for t, _ in times], [p for _, p in times]
    return {"ttft_median_ms": 1e3 * statistics.median(ttft), "ttft_p99_ms": 1e3 * p99(ttft),
            "tpot_median_ms": 1e3 * statistics.median(tpot), "tpot_p99_ms": 1e3 * p99(tpot)}


def run_checkout(name: str, checkout: Path, args, work: Path) -> dict:
    """A cold start (new caches), a warm start (the same caches), the first batch after /ready and
    the steady state, for one checkout."""
    caches = {k: str(work / name / k.lower()) for k in ("TORCH_EXTENSIONS_DIR", "TORCHINDUCTOR_CACHE_DIR",
                                                         "XDG_CACHE_HOME", "KAITEN_MODELS_DIR")}
    if args.models_dir:
        caches["KAITEN_MODELS_DIR"] = args.models_dir
    if args.extensions_dir:
        caches["TORCH_EXTENSIONS_DIR"] = args.extensions_dir
    env = {**os.environ, **caches, "KAITEN_MODEL": args.model, "KAITEN_METRICS_PORT": "0"}
    env.pop("KAITEN_ENFORCE_EAGER", None)
    row: dict = {"checkout": str(checkout)}
    for phase in ("cold", "warm"):
        port = free_port()
        launched = time.perf_counter()
        proc, ready, first = start(checkout, env, port, work / f"{name}-{phase}.log")
        try:
            row[f"{phase}_ready_s"], row[f"{phase}_first_token_s"] = ready, first
            print(f"{name} {phase}: /ready {ready:.1f} s, first token {first:.1f} s", flush=True)
            base = f"http://127.0.0.1:{port}"
            after = "after_ready" if phase == "cold" else "after_warm_ready"
            row[after] = summary(batch_times(base, args.requests))
            row[f"{phase}_compiled_s"] = wait_compiled(base) - launched
            if phase == "cold":
                row["steady"] = summary(batch_times(base, args.requests))
            print(f"{name} {phase}: after /ready {row[after]}, compiled at {row[f'{phase}_compiled_s']:.1f} s"
                  + (f", steady {row['steady']}" if phase == "cold" else ""), flush=True)
        finally:
            stop(proc)
    for after in ("after_ready", "after_warm_ready"):
        row[f"{after}_tpot_p99_over_steady_median"] = row[after]["tpot_p99_ms"] / row["steady"]["tpot_median_ms"]
    row["log_tail"] = [line for line in (work / f"{name}-warm.log").read_text().splitlines()
                       if "HTTP/1.1" not in line][:40]
    return row


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--baseline", type=Path, help="another checkout, measured in the same run")
    ap.add_argument("--model", default="", help="KAITEN_MODEL: a GGUF file or a model folder (default: the default)")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--models-dir", default="", help="keep this KAITEN_MODELS_DIR (a converted model, no download)")
    ap.add_argument("--extensions-dir", default="", help="keep this TORCH_EXTENSIONS_DIR (built C++ kernels)")
    ap.add_argument("--out", default="cold_start")
    args = ap.parse_args()
    checkouts = {"this checkout": ROOT, **({"baseline": args.baseline.resolve()} if args.baseline else {})}
    meta = {"cpu": cpu_name(), "cpu_id": cpu_id(), "flags": cpu_flags(), "load_before": load_avg(),
            "model": args.model or "default", "requests": args.requests, "max_tokens": MAX_TOKENS,
            "models_dir_kept": bool(args.models_dir), "extensions_dir_kept": bool(args.extensions_dir)}
    with tempfile.TemporaryDirectory(prefix="kaiten-cold-") as tmp:
        rows = {name: run_checkout(name.replace(" ", "-"), path, args, Path(tmp)) for name, path in checkouts.items()}
    meta["load_after"] = load_avg()
    write_results(RESULTS / args.out, {"meta": meta, "rows": rows}, render(meta, rows))
    return 0


def render(meta: dict, rows: dict) -> str:
    kept = [what for what, k in (("models dir", "models_dir_kept"), ("C++ kernels", "extensions_dir_kept")) if meta[k]]
    lines = ["# Cold and warm start of `kaiten serve`\n",
             f"CPU: {meta['cpu']} ({meta['cpu_id']}; {', '.join(meta['flags'])}); load average "
             f"{meta['load_before']} before, {meta['load_after']} after (a shared machine). Model: {meta['model']}. "
             f"Cold: new cache folders{' but for the ' + ' and '.join(kept) + ', kept' if kept else ''}; warm: "
             f"the same again. Then {meta['requests']} streamed requests at once ({meta['max_tokens']} tokens each), "
             "right after /ready, and the same batch again once the engine compiles nothing in the background "
             "(steady).\n",
             "| checkout | cold /ready s | cold first token s | warm /ready s | warm first token s |",
             "|---|---:|---:|---:|---:|"]
    for name, r in rows.items():
        lines.append(f"| {name} | {r['cold_ready_s']:.1f} | {r['cold_first_token_s']:.1f} | "
                     f"{r['warm_ready_s']:.1f} | {r['warm_first_token_s']:.1f} |")
    lines += ["", "| checkout | start | compiled at s | first batch's TPOT P99 / steady TPOT median |",
              "|---|---|---:|---:|"]
    lines += [f"| {name} | {phase} | {r[f'{phase}_compiled_s']:.1f} | {r[f'{after}_tpot_p99_over_steady_median']:.2f}x |"
              for name, r in rows.items() for phase, after in (("cold", "after_ready"), ("warm", "after_warm_ready"))]
    lines += ["", "| checkout | batch | TTFT median ms | TTFT P99 ms | TPOT median ms | TPOT P99 ms |",
              "|---|---|---:|---:|---:|---:|"]
    for name, r in rows.items():
        for batch in ("after_ready", "after_warm_ready", "steady"):
            s = r[batch]
            lines.append(f"| {name} | {batch.replace('_', ' ')} | {s['ttft_median_ms']:.0f} | {s['ttft_p99_ms']:.0f} | "
                         f"{s['tpot_median_ms']:.1f} | {s['tpot_p99_ms']:.1f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
