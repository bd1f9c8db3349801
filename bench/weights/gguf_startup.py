"""Start-up from a new GGUF file (conversion + engine load, compile warm-up included) and the
engine's resident weight bytes against the GGUF's tensor bytes (rotary cos/sin tables, which
checkouts before 1b76c7f kept by position, apart), --quantization auto vs none, for
this checkout and, as "today", another one (--baseline: a checkout, e.g. from
`git archive BASE | tar -x -C DIR`; one from before --quantization runs as it is, "-"). The
issue's "today" is the commit before quantized serving: 4eec86b~1.

Each run is a fresh process with an empty KAITEN_MODELS_DIR, so the file is converted anew; the
kernel extension and Inductor caches are warm (one untimed run per variant first), as on a
machine that has served any model before. Runs alternate between the variants, round by round,
and the median is reported.

    .venv/bin/python bench/weights/gguf_startup.py [--gguf FILE] [--rounds 3] --baseline DIR
        [--out bench/results/gguf_startup/NAME] [--resident-only]

--resident-only: no timing, the resident weights alone: the file converted once (into one models
dir that every run shares), each variant loaded once, eager (no compile warm-up).

Writes --out's .md and .json (default bench/results/gguf_startup/gguf_startup).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.common.machine import cpu_flags, cpu_name, load_avg  # noqa: E402
from bench.common.results_files import results_dir, write_results  # noqa: E402

RESULTS = results_dir(__file__)
# Run inside the checkout under test: convert, load, report. weight_bytes as bench/weights/quant_decode.py counts.
CHILD = r"""
import json, resource, sys, time
import torch
t0 = time.perf_counter()
from shared.gguf_convert import ensure_converted_gguf
model_dir = ensure_converted_gguf(sys.argv[1])
t1 = time.perf_counter()
from engine_worker import LLM
llm = LLM(str(model_dir), kv_cache_memory="64MiB", **({"quantization": sys.argv[2]} if sys.argv[2] != "-" else {}),
          **({"enforce_eager": True} if sys.argv[3] == "eager" else {}))
t2 = time.perf_counter()
model = llm.engine.runner.model
seen = {id(t): t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()]}
rope = sum(b.numel() * b.element_size() for n, b in model.named_buffers() if n.rsplit(".", 1)[-1] in ("cos", "sin"))
print(json.dumps({"convert_s": t1 - t0, "load_s": t2 - t1, "total_s": t2 - t0,
                  "weights_bytes": sum(seen.values()) - rope, "rope_table_bytes": rope, "dtype": str(llm.engine.runner.dtype),
                  "max_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))
"""


def gguf_tensor_bytes(path: Path) -> int:
    from gguf import GGUFReader
    return sum(int(t.n_bytes) for t in GGUFReader(str(path)).tensors)


def run(checkout: Path, gguf: Path, quantization: str, models: str | None = None) -> dict:
    """One fresh process's start-up; in `models` (eager) where given, else in a new models dir."""
    with tempfile.TemporaryDirectory() as fresh:
        env = {**os.environ, "KAITEN_MODELS_DIR": models or fresh, "PYTHONPATH": str(checkout),
               "PYTHONDONTWRITEBYTECODE": "1"}
        out = subprocess.run([sys.executable, "-c", CHILD, str(gguf), quantization, "eager" if models else "compiled"],
                             cwd=checkout, env=env, capture_output=True, text=True, timeout=1800)
    if out.returncode:
        raise RuntimeError(f"{checkout} {quantization}: {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gguf", type=Path)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--baseline", type=Path, required=True, help="a checkout of the code to compare with")
    ap.add_argument("--out", type=Path, default=RESULTS / "gguf_startup")
    ap.add_argument("--quantization", default="auto,none", help="the modes to run, where a checkout has them")
    ap.add_argument("--resident-only", action="store_true", help="the resident weights alone: one eager load each")
    args = ap.parse_args()
    from bench.weights.perplexity import default_gguf
    gguf = args.gguf or default_gguf()
    checkouts = {"this branch": ROOT, "today (baseline)": args.baseline}
    variants = [(c, q) for c, path in checkouts.items() for q in quantizations(path)
                if q == "-" or q in args.quantization.split(",")]
    meta = {"cpu": cpu_name(), "flags": cpu_flags(), "load_before": load_avg(), "gguf": gguf.name,
            "gguf_tensor_bytes": gguf_tensor_bytes(gguf), "gguf_file_bytes": gguf.stat().st_size,
            "baseline": str(args.baseline), "rounds": args.rounds}
    if args.resident_only:
        with tempfile.TemporaryDirectory() as models:
            rows = {f"{c} / {q}": run(checkouts[c], gguf, q, models) for c, q in variants}
        meta.update(load_after=load_avg(), rounds=0)
        write_results(args.out, {"meta": meta, "rows": rows}, render(meta, rows))
        return 0
    for c, q in variants:                        # warm the extension and Inductor caches
        run(checkouts[c], gguf, q)
    runs = {f"{c} / {q}": [] for c, q in variants}
    for _ in range(args.rounds):
        for c, q in variants:
            runs[f"{c} / {q}"].append(run(checkouts[c], gguf, q))
            print(c, q, runs[f"{c} / {q}"][-1], flush=True)
    meta["load_after"] = load_avg()
    rows = {name: {k: statistics.median(r[k] for r in rs) if k != "dtype" else rs[0][k] for k in rs[0]}
            for name, rs in runs.items()}
    write_results(args.out, {"meta": meta, "rows": rows, "runs": runs}, render(meta, rows))
    return 0


def quantizations(checkout: Path) -> tuple[str, ...]:
    """auto and none where the checkout has --quantization; else "-", its only way (a checkout from
    before quantized serving dequantizes every GGUF, as none does)."""
    return ("auto", "none") if "quantization" in (checkout / "shared" / "config.py").read_text() else ("-",)


def render(meta: dict, rows: dict) -> str:
    base = next(r for name, r in rows.items() if name.startswith("today"))["total_s"]
    lines = ["# Start-up from a new GGUF file and resident weights\n",
             f"CPU: {meta['cpu']} ({', '.join(meta['flags'])}); load average {meta['load_before']} before, "
             f"{meta['load_after']} after; " + (f"median of {meta['rounds']} interleaved rounds, each a fresh process "
             "with an empty models dir (kernel and Inductor caches warm)" if meta["rounds"] else
             "resident weights only: one eager load a variant, the file converted once (times not comparable)") +
             f". {meta['gguf']}: "
             f"{meta['gguf_tensor_bytes'] / 1e6:.1f} MB of tensors ({meta['gguf_file_bytes'] / 1e6:.1f} MB file). "
             f"Today: {meta['baseline']}.\n",
             "| checkout / quantization | compute dtype | convert s | load s | start-up s | vs today | "
             "resident weights MB | / GGUF tensors | rotary tables MB | max RSS MB |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, r in rows.items():
        lines.append(f"| {name} | {r['dtype'].removeprefix('torch.')} | {r['convert_s']:.2f} | {r['load_s']:.2f} | "
                     f"{r['total_s']:.2f} | {r['total_s'] / base:.2f}x | {r['weights_bytes'] / 1e6:.1f} | "
                     f"{r['weights_bytes'] / meta['gguf_tensor_bytes']:.2f}x | {r.get('rope_table_bytes', 0) / 1e6:.1f} | "
                     f"{r['max_rss_bytes'] / 1e6:.0f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
