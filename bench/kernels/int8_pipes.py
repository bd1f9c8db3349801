"""Which AVX2 integer instructions share this CPU's vector pipes: the int8 kernels' instructions
(kernels/csrc/quant/) alone and in pairs, and five ways the int8 panel GEMM's inner loop could
multiply int8 weights by x without VNNI (the sign trick it used, the sign by xor and sub, 7-bit x
as x + 64 against w as stored (what it does now), int16 pairs, the weights as nibbles of w + 128
summed in int16 over a group), on data in registers, in instructions and multiply-adds a cycle of
one core.

A kernel's own rate (bench/kernels/kernel_ab.py) is lower: its loads, a group's scaling and the panels'
packing take their share. The clock comes from a chain of dependent adds (one a cycle).

    .venv/bin/python bench/kernels/int8_pipes.py [--out bench/results/int8_pipes/int8_pipes]

Builds bench/kernels/int8_pipes.cpp with g++ (-O2 -mavx2 -mfma) into ~/.cache/kaiten/int8_pipes; writes
<out>.md and <out>.json.
"""
from __future__ import annotations

import argparse
import hashlib
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.common.machine import cpu_flags, cpu_id, cpu_name, load_avg  # noqa: E402
from bench.common.results_files import results_dir, write_results  # noqa: E402

SOURCE = Path(__file__).with_suffix(".cpp")
BUILDS = Path.home() / ".cache" / "kaiten" / "int8_pipes"


def built() -> Path:
    """The probe's binary, built once per source."""
    exe = BUILDS / f"int8_pipes_{hashlib.sha1(SOURCE.read_bytes()).hexdigest()[:12]}"
    if not exe.exists():
        BUILDS.mkdir(parents=True, exist_ok=True)
        subprocess.run(["g++", "-O2", "-mavx2", "-mfma", "-std=c++17", str(SOURCE), "-o", str(exe)], check=True)
    return exe


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(results_dir(__file__) / "int8_pipes"))
    args = ap.parse_args()
    if "avx2" not in cpu_flags():
        raise SystemExit("int8_pipes: this CPU has no AVX2")
    before = load_avg()
    lines = subprocess.run([str(built())], check=True, capture_output=True, text=True).stdout.splitlines()
    ghz = float(lines[0].split()[1])
    rows = [line for line in lines[1:] if line.startswith("|")]
    report = {"cpu": cpu_name(), "cpu_id": cpu_id(), "flags": " ".join(cpu_flags()), "clock_ghz": ghz,
              "load_avg_before": before, "load_avg_after": load_avg(), "rows": rows}
    markdown = "\n".join([
        "# AVX2 integer instructions a cycle, alone and mixed (bench/kernels/int8_pipes.py)\n",
        f"CPU: {report['cpu']} ({report['cpu_id']}; flags: {report['flags']}), one core at {ghz:.2f} GHz by a "
        f"chain of dependent adds. Load {before} before, {report['load_avg_after']} after. Medians of 9 rounds, each "
        "timing the clock and then every mix. Each mix: 8 "
        "independent instructions an iteration (two kinds: alternating), or a kernel loop's quad of inputs for 3 "
        "rows of x against a panel's two vectors, 192 multiply-adds (the nibble split: two quads of 2 rows, 256), "
        "its x broadcast from memory.\n",
        "| instructions | a cycle | multiply-adds a cycle |",
        "|---|---:|---:|",
        *rows,
    ])
    write_results(args.out, report, markdown)


if __name__ == "__main__":
    main()
