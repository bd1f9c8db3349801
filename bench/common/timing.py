"""The timing loops the benchmarks share."""
from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from pathlib import Path


def median_ms(fn, runs: int, warmup: int = 3) -> tuple[float, float]:
    """(median, min) wall time of `fn` in ms over `runs` calls, after `warmup` calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3, min(times) * 1e3


def interleaved(names, rounds: int, run) -> dict:
    """run(name) for every name in each of `rounds` rounds, the order reversed every other round
    (so a drift in the machine's speed falls on all alike); each name's results in round order."""
    results = {name: [] for name in names}
    for r in range(rounds):
        for name in (list(results) if r % 2 == 0 else list(results)[::-1]):
            results[name].append(run(name))
    return results


def measure_in_process(script: str, argv: list[str], cwd: Path | None = None) -> dict:
    """`script --measure *argv` in a new Python process (a fresh heap and memory placement each
    time): the JSON object it prints last."""
    out = subprocess.run([sys.executable, str(script), "--measure", *argv], check=True, capture_output=True,
                         text=True, cwd=cwd)
    return json.loads(out.stdout.strip().splitlines()[-1])


def step_ms(llm, steps: int) -> float:
    """An engine's mean decode step in ms over `steps` steps, after one untimed step."""
    llm.step()
    t0 = time.perf_counter()
    for _ in range(steps):
        llm.step()
    return (time.perf_counter() - t0) / steps * 1e3
