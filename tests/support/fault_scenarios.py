"""Kaiten across hosts under real network faults (issue 21), shared by tests/cluster/test_faults_netns.py
and bench/serving/faults.py (no tests here). Hosts are network namespaces (tests/support/netns_hosts.py): r0..r2
each run a Redis (r0 the first primary) and a sentinel, e0 and e1 an engine (the tiny model or
any model, steps slowed so streams are long enough to cut), g0 and g1 a gateway, c the clients.

Each scenario runs 8 concurrent greedy streams (4 per gateway) and returns its outcome: streams
completed, client errors, streams whose text differs from the uninterrupted run (a repeated or
missing token shows there), the longest stall after the fault, and requests lost (submitted but
neither answered whole nor ended with an error)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from tests.support.netns_hosts import Net
from tests.support.paths import ROOT
from tests.support.sentinel_cluster import SentinelCluster

HOSTS = ["r0", "r1", "r2", "e0", "e1", "g0", "g1", "c"]
REDIS_HOSTS = ["r0", "r1", "r2"]
PROMPTS = [[1, 10 + i, 20 + 2 * i, 30 + (i * 7) % 50, 5] for i in range(8)]


@dataclass
class Settings:
    model_dir: str
    max_tokens: int = 200
    step_s: float = 0.02               # each engine step >= this: 200 tokens >= 4 s
    dtype: str = "float32"
    redis_grace: float = 10.0
    failover_timeout: float = 2.0


@dataclass
class Deployment:
    net: Net
    cluster: SentinelCluster
    cfg: Settings
    workdir: Path
    engines: dict[str, subprocess.Popen] = field(default_factory=dict)
    gateways: dict[str, str] = field(default_factory=dict)      # host -> URL

    # ------------------------------------------------------------------ start and stop
    @classmethod
    def start(cls, cfg: Settings) -> "Deployment":
        net = Net(HOSTS)
        cluster = None
        try:
            hosts = {f"redis-{i}": (net[h].ip, net[h].prefix()) for i, h in enumerate(REDIS_HOSTS)}
            hosts |= {f"sentinel-{i}": (net[h].ip, net[h].prefix()) for i, h in enumerate(REDIS_HOSTS)}
            cluster = SentinelCluster(replicas=2, sentinels=3, down_after_ms=1000, hosts=hosts,
                                      observer=net["c"].prefix()).start()
            d = cls(net, cluster, cfg, Path(tempfile.mkdtemp(prefix="kaiten-faults-")))
            for i, h in enumerate(("e0", "e1")):
                d.engines[h] = d._engine(h, f"eng-{i}")
            for h in ("g0", "g1"):
                d.gateways[h] = d._gateway(h)
            d.wait_ready()
            return d
        except BaseException:
            if cluster is not None:
                cluster.stop()
            net.close()
            raise

    def _env(self) -> dict:
        return dict(os.environ, PYTHONPATH=str(ROOT), NO_PROXY="*", no_proxy="*")

    def _engine(self, host: str, engine_id: str) -> subprocess.Popen:
        c = self.cfg
        return self.net[host].popen(
            [sys.executable, "-m", "tests.support.slow_engine", str(c.step_s), "-", "--model", c.model_dir,
             "--redis-url", self.cluster.url, "--engine-id", engine_id, "--dtype", c.dtype, "--kv-cache-memory", "64MiB",
             "--heartbeat-interval", "0.2", "--heartbeat-ttl", "1.0", "--claim-idle-ms", "300",
             "--janitor-interval", "0.2", "--idle-block-ms", "20", "--num-threads", "1", "--metrics-port", "0"],
            cwd=ROOT, env=self._env(), stdout=subprocess.DEVNULL, stderr=open(self.workdir / f"{host}.log", "wb"))

    def _gateway(self, host: str) -> str:
        c, ip = self.cfg, self.net[host].ip
        self.net[host].popen(
            [sys.executable, "-m", "gateway.cli", "--host", ip, "--port", "8000", "--model", c.model_dir,
             "--redis-url", self.cluster.url, "--engine-timeout", "8", "--failover-timeout", str(c.failover_timeout),
             "--redis-grace", str(c.redis_grace)],
            cwd=ROOT, env=self._env(), stdout=subprocess.DEVNULL, stderr=open(self.workdir / f"{host}.log", "wb"))
        return f"http://{ip}:8000"

    def client(self, cmd: str, spec: dict, timeout: float = 300) -> object:
        out = subprocess.run(self.net["c"].prefix() + [sys.executable, "-m", "tests.support.fault_clients", cmd, json.dumps(spec)],
                             cwd=ROOT, env=self._env(), capture_output=True, text=True, timeout=timeout)
        if out.returncode != 0:
            raise RuntimeError(f"fault_clients {cmd}: {out.stderr[-2000:]}")
        return json.loads(out.stdout)

    def client_bg(self, cmd: str, spec: dict) -> subprocess.Popen:
        return subprocess.Popen(self.net["c"].prefix() + [sys.executable, "-m", "tests.support.fault_clients", cmd, json.dumps(spec)],
                                cwd=ROOT, env=self._env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def wait_ready(self, timeout: float = 240.0) -> None:
        deadline = time.monotonic() + timeout
        for h, url in self.gateways.items():
            while True:
                dead = [e for e, p in self.engines.items() if p.poll() is not None]
                if dead:
                    raise RuntimeError(f"engine on {dead[0]} exited: {self.log(dead[0])}")
                ok = self.net["c"].run(sys.executable, "-c", f"import urllib.request as u; u.urlopen('{url}/ready', timeout=2)",
                                       check=False).returncode == 0
                if ok:
                    break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"gateway on {h} not ready: {self.log(h)}")
                time.sleep(0.5)

    def engine_counters(self) -> dict:
        return self.client("redis", {"url": self.cluster.url, "engines": ["eng-0", "eng-1"]}, timeout=30)

    def log(self, host: str) -> str:
        p = self.workdir / f"{host}.log"
        return p.read_text(errors="replace")[-3000:] if p.exists() else ""

    def stop(self) -> None:
        try:
            self.cluster.stop()
        finally:
            self.net.close()

    # ------------------------------------------------------------------ one round of streams
    def run_streams(self, fault=None, ready_tokens: int = 10, gateways=("g0", "g1")) -> dict:
        """8 streams over `gateways`; `fault()` runs once every stream has `ready_tokens` tokens and
        returns (fault time, extra facts). Returns the streams and the fault's facts."""
        ready = self.workdir / f"ready-{time.monotonic_ns()}"
        urls = [self.gateways[gateways[i % len(gateways)]] for i in range(len(PROMPTS))]
        spec = {"streams": [[u, p] for u, p in zip(urls, PROMPTS)], "max_tokens": self.cfg.max_tokens,
                "ready_file": str(ready), "ready_tokens": ready_tokens}
        t0 = time.time()
        proc = self.client_bg("streams", spec)
        facts, t_fault = {}, None
        if fault is not None:
            while not ready.exists() and proc.poll() is None:
                time.sleep(0.01)
            t_fault, facts = fault()
        out, err = proc.communicate(timeout=300)
        if proc.returncode != 0:
            raise RuntimeError(f"clients failed: {err[-2000:]}")
        return {"streams": json.loads(out), "t0": t0, "t_fault": t_fault, "wall": time.time() - t0, **facts}


