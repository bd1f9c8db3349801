"""The cold build of the C++ CPU ops: the working tree's kernels/ against a git revision's, each
built from an empty cache (a new TORCH_EXTENSIONS_DIR) in a process of its own, alternating,
--rounds rounds. Wall time, and the CPU seconds of the build's processes (the compilers'
included), which depend less on what else runs on a shared machine.

    .venv/bin/python bench/kernels/kernel_build.py [--base main] [--rounds 1] [--out kernel_build]

Both trees are copied at the start (`git archive` for the revision), so the working tree may
change while it runs. A tree's loader is kernels.cpu_ops_build.load_cpu_ops, or for a revision
from before it, kernels.cpu_attention.load_extension (cpp_extension against torch/extension.h).
Writes bench/results/kernel_build/<out>.{md,json}.
"""
from __future__ import annotations

import argparse
import io
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.common.machine import cpu_flags, cpu_name, load_avg  # noqa: E402
from bench.common.results_files import results_dir, write_results  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
RESULTS = results_dir(__file__)
LOAD = ("try:\n    from kernels.cpu_ops_build import load_cpu_ops as load\n"
        "except ImportError:\n    from kernels.cpu_attention import load_extension as load\n"
        "load()\n")


def snapshot(rev: str | None, folder: Path) -> Path:
    """kernels/ of the working tree (rev None) or of a git revision, copied under folder."""
    folder.mkdir(parents=True)
    if rev is None:
        shutil.copytree(ROOT / "kernels", folder / "kernels", ignore=shutil.ignore_patterns("__pycache__"))
        return folder
    tree = subprocess.run(["git", "-C", str(ROOT), "archive", rev, "kernels"], check=True, capture_output=True).stdout
    with tarfile.open(fileobj=io.BytesIO(tree)) as tar:
        tar.extractall(folder, filter="data")
    return folder


def cold_build(tree: Path, cache: Path) -> tuple[float, float]:
    """(wall s, CPU s) of a load that builds tree's kernels into the empty folder cache."""
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(cache), "PYTHONPATH": str(tree)}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", LOAD], cwd=tree, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise SystemExit(f"the build in {tree} failed:\n{proc.stderr[-3000:]}")
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", default="main", help="the git revision to compare against")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--out", default="kernel_build")
    args = ap.parse_args()
    load0 = load_avg()
    runs: dict[str, dict[str, list[float]]] = {args.base: {"wall": [], "cpu": []}, "tree": {"wall": [], "cpu": []}}
    with tempfile.TemporaryDirectory(prefix="kernel_build_") as tmp:
        trees = {args.base: snapshot(args.base, Path(tmp) / "base"), "tree": snapshot(None, Path(tmp) / "tree")}
        for r in range(args.rounds):
            for name in (list(trees) if r % 2 == 0 else list(trees)[::-1]):
                wall, cpu = cold_build(trees[name], Path(tmp) / f"cache_{name}_{r}")
                runs[name]["wall"].append(wall)
                runs[name]["cpu"].append(cpu)
                print(f"round {r}: {name} {wall:.1f} s wall, {cpu:.1f} CPU s", file=sys.stderr)
    med = {name: {k: statistics.median(v) for k, v in t.items()} for name, t in runs.items()}
    lines = [f"# The C++ CPU ops' cold build: working tree against {args.base}\n",
             f"CPU: {cpu_name()} ({' '.join(cpu_flags())}), torch {torch.__version__}, {args.rounds} alternating "
             f"round(s), medians; load {load0} before, {load_avg()} after.\n",
             "| tree | wall s | CPU s |", "|---|---:|---:|"]
    lines += [f"| {name} | {m['wall']:.1f} | {m['cpu']:.1f} |" for name, m in med.items()]
    base, tree = med[args.base], med["tree"]
    lines.append(f"\nWorking tree / {args.base}: wall {tree['wall'] / base['wall']:.2f}, "
                 f"CPU {tree['cpu'] / base['cpu']:.2f}.")
    write_results(RESULTS / args.out, {"cpu": cpu_name(), "flags": cpu_flags(), "torch": torch.__version__,
                                       "base": args.base, "runs": runs}, "\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
