"""End-to-end checks of a running `docker compose --profile cpu up --scale gateway=3` (through nginx).

Run by scripts/compose-check.sh, with real clients only: which image each service runs (the
gateways' slim one has no torch), the openai SDK (chat streamed and not, a JSON-schema response,
completions), a WebSocket chat, 30 concurrent streams over the 3 gateways, a gateway killed
mid-run, `restart redis`, and finally `down -v`. Prints one line per check and a summary; exits 1
on any failure.

    python scripts/compose_check.py --base-url http://127.0.0.1:PORT --compose "docker compose" --project P
"""
from __future__ import annotations

import argparse
import collections
import concurrent.futures as cf
import json
import re
import shlex
import subprocess
import sys
import threading
import time
import uuid

import httpx
from openai import OpenAI

MESSAGES = [{"role": "user", "content": "Say hello in three words."}]


class Deployment:
    def __init__(self, base_url: str, compose: str, project: str):
        self.base_url, self.project = base_url, project
        self.compose = [*shlex.split(compose), "-p", project, "-f", "docker-compose.yml", "--project-directory", ".",
                        "--profile", "cpu"]
        self.client = OpenAI(base_url=f"{base_url}/v1", api_key="unused", timeout=120, max_retries=0)
        self.model = ""

    def run(self, *args: str, timeout: float = 120) -> str:
        out = subprocess.run(list(args), capture_output=True, text=True, timeout=timeout)
        if out.returncode != 0:
            raise RuntimeError(f"{' '.join(args)} exited {out.returncode}: {out.stderr.strip()[-500:]}")
        return out.stdout

    def dc(self, *args: str, timeout: float = 120) -> str:
        return self.run(*self.compose, *args, timeout=timeout)

    def containers(self, service: str) -> list[str]:
        return self.run("docker", "ps", "-q", "--filter", f"label=com.docker.compose.project={self.project}",
                        "--filter", f"label=com.docker.compose.service={service}").split()

    def inspect(self, ids: list[str]) -> list[dict]:
        return json.loads(self.run("docker", "inspect", *ids)) if ids else []

    def gateway_ips(self) -> dict[str, str]:
        """Gateway container IP -> container name."""
        return {net["IPAddress"]: c["Name"].lstrip("/") for c in self.inspect(self.containers("gateway"))
                for net in c["NetworkSettings"]["Networks"].values()}

    def upstreams(self, marker: str) -> list[str]:
        """The gateway address nginx sent each request tagged with ?check=marker to (its access log)."""
        logs = self.run("docker", "logs", *self.containers("nginx")[:1], timeout=60)
        # After a retry (proxy_next_upstream) $upstream_addr lists every try; the last one answered.
        return re.findall(rf"check={re.escape(marker)}\S* HTTP/1.1\" \d+ .*upstream=(?:\S+, )*([\d.]+):8000", logs)

    def chat(self, marker: str, max_tokens: int = 16, stream: bool = False) -> str:
        kw = dict(model=self.model, messages=MESSAGES, max_tokens=max_tokens, extra_query={"check": marker})
        if not stream:
            return self.client.chat.completions.create(**kw).choices[0].message.content
        return "".join(c.choices[0].delta.content or "" for c in self.client.chat.completions.create(stream=True, **kw)
                       if c.choices)


def wait_for(what: str, predicate, timeout: float, interval: float = 2.0):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        try:
            result = predicate()
            if result:
                return result
        except Exception as e:   # not up yet
            last = e
        time.sleep(interval)
    raise TimeoutError(f"{what} not within {timeout:.0f} s (last error: {last!r})")


# ---------------------------------------------------------------------- checks
def check_healthy(d: Deployment) -> str:
    def all_healthy():
        ids = [i for s in ("redis", "engine-cpu", "gateway", "nginx") for i in d.containers(s)]
        states = [c["State"].get("Health", {}).get("Status") for c in d.inspect(ids)]
        return len(d.containers("gateway")) == 3 and states and all(s == "healthy" for s in states)
    wait_for("every container healthy", all_healthy, timeout=600, interval=3)
    wait_for("/ready through nginx", lambda: httpx.get(f"{d.base_url}/ready", timeout=5).status_code == 200, 60)
    d.model = d.client.models.list().data[0].id
    return f"3 gateways, engine-cpu, redis, nginx healthy; model {d.model}"


