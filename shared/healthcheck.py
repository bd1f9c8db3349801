"""Container healthchecks that import neither torch nor the engine (they run every few seconds).

    python -m shared.healthcheck engine            # this host's engine heartbeat is fresh in Redis
    python -m shared.healthcheck http URL          # URL answers 2xx (gateway /ready, tokenizer /health)

Exit code 0 when healthy, 1 otherwise, with one line saying why.
"""
from __future__ import annotations

import socket
import sys
import time
import urllib.error
import urllib.request


def engine_heartbeat(redis_url: str, engine_id: str, max_age: float) -> tuple[bool, str]:
    import msgpack

    from shared import names
    from shared.redis_conn import redis_client
    try:
        raw = redis_client(redis_url, retries=0, socket_timeout=2.0).get(names.heartbeat_key(engine_id))
    except Exception as e:
        return False, f"Redis: {e}"
    if raw is None:
        return False, f"no heartbeat for engine {engine_id!r}"
    try:
        hb = msgpack.unpackb(raw, raw=False)
        age = time.time() - float(hb.get("time", 0))
    except Exception as e:
        return False, f"unreadable heartbeat: {e}"
    if age > max_age:
        return False, f"heartbeat of {engine_id!r} is {age:.1f} s old"
    return True, f"engine {engine_id!r} model {hb.get('model')!r} running {hb.get('num_running')}"


def http(url: str, timeout: float = 3.0) -> tuple[bool, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return 200 <= resp.status < 300, f"{url}: {resp.status}"
    except urllib.error.HTTPError as e:
        return False, f"{url}: {e.code}"
    except (urllib.error.URLError, OSError, ValueError) as e:
        return False, f"{url}: {e}"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["engine"]:
        from shared.config import WorkerConfig
        cfg = WorkerConfig.from_env()
        engine_id = argv[1] if len(argv) > 1 else (cfg.engine_id or socket.gethostname() or "engine")
        ok, why = engine_heartbeat(cfg.redis_url, engine_id, cfg.heartbeat_ttl)
    elif argv[:1] == ["http"] and len(argv) == 2:
        ok, why = http(argv[1])
    else:
        print(__doc__, file=sys.stderr)
        return 2
    print(("healthy: " if ok else "unhealthy: ") + why, file=sys.stdout if ok else sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
