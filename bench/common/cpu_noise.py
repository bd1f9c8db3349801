"""A neighbour process busy a given fraction of one core, in short bursts: the load the gateway,
Redis and the benchmark client put on a served engine's cores, for a benchmark that runs the engine
or a kernel alone.

    with busy_neighbour(0.1):      # busy 0.2 ms of every 2 ms
        ...
"""
from __future__ import annotations

import contextlib
import multiprocessing as mp
import time


def _burn(fraction: float, period: float, stop) -> None:
    while not stop.is_set():
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < fraction * period:
            pass
        time.sleep((1 - fraction) * period)


@contextlib.contextmanager
def busy_neighbour(fraction: float, period: float = 0.002):
    """Runs the neighbour for the block; fraction 0 runs none."""
    if fraction <= 0:
        yield
        return
    stop = mp.Event()
    proc = mp.Process(target=_burn, args=(fraction, period, stop), daemon=True)
    proc.start()
    try:
        yield
    finally:
        stop.set()
        proc.join()
