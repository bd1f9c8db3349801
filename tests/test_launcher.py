"""`kaiten up` (shared/launcher.py): child supervision, local Redis, and the whole stack end to end."""
from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from shared.launcher import Child, Supervisor, free_port, port_is_free, start_local_redis

pytestmark = pytest.mark.timeout(180)
ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable


def sleeper(name: str, seconds: float = 60) -> Child:
    return Child(name, [PY, "-c", f"import time; time.sleep({seconds})"])


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    # A zombie still answers kill(0); look at its state.
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"
    except OSError:
        return True


def test_supervisor_stops_all_in_reverse_order():
    sup = Supervisor(stop_timeout=5)
    kids = [sup.add(sleeper(n)) for n in ("a", "b", "c")]
    assert sup.check() is None
    sup.stopping.set()
    assert sup.wait() == 0
    assert all(not k.alive() for k in kids)
    assert all(k.poll() == -signal.SIGTERM for k in kids)


def test_supervisor_child_death_stops_the_rest_and_fails():
    sup = Supervisor(stop_timeout=5)
    a = sup.add(sleeper("a"))
    b = sup.add(Child("b", [PY, "-c", "import sys, time; time.sleep(0.3); sys.exit(3)"]))
    t0 = time.monotonic()
    assert sup.wait() == 1
    assert time.monotonic() - t0 < 10
    assert sup.failed is b and b.poll() == 3
    assert not a.alive()


def test_supervisor_kills_a_child_that_ignores_sigterm():
    sup = Supervisor(stop_timeout=0.5)
    stubborn = sup.add(Child("stubborn", [PY, "-c", "import signal, time\n"
                                          "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
                                          "print('ready', flush=True)\ntime.sleep(60)"]))
    time.sleep(0.5)
    sup.stop_all()
    assert stubborn.poll() == -signal.SIGKILL


def test_local_redis_starts_and_stops():
    import redis
    child, url = start_local_redis()
    try:
        r = redis.Redis.from_url(url)
        assert r.ping()
        assert r.config_get("save")["save"] == "" and r.config_get("appendonly")["appendonly"] == "no"
    finally:
        Supervisor(children=[child]).stop_all()
    assert not child.alive()


def test_port_helpers():
    p = free_port()
    assert port_is_free("127.0.0.1", p)
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", p))
        s.listen()
        assert not port_is_free("127.0.0.1", p)


def _run_up(args, **kw):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(x for x in (str(ROOT), os.environ.get("PYTHONPATH")) if x))
    env.pop("REDIS_URL", None)
    return subprocess.Popen([PY, "-m", "shared.cli", "up", *args], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, **kw)


def _pids(output: str) -> dict[str, int]:
    pids = {}
    for line in output.splitlines():
        if " started " in line and "(pid " in line:
            name = line.split(" started ")[1].split(" (pid ")[0]
            pids[name] = int(line.split("(pid ")[1].split(")")[0])
    return pids


def test_up_fails_cleanly_when_a_child_dies(tmp_path):
    """A broken model directory: a child dies, every other child is stopped, exit code non-zero."""
    bad = tmp_path / "not-a-model"
    bad.mkdir()
    proc = _run_up(["--model", str(bad), "--port", str(free_port()), "--stop-timeout", "5"])
    out, _ = proc.communicate(timeout=150)
    text = out.decode(errors="replace")
    assert proc.returncode != 0, text
    pids = _pids(text)
    assert "redis" in pids and "engine" in pids, text
    for name, pid in pids.items():
        assert gone(pid), f"{name} (pid {pid}) outlived kaiten up\n{text}"


def test_up_rejects_a_busy_port():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        proc = _run_up(["--port", str(port), "--model", "/nonexistent"])
        out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 2 and b"in use" in out


@pytest.mark.skipif(importlib.util.find_spec("gateway.app") is None,
                    reason="gateway.app not in this checkout yet")
def test_up_serves_and_stops_on_sigint(tiny_model_dir):
    port = free_port()
    proc = _run_up(["--model", str(tiny_model_dir), "--port", str(port), "--stop-timeout", "10"])
    lines = []
    try:
        deadline = time.monotonic() + 150
        while time.monotonic() < deadline:
            line = proc.stdout.readline().decode(errors="replace")
            if not line and proc.poll() is not None:
                break
            lines.append(line)
            if "Kaiten is up" in line:
                break
        text = "".join(lines)
        assert "Kaiten is up" in text, text
        # The banner's curl line works (as a plain HTTP request).
        body = json.dumps({"model": tiny_model_dir.name, "messages": [{"role": "user", "content": "Hi"}],
                           "max_tokens": 4}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        for _ in range(6):
            with urllib.request.urlopen(req, timeout=60) as resp:
                data = json.loads(resp.read())
            assert data["choices"][0]["finish_reason"] in ("stop", "length")
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
        tail = out.decode(errors="replace")
        text += tail
        # At the default log level: at most one line per request (the access log), none per token.
        served = tail.split("Ctrl-C stops it.")[-1].split("SIGINT: stopping")[0]
        lines = [ln for ln in served.splitlines() if ln.strip()]
        assert len(lines) <= 6 + 1, served
        assert proc.returncode == 0, text
        pids = _pids(text)
        assert set(pids) == {"redis", "engine", "gateway"}, text       # no tokenizer service: in-process
        for name, pid in pids.items():
            assert gone(pid), f"{name} (pid {pid}) outlived kaiten up"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
