"""Clients and probes for the netns fault scenarios, run on the clients' host
(``ip netns exec HOST python -m tests.support.fault_clients CMD JSON``); prints one JSON result.

- ``streams {"streams": [[gateway_url, prompt_ids], ...], "max_tokens": N, "ready_file": F, "ready_tokens": K}``:
  one greedy SSE stream each, concurrently; touches ``ready_file`` once every stream has K
  tokens. Per stream: text, tokens, finish, errors, and the wall time of every chunk.
- ``probe {"url": U, "limit": S}``: time until a new request gets its whole answer.
- ``redis {"url": REDIS_URL, "engines": [...]}``: each engine's heartbeat counters (or null).
"""
from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path


async def one_stream(client, url: str, prompt: list[int], max_tokens: int, progress: list[int], i: int) -> dict:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    res = {"url": url, "text": "", "tokens": 0, "finish": None, "errors": [], "times": [], "done": False}
    try:
        async with client.stream("POST", url + "/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                res["errors"].append({"status": resp.status_code, "body": (await resp.aread()).decode()[:300]})
                return res
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    res["done"] = True
                    continue
                ev = json.loads(data)
                if "error" in ev:
                    res["errors"].append(ev["error"])
                    continue
                if ev.get("usage"):
                    res["tokens"] = ev["usage"]["completion_tokens"]
                for c in ev.get("choices", []):
                    if c["text"]:
                        res["text"] += c["text"]
                        res["times"].append(time.time())
                        progress[i] += 1
                    res["finish"] = c["finish_reason"] or res["finish"]
    except Exception as e:      # the connection itself: recorded as the stream's error
        res["errors"].append({"exception": f"{type(e).__name__}: {e}"})
    return res


async def streams(spec: dict) -> list[dict]:
    import httpx
    progress = [0] * len(spec["streams"])
    ready = Path(spec["ready_file"]) if spec.get("ready_file") else None

    async def watch():
        while ready is not None and min(progress) < spec.get("ready_tokens", 10):
            await asyncio.sleep(0.01)
        if ready is not None:
            ready.write_text(str(time.time()))
    async with httpx.AsyncClient(trust_env=False, timeout=httpx.Timeout(120, connect=10),
                                 limits=httpx.Limits(max_connections=64)) as c:
        w = asyncio.create_task(watch())
        out = await asyncio.gather(*(one_stream(c, u, p, spec["max_tokens"], progress, i)
                                     for i, (u, p) in enumerate(spec["streams"])))
        w.cancel()
    return out


def probe(spec: dict) -> dict:
    import httpx
    t0 = time.time()
    with httpx.Client(trust_env=False, timeout=5) as c:
        while time.time() - t0 < spec.get("limit", 30):
            try:
                r = c.post(spec["url"] + "/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 4, "temperature": 0})
                if r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4:
                    return {"answered_at": time.time()}
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
    return {"answered_at": None}


def redis_state(spec: dict) -> dict:
    import msgpack

    from shared import names
    from shared.redis_conn import redis_client
    r = redis_client(spec["url"], retries=3)
    out = {}
    for e in spec["engines"]:
        raw = r.get(names.heartbeat_key(e))
        hb = msgpack.unpackb(raw, raw=False) if raw else None
        out[e] = {**hb.get("counters", {}), "num_running": hb.get("num_running", 0)} if hb else None
    return out


def main() -> int:
    cmd, spec = sys.argv[1], json.loads(sys.argv[2])
    result = {"streams": lambda: asyncio.run(streams(spec)), "probe": lambda: probe(spec),
              "redis": lambda: redis_state(spec)}[cmd]()
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
