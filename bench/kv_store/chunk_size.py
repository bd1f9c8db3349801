"""What value size a KV store chunk needs: Redis SET and GET throughput by value size, through the
client every engine uses (shared/redis_conn.py, hiredis), against a local redis-server process.

Per value size: `--mib` MiB written as distinct keys (SET), then read back (GET), `--rounds` times;
the median round's MB/s and time per operation. A chunk's value must be large enough that the
per-command cost (a round trip, the parse) is small against the bytes moved.

    .venv/bin/python bench/kv_store/chunk_size.py [--mib 64] [--rounds 3]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.common.machine import cpu_flags, cpu_id, cpu_name, load_avg  # noqa: E402
from bench.common.results_files import results_dir, write_results  # noqa: E402

RESULTS = results_dir("kv_store")
SIZES_KIB = (16, 64, 128, 256, 512, 1024, 2048, 4096, 16384)


def one_round(client, size: int, total: int) -> tuple[float, float]:
    """Seconds to SET then to GET `total` bytes as values of `size` bytes."""
    n = max(1, total // size)
    value = os.urandom(size)
    t0 = time.perf_counter()
    for i in range(n):
        client.set(f"bench:{size}:{i}", value)
    t1 = time.perf_counter()
    for i in range(n):
        got = client.get(f"bench:{size}:{i}")
        assert got is not None and len(got) == size
    t2 = time.perf_counter()
    client.flushall()
    return t1 - t0, t2 - t1


def measure(client, total: int, rounds: int) -> list[dict]:
    rows = []
    for kib in SIZES_KIB:
        size = kib * 1024
        n = max(1, total // size)
        sets, gets = zip(*(one_round(client, size, total) for _ in range(rounds)))
        s, g = statistics.median(sets), statistics.median(gets)
        rows.append({"value_kib": kib, "ops": n, "set_mb_s": n * size / s / 1e6, "get_mb_s": n * size / g / 1e6,
                     "set_ms_op": s / n * 1e3, "get_ms_op": g / n * 1e3})
    return rows


def markdown(rows: list[dict], meta: dict) -> str:
    lines = [f"CPU: {meta['cpu']} ({meta['cpu_id']}; {', '.join(meta['flags'])}), load {meta['load_before']} -> "
             f"{meta['load_after']}; redis-server {meta['redis']} on the same machine, {meta['mib']} MiB per size, "
             f"median of {meta['rounds']} rounds", "",
             "| value | SET MB/s | GET MB/s | SET ms/op | GET ms/op |", "|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['value_kib']} KiB | {r['set_mb_s']:.0f} | {r['get_mb_s']:.0f} | {r['set_ms_op']:.3f} "
                     f"| {r['get_ms_op']:.3f} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=64, help="MiB moved per value size and round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=str(RESULTS / "chunk_size"))
    args = ap.parse_args()
    os.environ.setdefault("KAITEN_TEST_REDIS", "process")
    from shared.redis_conn import redis_client
    from tests.support.redis_server import RedisServer
    server = RedisServer().start()
    try:
        client = redis_client(server.url, socket_timeout=30)
        meta = {"cpu": cpu_name(), "cpu_id": cpu_id(), "flags": cpu_flags(), "load_before": load_avg(),
                "mib": args.mib, "rounds": args.rounds, "redis": client.info()["redis_version"]}
        rows = measure(client, args.mib * 2**20, args.rounds)
        meta["load_after"] = load_avg()
    finally:
        server.stop()
    write_results(args.out, {"meta": meta, "rows": rows}, markdown(rows, meta))


if __name__ == "__main__":
    main()
