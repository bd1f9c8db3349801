"""`kaiten gateway` as a process, with the tokenizer service (`kaiten tokenizer`) over HTTP."""
from __future__ import annotations

import os
import signal
import subprocess
import sys

import httpx
import pytest

from tests.support.engine_support import wait_until
from tests.support.gateway_support import FakeEngine, default_tokens, post_stream
from tests.support.paths import ROOT
from tests.support.redis_server import RedisServer, free_port

pytestmark = pytest.mark.timeout(120)


def _env(**extra):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    env.update(extra)
    return env


def _up(url: str, proc: subprocess.Popen, timeout: float = 60) -> None:
    def ok():
        assert proc.poll() is None, proc.stdout.read().decode() if proc.stdout else proc.returncode
        try:
            return httpx.get(url, timeout=1, trust_env=False).status_code == 200
        except httpx.HTTPError:
            return False
    wait_until(ok, timeout, 0.2)


def test_gateway_process_with_remote_tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    server = RedisServer().start()
    tport, gport = free_port(), free_port()
    procs = []
    eng = FakeEngine(server.url, engine_id="fake-cli", model=tiny_model_dir.name).start()
    try:
        tproc = subprocess.Popen([sys.executable, "-m", "shared.cli", "tokenizer", "--host", "127.0.0.1", "--port",
                                  str(tport), "--model", str(tiny_model_dir)], cwd=ROOT, env=_env(),
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        procs.append(tproc)
        gproc = subprocess.Popen([sys.executable, "-m", "shared.cli", "gateway", "--host", "127.0.0.1", "--port",
                                  str(gport), "--model", str(tiny_model_dir), "--redis-url", server.url],
                                 cwd=ROOT, env=_env(TOKENIZER_URL=f"http://127.0.0.1:{tport}",
                                                    KAITEN_ENGINE_TIMEOUT="3"),
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        procs.append(gproc)
        _up(f"http://127.0.0.1:{tport}/health", tproc)
        base = f"http://127.0.0.1:{gport}"
        _up(base + "/ready", gproc)
        with httpx.Client(base_url=base, trust_env=False, timeout=30) as c:
            r = c.post("/v1/completions", json={"prompt": "Hello world", "max_tokens": 5})
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["text"] == tok.decode(default_tokens(5))
            status, events = post_stream(c, "/v1/chat/completions", {
                "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": True, "stop": ["zz"]})
            assert status == 200 and events[-1] == "[DONE]"
            text = "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-1] if e["choices"])
            assert text == tok.decode(default_tokens(4))
            r = c.post("/v1/chat/completions", json={"messages": [{"role": "wizard", "content": "hi"}]})
            assert r.status_code == 400
        gproc.send_signal(signal.SIGTERM)
        assert gproc.wait(20) == 0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        eng.stop()
        server.stop()


def test_cli_help():
    out = subprocess.run([sys.executable, "-m", "shared.cli", "gateway", "--help"], cwd=ROOT, env=_env(),
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "--redis-url" in out.stdout and "--model" in out.stdout


def test_cli_flags_and_help_come_from_the_config():
    """Every GatewayConfig field is a flag (extra_models: --model again) whose help gives the field's
    own variable and default: the help cannot drift from the config (it once said 2 for 1.5)."""
    import dataclasses

    from gateway.cli import build_parser
    from shared.config import GatewayConfig
    from shared.config_cli import env_name
    actions = {a.dest: a for a in build_parser()._actions}
    for f in dataclasses.fields(GatewayConfig):
        if f.name == "extra_models":
            continue
        helptext = actions[f.name].help
        assert f"(env {env_name(GatewayConfig, f.name)}," in helptext, (f.name, helptext)
        if not isinstance(f.default, tuple):
            assert helptext.endswith(f"default {f.default!r})"), (f.name, helptext)
    assert actions["failover_timeout"].help.endswith("(env KAITEN_FAILOVER_TIMEOUT, default 1.5)")
    assert actions["api_keys"].option_strings == ["--api-key"] and actions["model"].option_strings == ["--model"]