# ---------------------------------------------------------------------- outcome of a round
def outcome(run: dict, reference: list[str], affected: set[int] = frozenset()) -> dict:
    """Streams completed, client errors, texts unequal to the reference, the longest pause after
    the fault, requests lost; `affected` streams are expected to end with an error."""
    s = run["streams"]
    complete = [i for i, r in enumerate(s) if r["done"] and not r["errors"] and r["finish"] == "length"]
    errors = [i for i, r in enumerate(s) if r["errors"]]
    unequal = [i for i in complete if s[i]["text"] != reference[i]]
    lost = [i for i, r in enumerate(s) if not (i in complete or r["errors"])]
    stall = 0.0
    if run["t_fault"] is not None:
        for i, r in enumerate(s):
            after = [t for t in r["times"] if t > run["t_fault"]]
            if after and i not in affected:
                stall = max(stall, max(b - a for a, b in zip([run["t_fault"]] + after, after)))
    tokens = sum(r["tokens"] for i, r in enumerate(s) if i in complete)
    return {"streams": len(s), "completed": len(complete), "errors": len(errors), "error_streams": errors,
            "error_codes": sorted({str(e.get("code") or e.get("exception") or e.get("status"))
                                   for r in s for e in r["errors"]}),
            "unequal": len(unequal), "lost": len(lost), "max_stall_s": round(stall, 2),
            "tokens": tokens, "throughput": round(tokens / run["wall"], 1) if run["wall"] else 0.0}


