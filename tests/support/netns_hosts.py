"""Hosts as Linux network namespaces, for fault tests (no tests here). Each host is a namespace
with one veth (eth0, 10.77.0.N/24) whose peer sits on a bridge in a switch namespace, so nothing
touches the caller's network and only addresses inside these namespaces are used. Faults: a
host's link down (``partition``), DROP rules for some peers (``block``, iptables), and ``tc
netem`` delay/loss towards some peers (``impair``). ``Net.close()`` removes every namespace
(their veths and rules go with them) and kills what ran in them; it runs even on failure."""
from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass, field


def available() -> str | None:
    """None where namespaces can be made here, else why not."""
    if os.geteuid() != 0:
        return "needs root (ip netns)"
    for tool in ("ip", "tc", "iptables"):
        if shutil.which(tool) is None:
            return f"needs {tool} (iproute2, iptables)"
    probe = f"kt-probe-{os.getpid()}"
    if subprocess.run(["ip", "netns", "add", probe], capture_output=True).returncode != 0:
        return "ip netns add failed (no CAP_SYS_ADMIN?)"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def remove_stale() -> None:
    """Namespaces (and what runs in them) that a killed run of these tests left: kt<pid>-*,
    the pid gone."""
    for line in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.splitlines():
        ns = line.split()[0] if line.split() else ""
        pid = ns[2:].split("-", 1)[0] if ns.startswith("kt") else ""
        if pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
            for p in subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split():
                try:
                    os.kill(int(p), 9)
                except (ProcessLookupError, ValueError):
                    pass
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def sh(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    out = subprocess.run(list(args), capture_output=True, text=True, timeout=30)
    if check and out.returncode != 0:
        raise RuntimeError(f"{' '.join(args)}: {out.stderr.strip()}")
    return out


@dataclass(slots=True)
class Host:
    name: str          # namespace name
    ip: str
    peer: str          # the veth end on the switch
    procs: list[subprocess.Popen] = field(default_factory=list)

    def prefix(self) -> list[str]:
        return ["ip", "netns", "exec", self.name]

    def popen(self, args: list[str], **kw) -> subprocess.Popen:
        p = subprocess.Popen(self.prefix() + args, start_new_session=True, **kw)
        self.procs.append(p)
        return p

    def run(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        return sh(*self.prefix(), *args, check=check)


class Net:
    """``Net(["redis0", "eng0", ...])``: one host per name, on 10.77.0.2, .3, ... in that order."""

    def __init__(self, names: list[str], tag: str | None = None):
        self.tag = tag or f"kt{os.getpid()}"
        self.switch = f"{self.tag}-sw"
        self.hosts: dict[str, Host] = {}
        self._made: list[str] = []
        remove_stale()
        try:
            self._ns(self.switch)
            sh("ip", "-n", self.switch, "link", "add", "br0", "type", "bridge")
            sh("ip", "-n", self.switch, "link", "set", "br0", "up")
            for i, name in enumerate(names):
                self._add_host(name, f"10.77.0.{i + 2}", i)
        except BaseException:
            self.close()
            raise

    def _ns(self, name: str) -> None:
        sh("ip", "netns", "del", name, check=False)      # a leftover of a killed run
        sh("ip", "netns", "add", name)
        self._made.append(name)
        sh("ip", "-n", name, "link", "set", "lo", "up")

    def _add_host(self, name: str, ip: str, i: int) -> None:
        ns, peer = f"{self.tag}-{name}", f"v{i}"
        self._ns(ns)
        sh("ip", "link", "add", "eth0", "netns", ns, "type", "veth", "peer", "name", peer, "netns", self.switch)
        sh("ip", "-n", ns, "addr", "add", f"{ip}/24", "dev", "eth0")
        sh("ip", "-n", ns, "link", "set", "eth0", "up")
        sh("ip", "-n", self.switch, "link", "set", peer, "master", "br0")
        sh("ip", "-n", self.switch, "link", "set", peer, "up")
        self.hosts[name] = Host(ns, ip, peer)

    def __getitem__(self, name: str) -> Host:
        return self.hosts[name]

    # ------------------------------------------------------------------ faults
    def partition(self, name: str, down: bool = True) -> None:
        """Cut a host off the network (its switch port down), or heal it."""
        sh("ip", "-n", self.switch, "link", "set", self.hosts[name].peer, "down" if down else "up")

    def block(self, name: str, peers: list[str], on: bool = True) -> None:
        """DROP everything between host `name` and `peers` (both directions, at `name`)."""
        h, op = self.hosts[name], "-I" if on else "-D"
        for p in peers:
            ip = self.hosts[p].ip
            h.run("iptables", op, "INPUT", "-s", ip, "-j", "DROP")
            h.run("iptables", op, "OUTPUT", "-d", ip, "-j", "DROP")

    def impair(self, name: str, peers: list[str], delay_ms: int, loss_pct: float) -> dict:
        """Delay and loss on what `name` sends to `peers` (apply at both ends for both ways): tc
        netem where the kernel has it; else the loss alone, by an iptables statistic DROP rule.
        Returns what was applied."""
        h = self.hosts[name]
        netem = h.run("tc", "qdisc", "add", "dev", "eth0", "root", "handle", "1:", "prio", check=False).returncode == 0
        netem = netem and h.run("tc", "qdisc", "add", "dev", "eth0", "parent", "1:3", "handle", "30:", "netem",
                                "delay", f"{delay_ms}ms", "loss", f"{loss_pct}%", check=False).returncode == 0
        for p in peers:
            ip = self.hosts[p].ip
            if netem:
                h.run("tc", "filter", "add", "dev", "eth0", "parent", "1:0", "protocol", "ip", "prio", "1", "u32",
                      "match", "ip", "dst", f"{ip}/32", "flowid", "1:3")
            else:
                h.run("iptables", "-I", "OUTPUT", "-d", ip, "-m", "statistic", "--mode", "random",
                      "--probability", str(loss_pct / 100), "-j", "DROP")
        return {"delay_ms": delay_ms if netem else 0, "loss_pct": loss_pct, "by": "netem" if netem else "iptables"}

    # ------------------------------------------------------------------ cleanup
    def close(self) -> None:
        for h in self.hosts.values():
            for p in h.procs:
                if p.poll() is None:
                    try:
                        os.killpg(p.pid, 9)
                    except ProcessLookupError:
                        pass
                    p.wait(10)
        for ns in reversed(self._made):
            # Anything still in the namespace (a process that escaped its group) dies with it.
            pids = sh("ip", "netns", "pids", ns, check=False).stdout.split()
            for pid in pids:
                try:
                    os.kill(int(pid), 9)
                except (ProcessLookupError, ValueError):
                    pass
            sh("ip", "netns", "del", ns, check=False)
        self._made.clear()
