"""What a benchmark records about the machine it ran on."""
from __future__ import annotations

import os
import platform
from pathlib import Path


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def load_avg() -> float | None:
    """The 1-minute load average: on a shared machine, read it before and after a run."""
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return None


def cpu_flags(names: tuple[str, ...]) -> str:
    """Which of the /proc/cpuinfo flags `names` this CPU has, space-separated."""
    try:
        line = next(x for x in Path("/proc/cpuinfo").read_text().splitlines() if x.startswith("flags"))
    except (OSError, StopIteration):
        return ""
    have = set(line.split(":", 1)[1].split())
    return " ".join(f for f in names if f in have)