def _has_module(d: Deployment, container: str, module: str) -> bool:
    code = f"import importlib.util; print(importlib.util.find_spec({module!r}) is not None)"
    return d.run("docker", "exec", container, "python", "-c", code).strip() == "True"


def check_images(d: Deployment) -> str:
    """The gateways (and model-init) run the slim image, without torch or xgrammar; the CPU engine
    runs the CPU image, with CPU torch and xgrammar but no triton."""
    gateway, engine = d.containers("gateway")[0], d.containers("engine-cpu")[0]
    images = {svc: {c["Config"]["Image"] for c in d.inspect(d.containers(svc))} for svc in ("gateway", "engine-cpu")}
    assert images == {"gateway": {"kaiten:latest"}, "engine-cpu": {"kaiten-cpu:latest"}}, images
    assert not any(_has_module(d, gateway, m) for m in ("torch", "xgrammar", "triton")), "torch in the gateway image"
    assert _has_module(d, engine, "xgrammar") and not _has_module(d, engine, "triton")
    torch_version = d.run("docker", "exec", engine, "python", "-c", "import torch; print(torch.__version__)").strip()
    assert torch_version.endswith("+cpu"), torch_version
    return f"gateway: kaiten:latest (no torch, xgrammar, triton); engine-cpu: kaiten-cpu:latest (torch {torch_version}, no triton)"


