"""Helpers for the gateway tests (no tests here): an in-process uvicorn server, a scripted fake
engine that speaks the real Redis protocol, and small HTTP/SSE helpers."""
from __future__ import annotations

import asyncio
import json
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

import msgpack
import redis

from shared import names
from shared.protocol import PROTOCOL_VERSION, Abort, GenerateRequest, decode
from tests.support.redis_server import free_port


# ---------------------------------------------------------------------- servers
class ServerThread:
    """uvicorn serving an ASGI app on a free port, in a thread with its own event loop."""

    def __init__(self, app, port: int | None = None):
        import uvicorn
        self.app = app
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.ws_url = f"ws://127.0.0.1:{self.port}"
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning", lifespan="on",
                                timeout_graceful_shutdown=3)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True, name=f"uvicorn-{self.port}")

    def start(self, timeout: float = 30.0) -> "ServerThread":
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive():
                raise RuntimeError("uvicorn exited during startup")
            if time.monotonic() > deadline:
                raise TimeoutError("uvicorn did not start")
            time.sleep(0.02)
        return self

    @property
    def gw(self):
        return self.app.state.gw

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(15)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()


def start_gateway(redis_url: str, model_dir, **overrides) -> ServerThread:
    from gateway.app import create_app
    from shared.config import GatewayConfig
    cfg = GatewayConfig(redis_url=redis_url, model=str(model_dir), engine_timeout=overrides.pop("engine_timeout", 3.0))
    cfg = cfg.with_overrides(**overrides)
    return ServerThread(create_app(cfg)).start()


def openai_client(srv: ServerThread):
    """The `openai` SDK's client of a gateway: no retries, no proxy from the environment."""
    import httpx
    import openai
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60,
                         http_client=httpx.Client(trust_env=False, timeout=60))


# ---------------------------------------------------------------------- a scripted fake engine
@dataclass
class FakeRequest:
    req: GenerateRequest
    entry_id: bytes
    aborted: bool = False


def default_tokens(n: int) -> list[int]:
    # Plain printable ids of the tiny tokenizer (byte-level: ids >= 3 are bytes/merges).
    return [(40 + i * 7) % 200 + 3 for i in range(n)]


