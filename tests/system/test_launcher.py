"""`kaiten serve` / `kaiten up` (shared/launcher.py): child supervision, local Redis, and the whole stack end to end."""
from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from shared.launcher import Child, Supervisor, free_port, port_is_free, start_local_redis
from tests.support.paths import ROOT

pytestmark = pytest.mark.timeout(180)
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


def test_engine_metrics_port_never_clashes(monkeypatch):
    """`kaiten up` gives its engine KAITEN_METRICS_PORT where set (0: none), else 8002 unless that is
    taken or the gateway's port, else a free port."""
    import socket

    from shared.launcher import engine_metrics_port
    monkeypatch.setenv("KAITEN_METRICS_PORT", "0")
    assert engine_metrics_port(8000) == 0
    monkeypatch.setenv("KAITEN_METRICS_PORT", "9321")
    assert engine_metrics_port(8000) == 9321
    monkeypatch.delenv("KAITEN_METRICS_PORT")
    p = engine_metrics_port(8002)
    assert p not in (0, 8002) and port_is_free("127.0.0.1", p)
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", 8002))
            s.listen()
        except OSError:
            pass                            # taken already: as good
        p = engine_metrics_port(8000)
        assert p not in (0, 8002) and port_is_free("127.0.0.1", p)


def _run_up(args, command: str = "up", **kw):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(x for x in (str(ROOT), os.environ.get("PYTHONPATH")) if x))
    env.pop("REDIS_URL", None)
    return subprocess.Popen([PY, "-m", "shared.cli", command, *args], cwd=ROOT, env=env,
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
    (bad / "config.json").write_text("{}")
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
def test_serve_serves_and_stops_on_sigint(tiny_model_dir):
    port = free_port()
    proc = _run_up([str(tiny_model_dir), "--port", str(port), "--stop-timeout", "10"], command="serve")
    try:
        text = _wait_banner(proc)
        assert "Kaiten is up" in text, text
        assert "loading weights from" in text and "done, " in text, text       # start-up progress lines
        for stage in ("model conversion took", "engine: kernel build took", "engine: weights took",
                      "engine: KV cache took", "start-up: ready in"):                     # the stages, timed
            assert stage in text, text
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


def _wait_banner(proc) -> str:
    lines = []
    deadline = time.monotonic() + 150
    while time.monotonic() < deadline:
        line = proc.stdout.readline().decode(errors="replace")
        if not line and proc.poll() is not None:
            break
        lines.append(line)
        if "Ctrl-C stops it." in line:
            break
    return "".join(lines)


def _get(url: str, key: str | None = None) -> tuple[int, dict]:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"} if key else {})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_up_passes_its_flags_to_the_children(tiny_model_dir, redis_url):
    """vllm-serve-style flags reach the engine (its heartbeat) and the gateway (the API); the
    key is not on any command line; --log-level WARNING silences every child's INFO lines."""
    import msgpack
    import redis as redis_lib

    from shared import names
    port = free_port()
    proc = _run_up(["--model", str(tiny_model_dir), "--port", str(port), "--redis-url", redis_url,
                    "--api-key", "sesame", "--served-model-name", "tiny-served", "--max-model-len", "200",
                    "--max-num-seqs", "3", "--max-num-batched-tokens", "64", "--kv-cache-memory", "8MiB",
                    "--dtype", "float32", "--enforce-eager", "--log-level", "WARNING"])
    try:
        text = _wait_banner(proc)
        assert "Kaiten is up" in text and "Bearer <your --api-key>" in text and '"model": "tiny-served"' in text, text
        base = f"http://127.0.0.1:{port}"
        assert _get(f"{base}/v1/models")[0] == 401
        status, body = _get(f"{base}/v1/models", "sesame")
        assert status == 200 and body["data"][0]["id"] == "tiny-served" and body["data"][0]["max_model_len"] == 200
        r = redis_lib.Redis.from_url(redis_url)
        (key,) = list(r.scan_iter(match=names.HEARTBEAT_PATTERN))
        hb = msgpack.unpackb(r.get(key), raw=False)
        assert (hb["max_num_seqs"], hb["dtype"], hb["max_model_len"]) == (3, "float32", 200)
        cfg = json.loads((tiny_model_dir / "config.json").read_text())
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
        block_bytes = 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * head_dim * 16 * 4   # fp32 K and V
        assert 0 < hb["num_blocks"] <= 8 * 2**20 // block_bytes         # the pool --kv-cache-memory allows
        cmdlines = [Path(f"/proc/{p}/cmdline").read_bytes() for p in _child_pids(proc.pid)]
        assert cmdlines and not any(b"sesame" in c for c in cmdlines)
        assert any(b"--max-num-batched-tokens\x0064" in c for c in cmdlines)
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
        text += out.decode(errors="replace")
        assert " INFO " not in text, text
        assert proc.returncode == 0, text
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _child_pids(pid: int) -> list[int]:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out


def test_serve_help_names_the_variable_of_every_flag():
    from shared.launcher import build_parser
    parser = build_parser()
    for action in parser._actions:
        if action.dest in ("help", "version"):
            continue
        assert "(env KAITEN_" in action.help or "(env REDIS_URL)" in action.help, (action.option_strings, action.help)
    out = subprocess.run([PY, "-m", "shared.cli", "up", "--help"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.startswith("usage: kaiten up ") and "HF_HUB_CACHE" in out.stdout


def test_serve_takes_the_models_as_argument_flags_or_file(monkeypatch, capsys, tmp_path):
    from shared.launcher import build_parser, model_entries
    parser = build_parser()
    monkeypatch.setenv("KAITEN_MODEL", "from/env")

    def models(*argv):
        cli, from_file = model_entries(parser.parse_args(list(argv)), parser)
        return [(e.model, e.served_model_name, e.engines) for e in cli + from_file]
    assert models("org/a") == [("org/a", "", 1)]
    assert models("--model", "org/a", "--port", "1") == [("org/a", "", 1)]
    assert models("--port", "1", "org/a", "--model", "org/a") == [("org/a", "", 1)]
    assert models() == [("from/env", "", 1)]
    assert models("org/a", "--model", "org/b", "--served-model-name", "x", "--engines-per-model", "2") == [
        ("org/a", "x", 2), ("org/b", "", 2)]
    spec = tmp_path / "models.json"
    spec.write_text(json.dumps({"models": [{"model": "org/c", "served_model_name": "c", "engines": 3}]}))
    assert models("--models-file", str(spec)) == [("org/c", "c", 3)]
    assert models("org/a", "--models-file", str(spec)) == [("org/a", "", 1), ("org/c", "c", 3)]
    with pytest.raises(SystemExit) as e:        # it would name no model: refused, not ignored
        models("--models-file", str(spec), "--served-model-name", "x")
    assert e.value.code == 2 and "names the first --model" in capsys.readouterr().err
    spec.write_text("[]")
    with pytest.raises(SystemExit) as e:
        models("--models-file", str(spec))
    assert e.value.code == 2 and "at least one model" in capsys.readouterr().err


def test_serve_gives_each_model_its_engines_flags(tmp_path):
    """Per model: its served name and adapters (the models file's), serve's engine flags (its adapter
    flags only for the first model: adapters fit one base model), then the file's engine_args."""
    from shared.launcher import build_parser, engine_args, model_entries
    parser = build_parser()
    spec = tmp_path / "models.json"
    spec.write_text(json.dumps({"models": [{"model": "org/b", "served_model_name": "b", "lora_modules": {"x": "/x"},
                                            "engine_args": ["--max-num-seqs", "9"]}]}))
    args = parser.parse_args(["org/a", "--models-file", str(spec), "--max-num-seqs", "3",
                              "--served-model-name", "a"])
    cli, from_file = model_entries(args, parser)
    first = engine_args(args, cli[0], "/m/a", "redis://r", 8002, True)
    assert first == ["engine", "--model", "/m/a", "--redis-url", "redis://r", "--metrics-port", "8002",
                     "--served-model-name", "a", "--max-num-seqs", "3"]
    second = engine_args(args, from_file[0], "/m/b", "redis://r", 0, False)
    assert second == ["engine", "--model", "/m/b", "--redis-url", "redis://r", "--metrics-port", "0",
                      "--served-model-name", "b", "--lora-modules", "x=/x", "--max-num-seqs", "3",
                      "--max-num-seqs", "9"]


def test_serve_two_models_behind_one_gateway(tiny_model_dir, tmp_path):
    """`kaiten serve --model A --model B`: an engine for each, one gateway; each model answers."""
    from tests.support.tiny_model import build_tiny_model
    other = build_tiny_model(tmp_path / "tiny-qwen", arch="qwen2", seed=3, vocab_size=320, max_position_embeddings=256)
    port = free_port()
    proc = _run_up(["--model", str(tiny_model_dir), "--model", str(other), "--port", str(port),
                    "--served-model-name", "first", "--stop-timeout", "10"], command="serve")
    try:
        text = _wait_banner(proc)
        assert "Kaiten is up" in text and f"Models: first, {other.name}" in text, text
        base = f"http://127.0.0.1:{port}"
        for _ in range(300):            # /ready needs one engine; wait for both (each compiles: 60 s)
            cards = {c["id"]: c for c in _get(f"{base}/v1/models")[1]["data"]}
            if all(c["engines"] == 1 for c in cards.values()):
                break
            time.sleep(0.2)
        assert {k: (c["engines"], c["max_model_len"]) for k, c in cards.items()} == {
            "first": (1, 512), other.name: (1, 256)}
        for model in ("first", other.name):
            body = json.dumps({"model": model, "prompt": "Hi", "max_tokens": 3}).encode()
            req = urllib.request.Request(f"{base}/v1/completions", data=body,
                                         headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=60) as resp:
                assert json.loads(resp.read())["model"] == model
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
        text += out.decode(errors="replace")
        assert proc.returncode == 0, text
        assert {"engine 0.0", "engine 1.0", "gateway", "redis"} <= set(_pids(text)), text
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_kaiten_version():
    for args in (["--version"], ["up", "--version"], ["serve", "--version"]):
        out = subprocess.run([PY, "-m", "shared.cli", *args], cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0 and out.stdout.startswith("kaiten ") and out.stdout.split()[1][0].isdigit()


def test_progress_logs_each_tenth_at_most_once_a_second(caplog):
    import logging

    from shared.progress import Progress
    caplog.set_level(logging.INFO)
    p = Progress(logging.getLogger("kaiten.test"), "converting", 100, min_interval=0.0, stream=None)
    for _ in range(100):
        p.advance()
    p.finish()
    msgs = [r.getMessage() for r in caplog.records]
    assert msgs[0] == "converting: 0/100" and msgs[-1].startswith("converting: done, 100/100 in ")
    assert [m for m in msgs[1:-1]] == [f"converting: {n}/100 ({n}%)" for n in range(10, 100, 10)]


def test_progress_draws_a_bar_on_a_terminal(caplog):
    import io
    import logging

    from shared.progress import BAR_WIDTH, Progress
    caplog.set_level(logging.INFO)
    term = io.StringIO()
    p = Progress(logging.getLogger("kaiten.test"), "loading", 40, bar_interval=0.0, stream=term)
    for _ in range(40):
        p.advance()
    p.finish()
    frames = term.getvalue().split("\r")[1:]
    assert len(frames) == 41 and term.getvalue().endswith("\n")          # a redraw per step, then the end
    assert frames[19] == f"loading [{'#' * (BAR_WIDTH // 2)}{'.' * (BAR_WIDTH // 2)}]  50% 20/40"
    assert frames[-1].startswith(f"loading [{'#' * BAR_WIDTH}] 100% 40/40")
    msgs = [r.getMessage() for r in caplog.records]     # the bar replaces the tenths' log lines
    assert msgs[0] == "loading: 0/40" and msgs[1].startswith("loading: done, 40/40 in ") and len(msgs) == 2


def test_gateway_cli_takes_keys_origins_and_keepalive(monkeypatch):
    from gateway.cli import build_parser, config_from_args
    monkeypatch.delenv("KAITEN_API_KEYS", raising=False)
    args = build_parser().parse_args(["--api-key", "a", "--api-key", "b", "--allowed-origins",
                                      "https://x.example,https://y.example", "--sse-keepalive", "5"])
    cfg = config_from_args(args)
    assert cfg.api_keys == ("a", "b") and cfg.sse_keepalive == 5.0
    assert cfg.allowed_origins == ("https://x.example", "https://y.example")
    monkeypatch.setenv("KAITEN_API_KEYS", "k1,k2")
    assert config_from_args(build_parser().parse_args([])).api_keys == ("k1", "k2")


def test_no_gpu_driver_means_no_cuda_without_importing_torch(monkeypatch):
    """On a host without NVIDIA's or ROCm's driver the launcher decides "no CUDA" from the files
    alone; importing torch for it cost a second before the engine was launched."""
    import shared.launcher as launcher
    monkeypatch.setattr(launcher, "GPU_DRIVER_FILES", ("/nonexistent/nvidia",))
    monkeypatch.setitem(sys.modules, "torch", None)         # an import of torch would raise
    assert launcher._cuda_available() is False
