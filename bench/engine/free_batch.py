"""What a batch with no constrained request pays for structured output and the new sampling stages.

    git worktree add /tmp/kaiten-base ff1c0ae      # the engine before structured output
    .venv/bin/python bench/engine/free_batch.py --baseline /tmp/kaiten-base

Runs the offline workload (bench/common/workload.py: 64 requests, prompts of 32..512 tokens, 16..256
output tokens, greedy, ignore_eos) through `LLM.generate` of this checkout and of the baseline
checkout, each in its own process, alternating, `--reps` times; both use this venv and the
serving dtype. Reports the median output tok/s of each and their ratio (issue 11's goal: within
3%). Writes bench/results/free_batch/free_batch.{md,json}.
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

from bench.common.results_files import results_dir  # noqa: E402

RESULTS = results_dir(__file__)

WORKER = r"""
import json, sys, time
sys.path.insert(0, sys.argv[1])
sys.path.insert(1, sys.argv[2])
from bench.common.workload import workload
from engine_worker import LLM, SamplingParams
llm = LLM(sys.argv[3], dtype="auto")
reqs = workload(int(sys.argv[4]), llm.engine.runner.model_config.vocab_size)
def run(batch):
    outs = llm.generate([p for p, _ in batch], [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
                                              for _, n in batch])
    return sum(len(o.token_ids) for o in outs)
run([(list(range(5, 69)), 4)] * 2)
t0 = time.perf_counter()
tokens = run(reqs)
print(json.dumps({"tokens": tokens, "wall_s": time.perf_counter() - t0}))
"""


def run_once(checkout: Path, model: str, n: int) -> float:
    proc = subprocess.run([sys.executable, "-c", WORKER, str(checkout), str(ROOT), model, str(n)],
                          capture_output=True, text=True, cwd=checkout, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"{checkout}: exit {proc.returncode}: {proc.stderr.strip().splitlines()[-3:]}")
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    return out["tokens"] / out["wall_s"]


def git_rev(checkout: Path) -> str:
    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=checkout, capture_output=True,
                          text=True).stdout.strip() or "?"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline", required=True, type=Path, help="a checkout of the baseline commit")
    ap.add_argument("--model", default=str(ROOT / "models" / "SmolLM2-135M-Instruct"))
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    runs: dict[str, list[float]] = {"baseline": [], "current": []}
    for rep in range(args.reps):
        for name, checkout in (("baseline", args.baseline.resolve()), ("current", ROOT)):
            runs[name].append(run_once(checkout, args.model, args.num_requests))
            print(f"rep {rep} {name}: {runs[name][-1]:.1f} tok/s", flush=True)
    base, cur = statistics.median(runs["baseline"]), statistics.median(runs["current"])
    result = {"baseline": git_rev(args.baseline), "current": git_rev(ROOT), "num_requests": args.num_requests,
              "runs": runs, "median_tok_s": {"baseline": base, "current": cur}, "ratio": cur / base}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "free_batch.json").write_text(json.dumps(result, indent=2) + "\n")
    (RESULTS / "free_batch.md").write_text(
        "# A batch with no constrained request: this checkout against the baseline\n\n"
        f"`bench/engine/free_batch.py`, {args.num_requests} requests of the offline workload, greedy, "
        f"{args.reps} alternating runs each, medians.\n\n"
        "| checkout | output tok/s (median) | runs |\n|---|---:|---|\n"
        f"| baseline {result['baseline']} | {base:.1f} | {', '.join(f'{x:.1f}' for x in runs['baseline'])} |\n"
        f"| current {result['current']} | {cur:.1f} | {', '.join(f'{x:.1f}' for x in runs['current'])} |\n\n"
        f"Ratio current / baseline: **{cur / base:.3f}** (goal: at least 0.97).\n")
    print(f"current / baseline = {cur / base:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
