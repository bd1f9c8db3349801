"""The worker's numbers: latency distributions (the step, the Redis round) and event counters."""
from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass, field


@dataclass
class LatencyStats:
    """Count, mean, max and recent percentiles of a duration measured once per step."""
    count: int = 0
    total_s: float = 0.0
    max_s: float = 0.0
    recent: deque = field(default_factory=lambda: deque(maxlen=4096))

    def add(self, dt: float) -> None:
        self.count += 1
        self.total_s += dt
        self.max_s = max(self.max_s, dt)
        self.recent.append(dt)

    def summary(self) -> dict[str, float]:
        xs = sorted(self.recent)
        pct = (lambda q: xs[min(len(xs) - 1, int(q * len(xs)))] * 1e6) if xs else (lambda q: 0.0)
        return {"count": self.count, "mean_us": (self.total_s / self.count * 1e6) if self.count else 0.0,
                "p50_us": pct(0.5), "p99_us": pct(0.99), "max_us": self.max_s * 1e6}

    def __str__(self) -> str:
        s = self.summary()
        return (f"n={s['count']} mean={s['mean_us']:.0f}us p50={s['p50_us']:.0f}us p99={s['p99_us']:.0f}us "
                f"max={s['max_us']:.0f}us")


class Counters:
    """Event counts that several threads add to (requests, claims, Redis errors, ...)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._n: dict[str, int] = {}

    def add(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._n[name] = self._n.get(name, 0) + n

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._n)

    def __getitem__(self, name: str) -> int:
        return self._n.get(name, 0)

    def __repr__(self) -> str:
        with self._lock:
            return repr(dict(sorted(self._n.items())))