class FakeEngine:
    """Consumes its model's request stream as group ``engines`` and answers each request with a script.

    ``script(request) -> list of step dicts``; each step dict is a delta without request_id/seq
    (``token_ids``, optional ``finish_reason``, ``logprobs``, ...), or {"sleep": s}, or
    {"seq": n, ...} to force a sequence number (gaps), or {"stop_heartbeat": True} to play dead.
    By default: ``max_tokens`` tokens, finish_reason "length".
    """

    def __init__(self, redis_url: str, engine_id: str = "fake-engine", model: str = "tiny",
                 max_model_len: int = 512, script: Callable[[GenerateRequest], list[dict]] | None = None,
                 step_s: float = 0.005, hb: dict | None = None, vocab_size: int = 384):
        self.r = redis.Redis.from_url(redis_url, socket_timeout=5)
        self.engine_id = engine_id
        self.model = model
        self.stream = names.request_stream(model)
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.script = script or self.default_script
        self.step_s = step_s
        self.hb_extra = dict(hb or {})
        self._hb_lock = threading.Lock()       # one heartbeat's fields and SET at a time
        self.requests: dict[str, FakeRequest] = {}
        self.aborts: list[str] = []
        self.heartbeat_on = True
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self.errors: list[BaseException] = []

    def default_script(self, req: GenerateRequest) -> list[dict]:
        n = int(req.params.get("max_tokens", 16))
        toks = default_tokens(n)
        steps = [{"token_ids": [t]} for t in toks]
        steps[-1]["finish_reason"] = "length"
        return steps

    # -- heartbeat
    def heartbeat(self) -> None:
        with self._hb_lock:
            hb = {"engine_id": self.engine_id, "model": self.model, "max_model_len": self.max_model_len,
                  "vocab_size": self.vocab_size, "capacity": 64, "num_running": 0, "num_waiting": 0,
                  "num_waiting_tokens": 0, "kv_cache_usage": 0.25, "prefix_cache_hit_rate": 0.0, "time": time.time()}
            hb.update(self.hb_extra)
            self.r.set(names.heartbeat_key(self.engine_id), msgpack.packb(hb, use_bin_type=True), px=5000)

    def set_heartbeat(self, **fields) -> None:
        """Report `fields` from now on, written at once: no heartbeat of the loop's, built from the
        fields before, can land after this one."""
        with self._hb_lock:
            self.hb_extra = fields
        self.heartbeat()

    def _hb_loop(self) -> None:
        while not self._stop.is_set():
            if self.heartbeat_on:
                try:
                    self.heartbeat()
                except redis.RedisError:
                    pass
            self._stop.wait(0.2)

    # -- consuming
    def _ensure_group(self) -> None:
        try:
            self.r.xgroup_create(self.stream, names.ENGINE_GROUP, id="0", mkstream=True)
        except redis.ResponseError as e:
            if "BUSYGROUP" not in str(e):
                raise

    def _loop(self) -> None:
        abort_last = "0-0"
        while not self._stop.is_set():
            try:
                self._ensure_group()
                res = self.r.xreadgroup(names.ENGINE_GROUP, self.engine_id, {self.stream: ">"},
                                        count=16, block=50)
                for _, entries in res or []:
                    for entry_id, fields in entries:
                        self.r.xack(self.stream, names.ENGINE_GROUP, entry_id)
                        try:
                            msg = decode(fields[names.PAYLOAD_FIELD])
                        except Exception:
                            continue
                        fr = FakeRequest(msg, entry_id)
                        self.requests[msg.request_id] = fr
                        t = threading.Thread(target=self._serve, args=(fr,), daemon=True)
                        t.start()
                ab = self.r.xread({names.ABORT_STREAM: abort_last}, count=100)
                for _, entries in ab or []:
                    for entry_id, fields in entries:
                        abort_last = entry_id
                        try:
                            a = decode(fields[names.PAYLOAD_FIELD])
                        except Exception:
                            continue
                        if isinstance(a, Abort):
                            self.aborts.append(a.request_id)
                            if a.request_id in self.requests:
                                self.requests[a.request_id].aborted = True
            except redis.RedisError:
                self._stop.wait(0.1)
            except Exception as e:  # pragma: no cover
                self.errors.append(e)
                self._stop.wait(0.1)

    def publish(self, reply_to: str, deltas: list[dict]) -> None:
        body = {"v": PROTOCOL_VERSION, "t": "tokens", "engine_id": self.engine_id, "deltas": deltas}
        self.r.publish(names.reply_channel(reply_to), msgpack.packb(body, use_bin_type=True))

    def _serve(self, fr: FakeRequest) -> None:
        req = fr.req
        seq = req.first_seq
        produced = 0
        try:
            for step in self.script(req):
                if self._stop.is_set():
                    return
                if fr.aborted:
                    self.publish(req.reply_to, [{"request_id": req.request_id, "seq": seq, "token_ids": [],
                                                 "finish_reason": "abort", "num_prompt_tokens": len(req.prompt_token_ids),
                                                 "num_output_tokens": produced}])
                    return
                step = dict(step)
                if "sleep" in step:
                    time.sleep(step["sleep"])
                    continue
                if step.pop("stop_heartbeat", False):
                    self.heartbeat_on = False
                    self.r.delete(names.heartbeat_key(self.engine_id))
                    continue
                if step.pop("hang", False):
                    return
                time.sleep(self.step_s)
                d = {"request_id": req.request_id, "seq": step.pop("seq", seq), "token_ids": step.pop("token_ids", [])}
                d.update(step)
                produced += len(d["token_ids"])
                if d.get("finish_reason"):
                    d.setdefault("num_prompt_tokens", len(req.prompt_token_ids))
                    d.setdefault("num_output_tokens", produced)
                    d.setdefault("num_cached_tokens", 0)
                    d.setdefault("metrics", {"queued": time.time()})
                self.publish(req.reply_to, [d])
                seq = d["seq"] + 1
        except Exception as e:  # pragma: no cover
            self.errors.append(e)

    def start(self) -> "FakeEngine":
        self.heartbeat()
        self._ensure_group()
        for target in (self._hb_loop, self._loop):
            t = threading.Thread(target=target, daemon=True)
            t.start()
            self._threads.append(t)
        return self

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(5)
        try:
            self.r.delete(names.heartbeat_key(self.engine_id))
        except redis.RedisError:
            pass

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()


# ---------------------------------------------------------------------- HTTP helpers
def sse_events(lines) -> list[Any]:
    """Parse SSE `data:` lines (an iterator of str lines) into JSON objects and the literal '[DONE]'."""
    out = []
    for line in lines:
        if not line or not line.startswith("data:"):
            continue
        data = line[5:].strip()
        out.append("[DONE]" if data == "[DONE]" else json.loads(data))
    return out


def post_stream(client, url: str, body: dict, headers: dict | None = None) -> tuple[int, list[Any]]:
    with client.stream("POST", url, json=body, headers=headers or {}) as resp:
        if resp.status_code != 200:
            resp.read()
            return resp.status_code, [resp.json()]
        return 200, sse_events(resp.iter_lines())


async def stream_completion(client, body: dict) -> dict:
    """POST a streamed /v1/completions (an httpx.AsyncClient) and gather it: the text, the last
    finish_reason, whether [DONE] came, the error events and the usage chunk."""
    async with client.stream("POST", "/v1/completions", json=body) as resp:
        assert resp.status_code == 200
        events = sse_events([line async for line in resp.aiter_lines()])
    text, finish, errors, usage = "", None, [], None
    for ev in events:
        if ev == "[DONE]":
            continue
        if "error" in ev:
            errors.append(ev["error"])
            continue
        usage = ev.get("usage") or usage
        for c in ev["choices"]:
            text += c["text"]
            finish = c["finish_reason"] or finish
    return {"text": text, "finish": finish, "done": "[DONE]" in events, "errors": errors, "usage": usage}


def run_async(coro):
    return asyncio.run(coro)