def check_structured_output(d: Deployment) -> str:
    """A JSON-schema response (xgrammar compiles in the CPU engine, its CPU bitmask kernel applies it)."""
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"],
              "additionalProperties": False}
    resp = d.client.chat.completions.create(
        model=d.model, messages=[{"role": "user", "content": "The capital of France, as JSON."}], max_tokens=40,
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": schema}})
    obj = json.loads(resp.choices[0].message.content)
    assert set(obj) == {"city"} and isinstance(obj["city"], str), obj
    return f"json_schema: {resp.choices[0].message.content}"


def check_openai_chat(d: Deployment) -> str:
    plain = d.chat("chat", stream=False)
    streamed = d.chat("chat-stream", stream=True)
    assert plain.strip() and streamed.strip(), (plain, streamed)
    return f"non-streamed {plain[:30]!r}, streamed {streamed[:30]!r}"


def check_completions(d: Deployment) -> str:
    resp = d.client.completions.create(model=d.model, prompt="The capital of France is", max_tokens=8)
    assert resp.choices[0].text and resp.usage.completion_tokens > 0, resp
    return f"{resp.choices[0].text!r} ({resp.usage.completion_tokens} tokens)"


def check_websocket(d: Deployment) -> str:
    from websockets.sync.client import connect
    url = d.base_url.replace("http://", "ws://") + "/v1/chat/ws"
    with connect(url, open_timeout=10) as ws:
        ws.send(json.dumps({"type": "chat", "id": "c1", "messages": MESSAGES, "max_tokens": 16}))
        kinds, text = [], ""
        while not kinds or kinds[-1] not in ("done", "error"):
            msg = json.loads(ws.recv(timeout=60))
            kinds.append(msg["type"])
            text += msg.get("content", "")
    assert kinds[0] == "start" and kinds[-1] == "done" and text.strip(), (kinds, msg)
    return f"start, {kinds.count('delta')} deltas, done: {text[:30]!r}"


def check_spread(d: Deployment) -> str:
    ids = collections.Counter(httpx.get(f"{d.base_url}/health", timeout=10).json()["gateway_id"] for _ in range(30))
    marker = f"burst-{uuid.uuid4().hex[:8]}"
    with cf.ThreadPoolExecutor(30) as pool:
        texts = list(pool.map(lambda i: d.chat(f"{marker}-{i}", max_tokens=24, stream=True), range(30)))
    assert all(t.strip() for t in texts), texts
    names = d.gateway_ips()
    served = collections.Counter(names.get(ip, ip) for ip in d.upstreams(marker))
    assert sum(served.values()) == 30 and len(served) == 3, served
    assert len(ids) == 3, ids
    return f"30/30 streams; per gateway {sorted(served.values())}; /health gateway ids {sorted(ids.values())}"


def _in_flight(d: Deployment, container: str) -> int:
    """Requests the gateway in this container is streaming now (its /v1/status, asked from inside)."""
    code = "import json, urllib.request; print(json.load(urllib.request.urlopen('http://127.0.0.1:8000/v1/status'))['in_flight'])"
    return int(d.run("docker", "exec", container, "python", "-c", code).strip())


def check_kill_gateway(d: Deployment) -> str:
    run = uuid.uuid4().hex[:8]
    started = [threading.Event() for _ in range(12)]

    def stream(i: int) -> int:
        chunks = d.client.chat.completions.create(
            model=d.model, messages=MESSAGES, max_tokens=100, stream=True, extra_body={"ignore_eos": True},
            extra_query={"check": f"inflight-{run}-{i}."})
        n = 0
        for _ in chunks:
            started[i].set()
            n += 1
        return n

    with cf.ThreadPoolExecutor(12) as pool:
        inflight = [pool.submit(stream, i) for i in range(12)]
        assert all(e.wait(120) for e in started), "the 12 streams did not all start"
        victim = next(c for c in d.containers("gateway") if _in_flight(d, c) > 0)
        victim_ips = {n["IPAddress"] for n in d.inspect([victim])[0]["NetworkSettings"]["Networks"].values()}
        d.run("docker", "kill", victim)
        failed = {i for i, f in enumerate(inflight) if f.exception(timeout=300) is not None}
    # The killed gateway's streams break; every other one finishes.
    on_victim = {i for i in range(12) if set(d.upstreams(f"inflight-{run}-{i}.")) & victim_ips}
    assert on_victim and failed == on_victim, (sorted(failed), sorted(on_victim))
    marker = f"after-kill-{run}"
    texts = [d.chat(f"{marker}-{i}") for i in range(9)]
    assert all(t.strip() for t in texts)
    served = set(d.upstreams(marker))
    assert len(served) == 2 and not served & victim_ips, (served, victim_ips)
    return (f"killed the gateway serving {len(on_victim)} of 12 streams mid-generation: those {len(failed)} cut, "
            f"the other {12 - len(failed)} finished; 9/9 new requests served by the other 2")


def _started(d: Deployment, services: tuple[str, ...]) -> dict[str, tuple]:
    ids = [i for s in services for i in d.containers(s)]
    return {c["Name"]: (c["State"]["StartedAt"], c["RestartCount"]) for c in d.inspect(ids)}


def check_restart_redis(d: Deployment) -> str:
    others = ("engine-cpu", "gateway", "nginx")
    before = _started(d, others)
    t0 = time.monotonic()
    d.dc("restart", "redis", timeout=120)
    wait_for("a chat after the Redis restart", lambda: d.chat("after-redis").strip(), timeout=120)
    recovered = time.monotonic() - t0
    texts = [d.chat(f"after-redis-{i}", stream=bool(i % 2)) for i in range(6)]
    assert all(t.strip() for t in texts)
    assert _started(d, others) == before, "a service restarted with Redis"
    return f"serving again {recovered:.1f} s after `restart redis`; no other container restarted"


def check_down(d: Deployment) -> str:
    d.dc("down", "-v", "--timeout", "10", timeout=180)
    label = f"label=com.docker.compose.project={d.project}"
    left = {kind: d.run("docker", kind, "ls", "-q", *(["-a"] if kind == "container" else []), "--filter", label).split()
            for kind in ("container", "volume", "network")}
    assert not any(left.values()), left
    return "no container, volume or network of the project left"


CHECKS = [check_healthy, check_images, check_openai_chat, check_structured_output, check_completions, check_websocket, check_spread,
          check_kill_gateway, check_restart_redis, check_down]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base-url", required=True)
    ap.add_argument("--compose", required=True, help='"docker compose" or "docker-compose"')
    ap.add_argument("--project", required=True)
    args = ap.parse_args()
    d = Deployment(args.base_url, args.compose, args.project)
    results = []
    for check in CHECKS:
        name = check.__name__.removeprefix("check_")
        if results and not results[0][1] and name != "down":
            results.append((name, False, "skipped: the deployment never became healthy", 0.0))
            continue
        t0 = time.monotonic()
        try:
            ok, detail = True, check(d)
        except Exception as e:
            ok, detail = False, f"{type(e).__name__}: {e}"
        results.append((name, ok, detail, time.monotonic() - t0))
        print(f"{'PASS' if ok else 'FAIL'} {name:<14} {time.monotonic() - t0:6.1f}s  {detail}", flush=True)
    failed = [r[0] for r in results if not r[1]]
    print(f"summary: {len(results) - len(failed)}/{len(results)} checks passed" +
          (f"; failed: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
