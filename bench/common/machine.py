"""What a benchmark records about the machine it ran on."""
from __future__ import annotations

import os
import platform
from pathlib import Path


def _cpuinfo() -> dict[str, str]:
    """/proc/cpuinfo's fields, the first value of each (the first CPU's); {} where there is none."""
    fields: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    return fields


def cpu_name() -> str:
    return _cpuinfo().get("model name") or platform.processor() or platform.machine()


def cpu_id() -> str:
    """The CPU's family and model as /proc/cpuinfo gives them (hosts of one name differ by these)."""
    fields = _cpuinfo()
    return f"family {fields.get('cpu family', '?')} model {fields.get('model', '?')}"


def load_avg() -> float | None:
    """The 1-minute load average: on a shared machine, read it before and after a run."""
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return None


SIMD_FLAGS = ("avx2", "fma", "f16c", "avx_vnni", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16",
              "amx_tile", "amx_bf16", "amx_int8", "asimd", "sve")


def cpu_flags() -> list[str]:
    """The vector-instruction flags /proc/cpuinfo lists (those the kernels and oneDNN use)."""
    fields = _cpuinfo()
    present = set((fields.get("flags") or fields.get("Features") or "").split())
    return [f for f in SIMD_FLAGS if f in present]
