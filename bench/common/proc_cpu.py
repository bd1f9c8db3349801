"""CPU time and preemptions of a process tree, by process and thread, read from /proc (Linux).

A benchmark snapshots the tree before and after a run and subtracts: where a served token's
time goes besides the engine's step (the gateway, Redis, the engine's own threads)."""
from __future__ import annotations

import os
from pathlib import Path

TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100

ROLES = (("redis-server", "redis"), ("shared.cli gateway", "gateway"), ("gateway.cli", "gateway"),
         ("shared.cli engine", "engine"), ("engine_worker.worker", "engine"), ("engine_worker.cli", "engine"),
         ("shared.cli serve", "launcher"))


def _stat(path: Path) -> list[str] | None:
    try:
        return path.read_text().rsplit(")", 1)[1].split()    # fields from the 3rd (state) on
    except (OSError, IndexError):
        return None


def _preemptions(path: Path) -> int:
    try:
        for line in path.read_text().splitlines():
            if line.startswith("nonvoluntary_ctxt_switches"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def role(pid: int) -> str:
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return "gone"
    return next((name for key, name in ROLES if key in cmd), Path(cmd.split(" ", 1)[0]).name or str(pid))


def descendants(root: int) -> list[int]:
    parent = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (st := _stat(Path("/proc", entry, "stat"))) is not None:
            parent[int(entry)] = int(st[1])
    tree, frontier = [], [root]
    while frontier:
        pid = frontier.pop()
        tree.append(pid)
        frontier += [child for child, p in parent.items() if p == pid]
    return tree


def snapshot(root: int) -> dict[tuple[str, str], tuple[float, int]]:
    """{(process role, thread): (CPU seconds, preemptions)} over the tree under `root`. A process's
    main thread is "main"; its other threads are keyed by thread id (so they can be ranked)."""
    out: dict[tuple[str, str], tuple[float, int]] = {}
    for pid in descendants(root):
        name = role(pid)
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            task = Path(f"/proc/{pid}/task/{tid}")
            st = _stat(task / "stat")
            if st is None:
                continue
            key = (f"{name}[{pid}]", "main" if tid == str(pid) else tid)
            out[key] = ((int(st[11]) + int(st[12])) / TICK, _preemptions(task / "status"))
    return out


def difference(before: dict, after: dict) -> dict[tuple[str, str], tuple[float, int]]:
    return {k: (v[0] - before.get(k, (0.0, 0))[0], v[1] - before.get(k, (0.0, 0))[1]) for k, v in after.items()}


def by_role(diff: dict[tuple[str, str], tuple[float, int]], top_threads: int = 2) -> dict[str, tuple[float, int]]:
    """Each process's main thread and its `top_threads` busiest other threads apart, the rest of
    its threads summed: {"engine main": (s, preemptions), "engine thread 1": ..., "engine other threads": ...}."""
    rows: dict[str, list] = {}
    for proc in sorted({proc for proc, _ in diff}):
        name = proc.split("[", 1)[0]
        threads = sorted(((t, v) for (p, t), v in diff.items() if p == proc and t != "main"), key=lambda tv: -tv[1][0])
        parts = [("main", diff.get((proc, "main"), (0.0, 0)))]
        parts += [(f"thread {i + 1}", v) for i, (_, v) in enumerate(threads[:top_threads])]
        rest = threads[top_threads:]
        if rest:
            parts.append(("other threads", (sum(v[0] for _, v in rest), sum(v[1] for _, v in rest))))
        for label, (sec, pre) in parts:
            acc = rows.setdefault(f"{name} {label}", [0.0, 0])
            acc[0] += sec
            acc[1] += pre
    return {k: (v[0], v[1]) for k, v in rows.items() if v[0] > 0 or v[1] > 0}
