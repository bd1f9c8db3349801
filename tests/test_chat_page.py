"""The chat page (gateway/static/) in a real browser against the real system.

Redis, one engine worker on the tiny random model (a subprocess: ``python -m shared.cli engine``) and
the gateway (in-process, uvicorn on a thread, so it can be stopped and started again on the same port
quickly) on free ports. Playwright drives Debian's chromium headless; no browser is ever downloaded.

Observables are real: the DOM (``data-state`` on each message), the gateway's ``GET /v1/status`` and
the request entries the gateway XADDed to Redis (decoded, then compared with the chat template of
the conversation the page shows). Engines delete finished entries, so a ``StreamTap`` reads each
entry as it is added (a blocked XREAD is served at XADD time).

Screenshots go to test-artifacts/ (gitignored).
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.redis_server import free_port

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking"]
ROOT = Path(__file__).resolve().parent.parent
ARTIFACTS = ROOT / "test-artifacts"

pytestmark = pytest.mark.timeout(120)


# ---------------------------------------------------------------------- the system
class GatewayThread:
    """The real gateway app under uvicorn on a background thread; stop() and start() again at will."""

    def __init__(self, model_dir: Path, redis_url: str, port: int):
        self.model_dir, self.redis_url, self.port = str(model_dir), redis_url, port
        self.server = None
        self.thread: threading.Thread | None = None
        self.url = f"http://127.0.0.1:{port}"

    def start(self, timeout: float = 60.0) -> None:
        import uvicorn

        from gateway.app import create_app
        from shared.config import GatewayConfig

        config = GatewayConfig(model=self.model_dir, redis_url=self.redis_url, host="127.0.0.1", port=self.port,
                               engine_timeout=5.0)
        app = create_app(config)
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning",
                                                    lifespan="on", timeout_graceful_shutdown=2))
        self.thread = threading.Thread(target=self.server.run, name=f"gateway-{self.port}", daemon=True)
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive():
                raise RuntimeError("the gateway thread exited during startup")
            if time.monotonic() > deadline:
                raise TimeoutError("the gateway did not start")
            time.sleep(0.05)

    def stop(self) -> None:
        if self.server is not None:
            self.server.should_exit = True
        if self.thread is not None:
            self.thread.join(15)
            assert not self.thread.is_alive(), "the gateway did not stop"
        self.server = self.thread = None

    def wait_ready(self, timeout: float = 60.0) -> dict:
        deadline = time.monotonic() + timeout
        last = None
        while time.monotonic() < deadline:
            try:
                r = httpx.get(self.url + "/ready", timeout=2)
                last = r.text
                if r.status_code == 200:
                    return r.json()
            except httpx.HTTPError as e:
                last = repr(e)
            time.sleep(0.2)
        raise TimeoutError(f"gateway not ready after {timeout}s: {last}")

    def status(self) -> dict:
        return httpx.get(self.url + "/v1/status", timeout=5).json()


class StreamTap:
    """Every request the gateways XADD, decoded, read by a blocked XREAD on a thread as it arrives."""

    def __init__(self, redis_url: str):
        import redis
        self.r = redis.Redis.from_url(redis_url, socket_timeout=5)
        self.requests: dict[str, object] = {}
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._read, name="stream-tap", daemon=True)
        self.thread.start()

    def _read(self) -> None:
        from shared import names
        from shared.protocol import GenerateRequest, decode
        last = "0-0"            # the stack starts on an empty Redis
        while not self._stop.is_set():
            for _, entries in self.r.xread({names.REQUEST_STREAM: last}, block=1000) or []:
                for entry_id, fields in entries:
                    last = entry_id
                    msg = decode(fields[names.PAYLOAD_FIELD])
                    if isinstance(msg, GenerateRequest):
                        self.requests[msg.request_id] = msg

    def close(self) -> None:
        self._stop.set()
        self.thread.join(5)


class Stack:
    def __init__(self, model_dir, redis_url, gateway, engine, engine_log, tap: StreamTap):
        self.model_dir, self.redis_url, self.gateway = model_dir, redis_url, gateway
        self.engine, self.engine_log, self.tap = engine, engine_log, tap
        from transformers import AutoTokenizer
        self.tokenizer = AutoTokenizer.from_pretrained(str(model_dir))

    @property
    def url(self) -> str:
        return self.gateway.url + "/"

    def chat_ids(self, messages: list[dict]) -> list[int]:
        out = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if hasattr(out, "keys"):
            out = out["input_ids"]
        return list(out)

    def queued_request(self, request_id: str):
        """The GenerateRequest the gateway put on the request stream for this id."""
        msg = self.tap.requests.get(request_id)
        assert msg is not None, f"no request {request_id} was added to the request stream"
        return msg

    def wait_running(self, value: int, timeout: float = 15.0) -> dict:
        deadline = time.monotonic() + timeout
        s = {}
        while time.monotonic() < deadline:
            s = self.gateway.status()
            if s.get("num_requests_running") == value and s.get("engines", 0) >= 1:
                return s
            time.sleep(0.1)
        raise AssertionError(f"num_requests_running never became {value}: {s}")


@pytest.fixture(scope="module")
def browser():
    if not os.path.exists(CHROMIUM):
        pytest.skip(f"{CHROMIUM} is missing (apt-get install chromium; scripts/setup.sh test installs it)")
    sync_api = pytest.importorskip("playwright.sync_api")
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield b
        b.close()


@pytest.fixture(scope="module")
def stack(browser, tiny_model_dir, redis_server):
    import redis as redis_lib
    redis_lib.Redis.from_url(redis_server.url).flushall()
    ARTIFACTS.mkdir(exist_ok=True)
    engine_log = ARTIFACTS / "chat-page-engine.log"
    log_file = open(engine_log, "w")
    engine = subprocess.Popen(
        [sys.executable, "-m", "shared.cli", "engine", "--model", str(tiny_model_dir),
         "--redis-url", redis_server.url, "--dtype", "float32", "--kv-cache-memory", "64MiB",
         "--engine-id", "chat-page-test", "--heartbeat-interval", "0.25"],
        cwd=ROOT, stdout=log_file, stderr=subprocess.STDOUT)
    gateway = GatewayThread(tiny_model_dir, redis_server.url, free_port())
    tap = StreamTap(redis_server.url)
    try:
        gateway.start()
        gateway.wait_ready(timeout=90)
        yield Stack(tiny_model_dir, redis_server.url, gateway, engine, engine_log, tap)
    except BaseException:
        log_file.flush()
        sys.stderr.write("engine log tail:\n" + engine_log.read_text()[-4000:])
        raise
    finally:
        tap.close()
        gateway.stop()
        engine.terminate()
        try:
            engine.wait(15)
        except subprocess.TimeoutExpired:
            engine.kill()
            engine.wait()
        log_file.close()


# ---------------------------------------------------------------------- page helpers
@pytest.fixture
def page(browser, stack):
    context = browser.new_context(viewport={"width": 1280, "height": 800})
    pg = context.new_page()
    errors: list[str] = []
    pg.on("pageerror", lambda e: errors.append(str(e)))
    pg.goto(stack.url)
    pg.wait_for_selector("body[data-conn=open]", timeout=15_000)
    yield pg
    context.close()
    assert not errors, f"JavaScript errors on the page: {errors}"


def settings(pg, *, temperature, top_p, max_tokens, seed):
    pg.fill("#temperature", str(temperature))
    pg.fill("#top_p", str(top_p))
    pg.fill("#max_tokens", str(max_tokens))
    pg.fill("#seed", str(seed))


def send(pg, text: str) -> None:
    """Type the message (Shift+Enter between lines) and press Enter."""
    pg.click("#prompt")
    for i, line in enumerate(text.split("\n")):
        if i:
            pg.keyboard.press("Shift+Enter")
        pg.keyboard.type(line)
    assert pg.input_value("#prompt") == text
    pg.keyboard.press("Enter")


def last_reply(pg):
    return pg.locator("article.msg-assistant").last


def wait_reply_state(pg, states: str | tuple, timeout: float = 30_000):
    states = (states,) if isinstance(states, str) else states
    pg.wait_for_function(
        """(states) => { const a = [...document.querySelectorAll('article.msg-assistant')].pop();
                         return a && states.includes(a.dataset.state); }""",
        arg=list(states), timeout=timeout)
    return last_reply(pg)


WATCH_STREAM = """() => {
  window.__texts = [];
  const log = document.getElementById('log');
  const obs = new MutationObserver(() => {
    const a = [...log.querySelectorAll('article.msg-assistant')].pop();
    if (!a) return;
    const t = a.querySelector('.msg-body').textContent;
    if (window.__texts[window.__texts.length - 1] !== t) window.__texts.push(t);
  });
  obs.observe(log, {subtree: true, childList: true, characterData: true});
}"""


def snapshot(pg) -> dict:
    return pg.evaluate("window.kaitenChat.snapshot()")


# ---------------------------------------------------------------------- tests
def test_streams_two_turns_persists_and_screenshots(page, stack):
    pg = page
    # Status line: model name and engine load from GET /v1/status.
    pg.wait_for_function("document.getElementById('engine-status').dataset.ok === 'true'", timeout=10_000)
    assert "tiny" in pg.inner_text("#engine-status")
    assert re.search(r"running \d+ · waiting \d+ · KV \d+%", pg.inner_text("#engine-status"))
    # The settings show the server's defaults (GET /v1/status), which an empty field leaves to it.
    assert pg.get_attribute("#temperature", "placeholder") == "model default 1"
    assert pg.get_attribute("#max_tokens", "placeholder") == "up to the context"

    # Turn 1: the reply grows over several DOM updates, then ends with its stats.
    settings(pg, temperature=1.0, top_p=1.0, max_tokens=24, seed=0)
    pg.evaluate(WATCH_STREAM)
    first = "Hello!\nTell me about the fox."
    send(pg, first)
    reply = wait_reply_state(pg, ("done", "error"))
    assert reply.get_attribute("data-state") == "done", reply.inner_text()
    texts = [t for t in pg.evaluate("window.__texts") if t]
    assert len(texts) >= 2, f"the reply did not stream (DOM texts seen: {texts!r})"
    for a, b in zip(texts, texts[1:]):
        assert b.startswith(a) and len(b) > len(a), f"the reply did not grow: {a!r} -> {b!r}"
    user = pg.locator("article.msg-user").last
    assert user.locator(".msg-body").inner_text() == first          # Shift+Enter kept the newline
    assert reply.get_attribute("data-finish-reason") in ("stop", "length")
    assert re.fullmatch(r"TTFT \d+\.\d\d s", reply.locator("[data-stat=ttft]").inner_text())
    assert re.fullmatch(r"\d+\.\d tok/s", reply.locator("[data-stat=tps]").inner_text())
    n1 = int(reply.get_attribute("data-completion-tokens"))
    p1 = int(reply.get_attribute("data-prompt-tokens"))
    assert 2 <= n1 <= 24
    assert reply.locator("[data-stat=tokens]").inner_text() == f"{n1} tokens"
    assert reply.locator("[data-stat=finish]").inner_text().split()[0] == reply.get_attribute("data-finish-reason")

    # Turn 2: the whole conversation goes to the server.
    settings(pg, temperature=1.0, top_p=1.0, max_tokens=16, seed=3)
    second = "And what about Paris?"
    send(pg, second)
    reply2 = wait_reply_state(pg, ("done", "error"))
    assert reply2.get_attribute("data-state") == "done", reply2.inner_text()
    convo = snapshot(pg)["messages"]
    assert [m["role"] for m in convo] == ["user", "assistant", "user", "assistant"]
    assert convo[0]["content"] == first and convo[2]["content"] == second
    expected = [{"role": "user", "content": first}, {"role": "assistant", "content": convo[1]["content"]},
                {"role": "user", "content": second}]
    req1 = stack.queued_request(convo[1]["request_id"])
    req2 = stack.queued_request(convo[3]["request_id"])
    assert req1.prompt_token_ids == stack.chat_ids(expected[:1])
    assert req2.prompt_token_ids == stack.chat_ids(expected), \
        stack.tokenizer.decode(req2.prompt_token_ids)
    assert int(reply2.get_attribute("data-prompt-tokens")) == len(req2.prompt_token_ids)
    assert p1 == len(req1.prompt_token_ids)
    assert int(reply2.get_attribute("data-prompt-tokens")) > p1 + len(stack.tokenizer.encode(second))
    assert req2.params.get("seed") == 3 and req2.params.get("max_tokens") == 16

    # The conversation survives a reload (localStorage).
    before = [(m["role"], m["content"]) for m in convo]
    pg.reload()
    pg.wait_for_selector("body[data-conn=open]")
    assert pg.locator("article.msg").count() == 4
    assert [(m["role"], m["content"]) for m in snapshot(pg)["messages"]] == before
    assert last_reply(pg).get_attribute("data-state") == "done"
    assert last_reply(pg).locator("[data-stat=tokens]").is_visible()
    assert pg.input_value("#max_tokens") == "16"                      # settings persist as well

    # Screenshots at desktop and phone widths; on the phone nothing scrolls sideways.
    pg.wait_for_function("document.getElementById('engine-status').dataset.ok === 'true'")
    pg.screenshot(path=str(ARTIFACTS / "chat-desktop.png"))
    pg.set_viewport_size({"width": 390, "height": 844})
    pg.wait_for_timeout(100)
    assert pg.evaluate("document.documentElement.scrollWidth") <= 390
    assert pg.locator("#send").is_visible() and pg.locator("#prompt").is_visible()
    assert not pg.locator("#settings").is_visible()                   # a panel behind a button
    pg.screenshot(path=str(ARTIFACTS / "chat-phone.png"))
    pg.click("#settings-toggle")
    assert pg.locator("#system").is_visible()
    assert pg.evaluate("document.activeElement.id") == "system"
    pg.screenshot(path=str(ARTIFACTS / "chat-phone-settings.png"))
    pg.keyboard.press("Escape")
    assert not pg.locator("#settings").is_visible()

    # New chat clears the conversation, in storage too.
    pg.click("#new-chat")
    assert pg.locator("article.msg").count() == 0
    assert snapshot(pg)["messages"] == []
    assert json.loads(pg.evaluate("localStorage.getItem('kaiten.chat.v1')"))["messages"] == []


def test_stop_cancels_generation(page, stack):
    pg = page
    # With the tiny model this seed runs to max_tokens (470 tokens, over a second even on a fast
    # machine): time enough to press Stop after the first words.
    settings(pg, temperature=1.0, top_p=1.0, max_tokens=470, seed=19)
    send(pg, "Write a very long story.")
    pg.wait_for_function(
        """() => { const a = [...document.querySelectorAll('article.msg-assistant')].pop();
                   return a && a.dataset.state !== 'queued' && a.querySelector('.msg-body').textContent.length > 0; }""",
        timeout=30_000)
    assert pg.locator("#stop").is_visible() and not pg.locator("#send").is_visible()
    pg.click("#stop")
    reply = wait_reply_state(pg, ("stopped", "done", "error"), timeout=15_000)
    assert reply.get_attribute("data-state") == "stopped", \
        f"the reply was not stopped: {reply.get_attribute('data-state')} {reply.get_attribute('data-finish-reason')}"
    assert reply.get_attribute("data-finish-reason") == "cancelled"
    assert reply.locator(".msg-note").inner_text() == "Stopped"
    assert reply.locator("[data-stat=finish]").inner_text() == "cancelled"
    n = int(reply.get_attribute("data-completion-tokens"))
    assert 1 <= n < 470
    text = reply.locator(".msg-body").text_content()
    assert text and snapshot(pg)["messages"][-1]["content"] == text   # the reply ends where it stopped
    assert pg.locator("#send").is_visible()
    pg.screenshot(path=str(ARTIFACTS / "chat-stopped.png"))
    # The engine let go of it.
    stack.wait_running(0)
    pg.wait_for_function("document.getElementById('engine-status').dataset.running === '0'", timeout=10_000)


def test_reconnects_and_delivers_queued_message(page, stack):
    pg = page
    settings(pg, temperature=1.0, top_p=1.0, max_tokens=12, seed=0)
    pg.evaluate("""() => {
      window.__conn = [document.body.dataset.conn];
      new MutationObserver(() => {
        const c = document.body.dataset.conn;
        if (window.__conn[window.__conn.length - 1] !== c) window.__conn.push(c);
      }).observe(document.body, {attributes: true, attributeFilter: ['data-conn']});
    }""")

    # 1) The socket dies under the page: it reconnects by itself.
    old = pg.evaluate_handle("window.kaitenChat.socket")
    pg.evaluate("window.kaitenChat.dropSocket()")
    pg.wait_for_function("(old) => window.kaitenChat.connected && window.kaitenChat.socket !== old",
                         arg=old, timeout=10_000)
    assert pg.evaluate("window.__conn").count("open") >= 2, pg.evaluate("window.__conn")

    # 2) The gateway goes away: a message sent meanwhile waits in the queue, and is sent on reconnect.
    stack.gateway.stop()
    pg.wait_for_selector("body[data-conn=closed]", timeout=10_000)
    assert pg.locator("#conn-banner").is_visible()
    text = "Are you back?"
    send(pg, text)
    reply = wait_reply_state(pg, "queued", timeout=5_000)
    pg.wait_for_timeout(1500)                                          # a few failed reconnects
    assert reply.get_attribute("data-state") == "queued"
    assert pg.evaluate("window.kaitenChat.outbox.length") == 1
    assert "queued" in pg.inner_text("#conn-banner")
    pg.screenshot(path=str(ARTIFACTS / "chat-queued.png"))
    assert json.loads(pg.evaluate("localStorage.getItem('kaiten.chat.v1')"))["messages"][-1]["state"] == "queued"

    stack.gateway.start()
    stack.gateway.wait_ready()
    reply = wait_reply_state(pg, ("done", "error"), timeout=30_000)
    assert reply.get_attribute("data-state") == "done", reply.inner_text()
    assert not pg.locator("#conn-banner").is_visible()
    convo = snapshot(pg)["messages"]
    assert [m["role"] for m in convo] == ["user", "assistant"]
    req = stack.queued_request(convo[1]["request_id"])
    assert req.prompt_token_ids == stack.chat_ids([{"role": "user", "content": text}])
    assert int(reply.get_attribute("data-prompt-tokens")) == len(req.prompt_token_ids)
    conn = pg.evaluate("window.__conn")
    assert conn[-1] == "open" and "closed" in conn, conn


def test_errors_render_inline_and_markdown_is_safe(browser, stack):
    """Server error frames (overload with retry-after, a lost engine) through a routed socket, and the
    markdown-ish renderer on hostile text. The page itself is the real one, from the real gateway."""
    context = browser.new_context(viewport={"width": 1280, "height": 800})
    pg = context.new_page()
    frames: list[dict] = []

    def handler(ws):
        def on_message(message):
            f = json.loads(message)
            frames.append(f)
            if f.get("type") != "chat":
                return
            if sum(1 for x in frames if x.get("type") == "chat") == 1:
                ws.send(json.dumps({"type": "error", "id": f["id"], "status": 429, "retry_after": 2,
                                    "error": {"message": "the server is overloaded", "type": "rate_limit",
                                              "param": None, "code": "overloaded"}}))
            else:
                ws.send(json.dumps({"type": "start", "id": f["id"], "request_id": "chatcmpl-x", "model": "tiny"}))
                ws.send(json.dumps({"type": "delta", "id": f["id"], "content": "partial <b>x</b>"}))
                ws.send(json.dumps({"type": "error", "id": f["id"], "status": 503,
                                    "error": {"message": "engine e1 stopped heartbeating", "type": "server_error",
                                              "param": None, "code": "engine_lost"}}))
        ws.on_message(on_message)

    pg.route_web_socket(re.compile(r".*/v1/chat/ws$"), handler)
    try:
        pg.goto(stack.url)
        pg.wait_for_selector("body[data-conn=open]")
        send(pg, "hi")
        reply = wait_reply_state(pg, "error", timeout=5_000)
        err = reply.locator(".msg-error")
        assert err.get_attribute("data-status") == "429"
        assert "busy" in err.inner_text() and "2 s" in err.inner_text()
        retry = reply.locator(".msg-retry")
        assert retry.is_disabled()                                       # until retry-after has passed
        pg.wait_for_function("() => !document.querySelector('article.msg-assistant .msg-retry').disabled",
                             timeout=5_000)
        retry.click()
        reply = wait_reply_state(pg, "error", timeout=5_000)
        assert reply.locator(".msg-error").get_attribute("data-code") == "engine_lost"
        assert "engine" in reply.locator(".msg-error").inner_text()
        assert reply.locator(".msg-body").text_content() == "partial <b>x</b>"   # kept, and as text
        assert reply.locator(".msg-body b").count() == 0
        chats = [f for f in frames if f.get("type") == "chat"]
        assert len(chats) == 2 and chats[1]["messages"] == [{"role": "user", "content": "hi"}]

        # Fenced code keeps its whitespace; HTML in model text stays text.
        html = pg.evaluate("""() => {
          const el = document.createElement('div');
          window.kaitenChat.render(el, "Look:\\n```python\\ndef f():\\n    return '<img src=x onerror=alert(1)>'\\n```\\nend `x<y>`");
          return {pre: el.querySelectorAll('pre code').length, code: el.querySelector('pre code').textContent,
                  lang: el.querySelector('pre').dataset.lang, img: el.querySelectorAll('img').length,
                  inline: el.querySelector('code.md-inline').textContent};
        }""")
        assert html == {"pre": 1, "code": "def f():\n    return '<img src=x onerror=alert(1)>'", "lang": "python",
                        "img": 0, "inline": "x<y>"}
    finally:
        context.close()
