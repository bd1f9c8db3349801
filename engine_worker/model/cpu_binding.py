"""Which cores each tensor-parallel rank runs on (--cpu-binding).

    ""        the default: this process's cores (os.sched_getaffinity) split evenly, in order of
              their NUMA node where /sys/devices/system/node has more than one, so that a rank's
              cores (and the memory it first touches) sit on one node where the split allows
    "none"    no pinning
    "0-3|4-7" each rank's cores, rank 0 first, in Linux's cpulist form, as vLLM's
              VLLM_CPU_OMP_THREADS_BIND takes them
"""
from __future__ import annotations

import os
from pathlib import Path

NODES = Path("/sys/devices/system/node")


def parse_cpulist(text: str) -> list[int]:
    """'0-3,8,10-11' -> [0, 1, 2, 3, 8, 10, 11]."""
    cpus: list[int] = []
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        cpus.extend(range(int(lo), int(hi or lo) + 1))
    return cpus


def _node_of_cpu() -> dict[int, int]:
    nodes = sorted(NODES.glob("node[0-9]*")) if NODES.is_dir() else []
    return {cpu: int(n.name[4:]) for n in nodes for cpu in parse_cpulist((n / "cpulist").read_text())}


def rank_cpus(binding: str, world: int) -> list[list[int]] | None:
    """Each rank's cores, or None (no pinning). ValueError, in one line, for a bad binding."""
    if binding == "none":
        return None
    if binding:
        try:
            ranks = [parse_cpulist(part) for part in binding.split("|")]
        except ValueError:
            raise ValueError(f"--cpu-binding {binding!r} is not a '|'-separated list of cpulists "
                             f"such as 0-3|4-7") from None
        if len(ranks) != world or not all(ranks):
            raise ValueError(f"--cpu-binding {binding!r} names {len(ranks)} ranks' cores; "
                             f"--tensor-parallel-size is {world}")
        return ranks
    cpus = sorted(os.sched_getaffinity(0))
    node = _node_of_cpu()
    if len(set(node.values())) > 1:
        cpus.sort(key=lambda c: (node.get(c, 0), c))
    if len(cpus) < world:
        raise ValueError(f"--tensor-parallel-size {world} needs a core a rank; this process may run on "
                         f"{len(cpus)}")
    share = len(cpus) // world
    return [cpus[r * share:(r + 1) * share] for r in range(world)]