# ---------------------------------------------------------------------- the scenarios
def kill_primary(d: Deployment) -> dict:
    """1: SIGKILL the Redis primary mid-stream; time until a new request is answered."""
    facts: dict = {}

    def fault():
        old = d.cluster.primary()
        d.cluster.kill(old)
        t = time.time()
        probe = d.client_bg("probe", {"url": d.gateways["g1"], "limit": 30})
        new = d.cluster.wait_promoted(old)
        facts.update(killed=old.name, promoted=new.name, promoted_after_s=round(time.time() - t, 2))
        answered = json.loads(probe.communicate(timeout=60)[0])["answered_at"]
        facts["new_request_answered_after_s"] = round(answered - t, 2) if answered else None
        return t, facts
    return d.run_streams(fault)


def partition_engine(d: Deployment, seconds: float = 10.0) -> dict:
    """2: cut the engine running more of the streams off every Redis host for `seconds`
    mid-stream, then heal it."""
    def fault():
        running = {e: (c or {}).get("num_running", 0) for e, c in d.engine_counters().items()}
        victim = "e0" if running["eng-0"] >= running["eng-1"] else "e1"
        d.net.block(victim, REDIS_HOSTS)
        t = time.time()
        time.sleep(seconds)
        d.net.block(victim, REDIS_HOSTS, on=False)
        return t, {"partitioned_s": seconds, "victim": victim, "running_at_fault": running}
    run = d.run_streams(fault, ready_tokens=10)
    time.sleep(2.0)
    run["engines_after_heal"] = d.engine_counters()
    run["after_heal"] = d.run_streams()          # both engines serve again
    return run


def partition_gateway(d: Deployment) -> dict:
    """3: cut g0 off every Redis host mid-stream (its clients keep their link to it). Returns
    how many of g0's requests the engines stopped as orphans."""
    before = d.engine_counters()

    def fault():
        d.net.block("g0", REDIS_HOSTS)
        return time.time(), {}
    try:
        run = d.run_streams(fault)
        run["engines"] = d.engine_counters()
    finally:
        d.net.block("g0", REDIS_HOSTS, on=False)
    t = time.time()
    d.wait_ready(60)
    run["g0_ready_after_heal_s"] = round(time.time() - t, 2)
    run["orphans_stopped"] = sum(int((run["engines"][e] or {}).get("stopped_gateway_gone", 0))
                                 - int((before[e] or {}).get("stopped_gateway_gone", 0)) for e in before)
    return run


def impaired_gateways(d: Deployment, delay_ms: int = 50, loss_pct: float = 1.0) -> dict:
    """4: delay and loss between the gateways and Redis for a whole round, against the same round
    without them."""
    base = d.run_streams()
    applied = {}
    for g in ("g0", "g1"):
        applied = d.net.impair(g, REDIS_HOSTS, delay_ms, loss_pct)
    for r in REDIS_HOSTS:
        d.net.impair(r, ["g0", "g1"], delay_ms, loss_pct)
    run = d.run_streams()
    run["baseline"] = base
    run["impairment"] = applied
    return run
