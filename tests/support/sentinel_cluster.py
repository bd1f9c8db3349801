"""A real Redis Sentinel deployment for tests (no tests here): a primary, replicas and a quorum of
sentinels, each a ``redis-server`` process (``--sentinel`` for the sentinels). On loopback by
default; ``hosts`` places each node on an address and runs it under a command prefix, and
``observer`` is the prefix the state queries (``redis-cli``) run under (the netns fault test runs
each node under ``ip netns exec HOST`` and looks from the clients' host)."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from tests.support.redis_server import free_port

SERVICE = "kaiten"


@dataclass(slots=True)
class Node:
    name: str
    host: str
    port: int
    prefix: list[str] = field(default_factory=list)
    proc: subprocess.Popen | None = None


class SentinelCluster:
    """``SentinelCluster(replicas=2, sentinels=3).start()``; ``url`` is the redis+sentinel:// URL."""

    def __init__(self, replicas: int = 2, sentinels: int = 3, down_after_ms: int = 1000,
                 hosts: dict[str, tuple[str, list[str]]] | None = None, observer: list[str] | None = None):
        exe = shutil.which("redis-server")
        if exe is None:
            raise RuntimeError("redis-server is not installed (apt-get install redis-server)")
        self.exe = exe
        self.dir = Path(tempfile.mkdtemp(prefix="kaiten-sentinel-"))
        self.down_after_ms = down_after_ms
        self.observer = observer or []
        own_hosts = bool(hosts)
        hosts = hosts or {}

        def node(name: str) -> Node:
            host, prefix = hosts.get(name, ("127.0.0.1", []))
            port = (26379 if name.startswith("sentinel") else 6379) if own_hosts else free_port()
            return Node(name, host, port, list(prefix))
        self.redis = [node(f"redis-{i}") for i in range(1 + replicas)]
        self.sentinels = [node(f"sentinel-{i}") for i in range(sentinels)]
        self.quorum = sentinels // 2 + 1
        self.url = "redis+sentinel://" + ",".join(f"{s.host}:{s.port}" for s in self.sentinels) + f"/{SERVICE}/0"

    # ------------------------------------------------------------------ processes
    def _spawn(self, n: Node, args: list[str]) -> None:
        log = open(self.dir / f"{n.name}.log", "ab")
        n.proc = subprocess.Popen(n.prefix + [self.exe] + args, stdout=log, stderr=subprocess.STDOUT,
                                  start_new_session=True)

    def _start_redis(self, n: Node, primary: Node | None) -> None:
        args = ["--port", str(n.port), "--bind", n.host, "--save", "", "--appendonly", "no",
                "--dir", str(self.dir), "--dbfilename", f"{n.name}.rdb", "--protected-mode", "no",
                "--repl-diskless-sync", "yes", "--repl-diskless-sync-delay", "0",
                "--replica-announce-ip", n.host]
        if primary is not None:
            args += ["--replicaof", primary.host, str(primary.port)]
        self._spawn(n, args)

    def _start_sentinel(self, n: Node, primary: Node) -> None:
        conf = self.dir / f"{n.name}.conf"
        conf.write_text(
            f"port {n.port}\nbind {n.host}\nprotected-mode no\ndir {self.dir}\nsentinel announce-ip {n.host}\n"
            f"sentinel monitor {SERVICE} {primary.host} {primary.port} {self.quorum}\n"
            f"sentinel down-after-milliseconds {SERVICE} {self.down_after_ms}\n"
            f"sentinel failover-timeout {SERVICE} 10000\nsentinel parallel-syncs {SERVICE} 2\n")
        self._spawn(n, [str(conf), "--sentinel"])

    def start(self, timeout: float = 30.0) -> "SentinelCluster":
        primary = self.redis[0]
        self._start_redis(primary, None)
        for n in self.redis[1:]:
            self._start_redis(n, primary)
        for n in self.sentinels:
            self._start_sentinel(n, primary)
        self.wait_ready(timeout)
        return self

    def cli(self, n: Node, *args: str) -> list[str]:
        """A redis-cli command against node n (from the observer); its output lines, [] if it failed."""
        out = subprocess.run(self.observer + ["redis-cli", "-h", n.host, "-p", str(n.port), "--no-raw", *args],
                             capture_output=True, text=True, timeout=10)
        if out.returncode != 0 or "ERR" in out.stdout or "Could not connect" in out.stdout + out.stderr:
            return []
        return [line.split(") ", 1)[-1].strip().strip('"') for line in out.stdout.splitlines()]

    def info(self, n: Node, section: str) -> dict[str, str]:
        out = subprocess.run(self.observer + ["redis-cli", "-h", n.host, "-p", str(n.port), "info", section],
                             capture_output=True, text=True, timeout=10)
        return dict(line.strip().split(":", 1) for line in out.stdout.splitlines() if ":" in line)

    def wait_ready(self, timeout: float) -> None:
        """Replicas in sync and every sentinel sees the primary, its replicas and the other sentinels."""
        deadline = time.monotonic() + timeout
        want_replicas, want_sentinels = len(self.redis) - 1, len(self.sentinels) - 1
        while True:
            synced = sum("state=online" in v for k, v in self.info(self.redis[0], "replication").items()
                         if k.startswith("slave"))
            seen = [self.info(s, "sentinel").get("master0", "") for s in self.sentinels]
            if synced == want_replicas and all(f"slaves={want_replicas},sentinels={want_sentinels + 1}" in m
                                               for m in seen):
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"the sentinel deployment did not come up in {timeout} s: {self.logs()}")
            time.sleep(0.1)

    # ------------------------------------------------------------------ state and faults
    def primary_address(self) -> tuple[str, int] | None:
        """The primary as the first sentinel that answers sees it."""
        for s in self.sentinels:
            out = self.cli(s, "sentinel", "get-master-addr-by-name", SERVICE)
            if len(out) == 2:
                return out[0], int(out[1])
        return None

    def node_at(self, addr: tuple[str, int]) -> Node:
        return next(n for n in self.redis if (n.host, n.port) == addr)

    def primary(self) -> Node:
        return self.node_at(self.primary_address())

    def kill(self, n: Node, sig: int = signal.SIGKILL) -> None:
        if n.proc is not None and n.proc.poll() is None:
            os.killpg(n.proc.pid, sig)
            n.proc.wait(10)

    def wait_promoted(self, old: Node, timeout: float = 30.0) -> Node:
        """Wait until the sentinels name a primary other than `old` and it answers as a master."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            addr = self.primary_address()
            if addr and addr != (old.host, old.port):
                n = self.node_at(addr)
                if self.info(n, "replication").get("role") == "master":
                    return n
            time.sleep(0.05)
        raise RuntimeError(f"no replica was promoted within {timeout} s: {self.logs()}")

    def logs(self, tail: int = 1500) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-tail:]}" for p in sorted(self.dir.glob("*.log")))

    def stop(self) -> None:
        for n in self.sentinels + self.redis:
            if n.proc is not None and n.proc.poll() is None:
                os.killpg(n.proc.pid, signal.SIGKILL)
                n.proc.wait(10)
        shutil.rmtree(self.dir, ignore_errors=True)
