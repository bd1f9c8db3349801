"""The timing loop the micro-benchmarks share."""
from __future__ import annotations

import statistics
import time


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
