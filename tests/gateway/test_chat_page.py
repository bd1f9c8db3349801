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
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.support.paths import ROOT
from tests.support.redis_server import free_port

CHROMIUM = "/usr/bin/chromium"
ENGINE_ID = "chat-page-test"
STEP_S = 0.03                      # the engine's least step time (see the stack fixture)
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking"]
ARTIFACTS = ROOT / "test-artifacts"

pytestmark = pytest.mark.timeout(120)


# ---------------------------------------------------------------------- the system
class GatewayThread:
    """The real gateway app under uvicorn on a background thread; stop() and start() again at will."""

    def __init__(self, model_dir: Path, redis_url: str, port: int, api_keys: tuple[str, ...] = ()):
        self.model_dir, self.redis_url, self.port = str(model_dir), redis_url, port
        self.api_keys = api_keys
        self.server = None
        self.thread: threading.Thread | None = None
        self.url = f"http://127.0.0.1:{port}"

    def start(self, timeout: float = 60.0) -> None:
        import uvicorn

        from gateway.app import create_app
        from shared.config import GatewayConfig

        config = GatewayConfig(model=self.model_dir, redis_url=self.redis_url, host="127.0.0.1", port=self.port,
                               engine_timeout=5.0, api_keys=self.api_keys)
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
    """Every request the gateways XADD, decoded, read by a blocked XREAD on a thread as it arrives:
    on the shared stream and on the engine's own stream, where cache-aware routing sends requests."""

    def __init__(self, redis_url: str, engine_id: str, model: str):
        import redis
        self.r = redis.Redis.from_url(redis_url, socket_timeout=5)
        self.model = model
        self.requests: dict[str, object] = {}
        self.engine_id = engine_id
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._read, name="stream-tap", daemon=True)
        self.thread.start()

    def _read(self) -> None:
        from shared import names
        from shared.protocol import GenerateRequest, decode
        last = {names.request_stream(self.model): "0-0", names.engine_stream(self.engine_id): "0-0"}  # empty Redis
        while not self._stop.is_set():
            for stream, entries in self.r.xread(last, block=1000) or []:
                for entry_id, fields in entries:
                    last[stream.decode()] = entry_id
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
    # Every engine step lasts at least STEP_S (tests/support/slow_engine.py): the page draws a reply once
    # per animation frame, and the tiny model's few-ms steps could fit a whole reply in one frame
    # on a loaded machine, which the streaming test would take for no stream.
    engine = subprocess.Popen(
        [sys.executable, "-m", "tests.support.slow_engine", str(STEP_S), "-", "--model", str(tiny_model_dir),
         "--redis-url", redis_server.url, "--dtype", "float32", "--kv-cache-memory", "64MiB",
         "--engine-id", ENGINE_ID, "--heartbeat-interval", "0.25"],
        cwd=ROOT, stdout=log_file, stderr=subprocess.STDOUT)
    gateway = GatewayThread(tiny_model_dir, redis_server.url, free_port())
    tap = StreamTap(redis_server.url, ENGINE_ID, tiny_model_dir.name)
    try:
        gateway.start()
        gateway.wait_ready(timeout=90)
        # One request first: the engine compiles its step on the first ones, and a reply that
        # waits for that arrives in one burst, which the streaming test would take for no stream.
        warm = httpx.post(gateway.url + "/v1/completions", json={"prompt": "warm up", "max_tokens": 4},
                          timeout=120)
        assert warm.status_code == 200, warm.text
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
  // Each DOM change of the last reply: its text on screen, and the raw text the page holds for it.
  window.__texts = [];
  window.__contents = [];
  const log = document.getElementById('log');
  const obs = new MutationObserver(() => {
    const a = [...log.querySelectorAll('article.msg-assistant')].pop();
    if (!a) return;
    const t = a.querySelector('.msg-body').textContent;
    if (window.__texts[window.__texts.length - 1] === t) return;
    window.__texts.push(t);
    const m = window.kaitenChat.snapshot().messages.find(x => x.id === a.dataset.id);
    window.__contents.push(m ? m.content : null);
  });
  obs.observe(log, {subtree: true, childList: true, characterData: true});
}"""


def rendered_text(pg, markdown: str) -> str:
    """The text the page shows for this reply text (rendered by the page's own markdown code)."""
    return pg.evaluate("(t) => { const el = document.createElement('div'); window.kaitenChat.render(el, t);"
                       " return el.textContent; }", markdown)


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
    contents = [c for c in pg.evaluate("window.__contents") if c]
    for a, b in zip(contents, contents[1:]):                         # markdown may reshape the text on
        assert b.startswith(a) and len(b) >= len(a), f"the reply did not grow: {a!r} -> {b!r}"  # screen
    counters = pg.evaluate("window.kaitenChat.counters")
    assert counters["markdownRenders"] <= counters["deltas"] + 3, counters   # never more than per delta
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

    # New chat starts an empty conversation; the old one stays in the list of past chats.
    old_id = pg.evaluate("window.kaitenChat.chatId")
    pg.click("#new-chat")
    assert pg.locator("article.msg").count() == 0
    assert snapshot(pg)["messages"] == []
    assert pg.evaluate("window.kaitenChat.chatId") != old_id
    saved = json.loads(pg.evaluate(f"localStorage.getItem('kaiten.chat.v2.{old_id}')"))
    assert [(m["role"], m["content"]) for m in saved["messages"]] == before


def test_stop_cancels_generation(page, stack):
    pg = page
    # With the tiny model this seed runs to max_tokens (470 tokens). A fast CPU makes them in well
    # under a second, so the engine is paused (SIGSTOP) from the first words until Stop is pressed,
    # far shorter than the failover timeout: the reply is still generating when Stop is clicked.
    settings(pg, temperature=1.0, top_p=1.0, max_tokens=470, seed=19)
    send(pg, "Write a very long story.")
    pg.wait_for_function(
        """() => { const a = [...document.querySelectorAll('article.msg-assistant')].pop();
                   return a && a.dataset.state !== 'queued' && a.querySelector('.msg-body').textContent.length > 0; }""",
        timeout=30_000, polling=5)
    stack.engine.send_signal(signal.SIGSTOP)
    try:
        assert pg.locator("#stop").is_visible() and not pg.locator("#send").is_visible()
        pg.click("#stop", timeout=5_000)
    finally:
        stack.engine.send_signal(signal.SIGCONT)
    reply = wait_reply_state(pg, ("stopped", "done", "error"), timeout=15_000)
    assert reply.get_attribute("data-state") == "stopped", \
        f"the reply was not stopped: {reply.get_attribute('data-state')} {reply.get_attribute('data-finish-reason')}"
    assert reply.get_attribute("data-finish-reason") == "cancelled"
    assert reply.locator(".msg-note").inner_text() == "Stopped"
    assert reply.locator("[data-stat=finish]").inner_text() == "cancelled"
    n = int(reply.get_attribute("data-completion-tokens"))
    assert 1 <= n < 470
    text = reply.locator(".msg-body").text_content()
    content = snapshot(pg)["messages"][-1]["content"]                  # the reply ends where it stopped:
    assert text and content and rendered_text(pg, content) == text     # what is kept is what was shown
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
    chat_id = pg.evaluate("window.kaitenChat.chatId")
    saved = json.loads(pg.evaluate(f"localStorage.getItem('kaiten.chat.v2.{chat_id}')"))
    assert saved["messages"][-1]["state"] == "queued"

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


def test_errors_render_inline(browser, stack):
    """Server error frames (overload with retry-after, a lost engine) through a routed socket. The page
    itself is the real one, from the real gateway."""
    context = browser.new_context(viewport={"width": 1280, "height": 800})
    pg = context.new_page()
    frames: list[dict] = []

    def handler(ws):
        def on_message(message):
            f = json.loads(message)
            frames.append(f)
            if f.get("type") == "ping":                                  # as the server answers
                ws.send(json.dumps({"type": "pong"}))
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
        assert reply.locator(".msg-body").inner_text() == "partial <b>x</b>"     # kept, and as text
        assert reply.locator(".msg-body b").count() == 0
        chats = [f for f in frames if f.get("type") == "chat"]
        assert len(chats) == 2 and chats[1]["messages"] == [{"role": "user", "content": "hi"}]

    finally:
        context.close()


# ---------------------------------------------------------------------- markdown, copy, regenerate, edit, chats
MARKDOWN = (
    "Steps:\n\n1. **Bold** and *italic*\n2. a [link](https://example.com/x)\n\n"
    "- one\n- two\n\n"
    "| lang | year |\n|---|---|\n| Python | 1991 |\n| C | 1972 |\n\n"
    "```python\ndef f(x):\n    return x < 2\n```\n\n"
    "Inline `a<b` and <img src=x onerror=\"window.__pwned=1\"> and [bad](javascript:window.__pwned=2) "
    "and ![pic](https://example.com/p.png) and <b onclick=\"window.__pwned=3\">html</b>.\n\n"
    "<script>window.__pwned=4</script>\n"
)
CODE = "def f(x):\n    return x < 2"


def routed_answer(browser, stack, answer: str | None):
    """A page of the real gateway whose WebSocket is answered by the test: each chat turn gets
    ``answer`` in one delta, then done (None: only the start frame, the test sends the rest).
    Returns (context, page, the chat frames the page sent)."""
    context = browser.new_context(viewport={"width": 1280, "height": 800})
    pg = context.new_page()
    chats: list[dict] = []

    def handler(ws):
        def on_message(message):
            f = json.loads(message)
            if f.get("type") == "ping":
                ws.send(json.dumps({"type": "pong"}))
            if f.get("type") != "chat":
                return
            chats.append(f)
            ws.send(json.dumps({"type": "start", "id": f["id"], "request_id": f"chatcmpl-{len(chats)}", "model": "tiny"}))
            if answer is None:
                return
            ws.send(json.dumps({"type": "delta", "id": f["id"], "content": answer}))
            ws.send(json.dumps({"type": "done", "id": f["id"], "finish_reason": "stop",
                                "usage": {"prompt_tokens": 5, "completion_tokens": 9, "total_tokens": 14}}))
        ws.on_message(on_message)

    pg.route_web_socket(re.compile(r".*/v1/chat/ws$"), handler)
    pg.requested = []
    pg.on("request", lambda r: pg.requested.append(r.url))
    pg.goto(stack.url)
    pg.wait_for_selector("body[data-conn=open]")
    return context, pg, chats


def test_markdown_renders_highlights_and_is_sanitized(browser, stack):
    context, pg, _ = routed_answer(browser, stack, MARKDOWN)
    errors: list[str] = []
    pg.on("pageerror", lambda e: errors.append(str(e)))
    try:
        pg.evaluate("window.__pwned = 0")
        send(pg, "Show me markdown")
        reply = wait_reply_state(pg, "done", timeout=10_000)
        body = reply.locator(".msg-body")
        assert body.locator("ol > li").count() == 2 and body.locator("ul > li").count() == 2
        assert body.locator("ol strong").inner_text() == "Bold" and body.locator("ol em").inner_text() == "italic"
        link = body.locator("a", has_text="link")
        assert link.get_attribute("href") == "https://example.com/x"
        assert link.get_attribute("target") == "_blank" and "noopener" in link.get_attribute("rel")
        assert body.locator("table th").all_inner_texts() == ["lang", "year"]
        assert body.locator("table tbody tr").count() == 2
        assert body.locator("table tbody td").first.inner_text() == "Python"
        # Fenced code: its text intact, coloured by highlight.js, under a header with its language.
        code = body.locator(".code-block pre code")
        assert code.text_content() == CODE
        assert "hljs" in code.get_attribute("class") and code.locator(".hljs-keyword").first.inner_text() == "def"
        assert body.locator(".code-block .code-lang").inner_text() == "python"
        assert body.locator("code.md-inline").inner_text() == "a<b"
        # Hostile parts: raw HTML stays text, no script runs, no javascript: link, no image loads.
        pg.wait_for_timeout(300)
        assert pg.evaluate("window.__pwned") == 0
        assert body.locator("img, script, b").count() == 0
        assert "<img src=x" in body.inner_text() and "<b onclick" in body.inner_text()
        assert body.locator("a", has_text="bad").get_attribute("href") is None
        assert body.locator("a", has_text="pic").get_attribute("href") == "https://example.com/p.png"
        assert pg.evaluate("""() => [...document.querySelectorAll('#log [onerror], #log [onclick]')].length""") == 0
        # The same through the page's renderer on a detached string: an <img onerror> never fires.
        pg.evaluate("""() => new Promise(done => {
          const el = document.createElement('div');
          document.body.appendChild(el);
          window.kaitenChat.render(el, '<img src=x onerror="window.__pwned=5"><svg><script>window.__pwned=6</script></svg>');
          setTimeout(done, 300);
        })""")
        assert pg.evaluate("window.__pwned") == 0
        ARTIFACTS.mkdir(exist_ok=True)
        pg.screenshot(path=str(ARTIFACTS / "chat-markdown.png"))
        assert not errors, errors
        # Offline: every file the page asked for came from the gateway (no CDN), the libraries included.
        assert pg.requested and all(u.startswith(stack.gateway.url + "/") for u in pg.requested), pg.requested
        assert {"marked.umd.js", "purify.min.js", "highlight.min.js"} <= {u.rsplit("/", 1)[-1] for u in pg.requested}
    finally:
        context.close()


def test_streaming_renders_once_per_frame(browser, stack):
    """300 deltas handled in one task draw the reply once (one animation frame), not 300 times."""
    context, pg, _ = routed_answer(browser, stack, None)
    try:
        send(pg, "Stream please")
        wait_reply_state(pg, "streaming", timeout=5_000)
        result = pg.evaluate("""() => new Promise(done => {
          const id = [...document.querySelectorAll('article.msg-assistant')].pop().dataset.id;
          const sock = window.kaitenChat.socket;
          const before = {...window.kaitenChat.counters};
          for (let i = 0; i < 300; i++) {
            sock.onmessage({data: JSON.stringify({type: 'delta', id, content: (i % 30 === 0 ? '\\n\\n- ' : '') + 'w' + i + ' '})});
          }
          const sameTask = window.kaitenChat.counters.markdownRenders - before.markdownRenders;
          requestAnimationFrame(() => requestAnimationFrame(() => {
            const after = window.kaitenChat.counters;
            done({sameTask, renders: after.markdownRenders - before.markdownRenders,
                  deltas: after.deltas - before.deltas,
                  items: document.querySelectorAll('article.msg-assistant:last-of-type li').length,
                  text: [...document.querySelectorAll('article.msg-assistant')].pop().querySelector('.msg-body').textContent});
          }));
        })""")
        assert result["deltas"] == 300
        assert result["sameTask"] == 0, result                   # nothing drawn per token
        assert result["renders"] == 1, result                    # one frame, one render
        assert "w0" in result["text"] and "w299" in result["text"]
        assert result["items"] == 10
    finally:
        context.close()


def test_copy_buttons_put_text_on_the_clipboard(browser, stack):
    context, pg, _ = routed_answer(browser, stack, MARKDOWN)
    context.grant_permissions(["clipboard-read", "clipboard-write"], origin=stack.gateway.url)
    try:
        send(pg, "Give me code")
        reply = wait_reply_state(pg, "done", timeout=10_000)
        clipboard = "navigator.clipboard.readText()"
        reply.locator(".code-copy").click()
        pg.wait_for_function("document.querySelector('.code-copy').dataset.copied === 'true'", timeout=5_000)
        assert reply.locator(".code-copy").inner_text() == "Copied"
        assert pg.evaluate(clipboard) == CODE
        reply.locator(".act-copy").click()                       # the whole reply, as markdown
        pg.wait_for_function("() => navigator.clipboard.readText().then(t => t.startsWith('Steps:'))", timeout=5_000)
        assert pg.evaluate(clipboard) == MARKDOWN
        pg.locator("article.msg-user .act-copy").click()
        pg.wait_for_function("() => navigator.clipboard.readText().then(t => t === 'Give me code')", timeout=5_000)
        pg.wait_for_function("document.querySelector('.code-copy').textContent === 'Copy'", timeout=5_000)
    finally:
        context.close()


def test_regenerate_and_edit_and_resend_send_the_right_messages(page, stack):
    pg = page
    settings(pg, temperature=1.0, top_p=1.0, max_tokens=8, seed=5)
    send(pg, "First question")
    wait_reply_state(pg, ("done", "error"))
    first_reply = snapshot(pg)["messages"][1]
    assert first_reply["state"] == "done"

    # Regenerate: the last reply is asked again from the same question, without the old answer.
    assert not pg.locator("article.msg-user .act-regen").is_visible()
    settings(pg, temperature=1.0, top_p=1.0, max_tokens=8, seed=6)
    last_reply(pg).locator(".act-regen").click()
    pg.wait_for_function("(old) => { const a = [...document.querySelectorAll('article.msg-assistant')].pop();"
                         " return a.dataset.id !== old && a.dataset.state === 'done'; }",
                         arg=first_reply["id"], timeout=30_000)
    convo = snapshot(pg)["messages"]
    assert [m["role"] for m in convo] == ["user", "assistant"] and convo[1]["id"] != first_reply["id"]
    assert pg.locator("article.msg").count() == 2
    regen = stack.queued_request(convo[1]["request_id"])
    assert regen.prompt_token_ids == stack.chat_ids([{"role": "user", "content": "First question"}])
    assert regen.params.get("seed") == 6

    # A second turn, then edit the first question: what followed it goes, the edit is sent alone.
    send(pg, "Second question")
    wait_reply_state(pg, ("done", "error"))
    assert pg.locator("article.msg").count() == 4
    first_user = pg.locator("article.msg-user").first
    first_user.locator(".act-edit").click()
    box = first_user.locator(".msg-edit textarea")
    assert box.input_value() == "First question"
    box.fill("Edited\nquestion")
    box.press("Enter")
    pg.wait_for_function("() => document.querySelectorAll('article.msg').length === 2", timeout=5_000)
    reply = wait_reply_state(pg, ("done", "error"))
    assert reply.get_attribute("data-state") == "done"
    convo = snapshot(pg)["messages"]
    assert [(m["role"], m["content"]) for m in convo][0] == ("user", "Edited\nquestion")
    assert len(convo) == 2
    assert pg.locator("article.msg-user .msg-body").inner_text() == "Edited\nquestion"
    edited = stack.queued_request(convo[1]["request_id"])
    assert edited.prompt_token_ids == stack.chat_ids([{"role": "user", "content": "Edited\nquestion"}])

    # Escape leaves the editor without sending anything.
    sent = len(stack.tap.requests)
    pg.locator("article.msg-user .act-edit").click()
    pg.locator("article.msg-user .msg-edit textarea").fill("never sent")
    pg.locator("article.msg-user .msg-edit textarea").press("Escape")
    assert pg.locator("article.msg-user .msg-body").inner_text() == "Edited\nquestion"
    pg.wait_for_timeout(300)
    assert len(stack.tap.requests) == sent and len(snapshot(pg)["messages"]) == 2


def test_past_chats_switch_delete_and_survive_a_reload(page, stack):
    pg = page
    pg.on("dialog", lambda d: d.accept())
    settings(pg, temperature=1.0, top_p=1.0, max_tokens=6, seed=1)
    send(pg, "Chat A question")
    wait_reply_state(pg, ("done", "error"))
    chat_a = pg.evaluate("window.kaitenChat.chatId")
    pg.click("#new-chat")
    send(pg, "Chat B question")
    wait_reply_state(pg, ("done", "error"))
    chat_b = pg.evaluate("window.kaitenChat.chatId")
    items = pg.locator("#chat-list .chat-open")
    assert items.all_inner_texts()[:2] == ["Chat B question", "Chat A question"]   # newest first
    assert pg.locator("#chat-list [aria-current]").inner_text() == "Chat B question"

    pg.reload()
    pg.wait_for_selector("body[data-conn=open]")
    assert pg.evaluate("window.kaitenChat.chatId") == chat_b
    assert pg.locator("article.msg-user .msg-body").inner_text() == "Chat B question"
    assert pg.locator("#chat-list .chat-open").all_inner_texts()[:2] == ["Chat B question", "Chat A question"]

    # Switch to A: its conversation, and the next turn goes to the server with A's history.
    pg.locator("#chat-list .chat-open", has_text="Chat A question").click()
    assert pg.evaluate("window.kaitenChat.chatId") == chat_a
    assert pg.locator("article.msg-user .msg-body").all_inner_texts() == ["Chat A question"]
    a_answer = snapshot(pg)["messages"][1]["content"]
    send(pg, "Chat A follow-up")
    wait_reply_state(pg, ("done", "error"))
    req = stack.queued_request(snapshot(pg)["messages"][3]["request_id"])
    assert req.prompt_token_ids == stack.chat_ids([
        {"role": "user", "content": "Chat A question"}, {"role": "assistant", "content": a_answer},
        {"role": "user", "content": "Chat A follow-up"}])
    assert pg.locator("#chat-list .chat-open").first.inner_text() == "Chat A question"   # most recent now

    # On a phone the list is a drawer behind the Chats button; picking a chat closes it.
    pg.set_viewport_size({"width": 390, "height": 844})
    assert not pg.locator("#chats").is_visible()
    pg.click("#chats-toggle")
    assert pg.locator("#chats").is_visible()
    pg.screenshot(path=str(ARTIFACTS / "chat-phone-chats.png"))
    pg.locator("#chat-list .chat-open", has_text="Chat B question").click()
    assert not pg.locator("#chats").is_visible()
    assert pg.evaluate("window.kaitenChat.chatId") == chat_b
    pg.set_viewport_size({"width": 1280, "height": 800})

    # Delete B (open), then A (open after B went): the page moves to a fresh chat; storage forgets both.
    pg.locator("#chat-list .chat-item", has_text="Chat B question").locator(".chat-delete").click()
    assert pg.locator("#chat-list .chat-item", has_text="Chat B question").count() == 0
    assert pg.evaluate(f"localStorage.getItem('kaiten.chat.v2.{chat_b}')") is None
    assert pg.evaluate("window.kaitenChat.chatId") == chat_a                      # the next most recent
    assert pg.locator("article.msg-user .msg-body").first.inner_text() == "Chat A question"
    pg.locator("#chat-list .chat-item", has_text="Chat A question").locator(".chat-delete").click()
    assert pg.evaluate("window.kaitenChat.chatId") not in (chat_a, chat_b)
    assert pg.locator("article.msg").count() == 0
    pg.reload()
    pg.wait_for_selector("body[data-conn=open]")
    assert pg.locator("#chat-list .chat-item", has_text="Chat A question").count() == 0
    assert pg.locator("#chat-list .chat-item", has_text="Chat B question").count() == 0


def test_the_single_chat_of_older_versions_becomes_a_past_chat(browser, stack):
    context = browser.new_context(viewport={"width": 1280, "height": 800})
    pg = context.new_page()
    try:
        pg.goto(stack.url)
        legacy = {"savedAt": 1, "messages": [{"id": "u1", "role": "user", "content": "Old question"},
                                             {"id": "a1", "role": "assistant", "content": "Old *answer*",
                                              "state": "done"}]}
        pg.evaluate("(v) => { localStorage.clear(); localStorage.setItem('kaiten.chat.v1', JSON.stringify(v)); }", legacy)
        pg.reload()
        pg.wait_for_selector("body[data-conn=open]")
        assert pg.locator("#chat-list .chat-open").all_inner_texts() == ["Old question"]
        assert pg.locator("article.msg-assistant .msg-body em").inner_text() == "answer"
        assert pg.evaluate("localStorage.getItem('kaiten.chat.v1')") is None
    finally:
        context.close()


def test_model_picker_lists_the_models_and_sends_the_choice(page, stack):
    """Settings > Model: the models (and adapters) of GET /v1/status; the choice goes with each
    message, and the reply names it."""
    pg = page
    name = Path(stack.model_dir).name
    pg.wait_for_function("(n) => [...document.querySelectorAll('#model option')].some(o => o.value === n)",
                         arg=name, timeout=10_000)
    assert pg.eval_on_selector("#model", "s => s.options[0].value") == ""        # the server's default
    pg.select_option("#model", name)
    settings(pg, temperature=0, top_p=1.0, max_tokens=4, seed=0)
    send(pg, "Which model are you?")
    reply = wait_reply_state(pg, ("done", "error"))
    assert reply.get_attribute("data-state") == "done", reply.inner_text()
    assert snapshot(pg)["messages"][-1]["model"] == name
    assert json.loads(pg.evaluate("localStorage.getItem('kaiten.settings.v1')"))["model"] == name


def test_status_line_ignores_a_stale_answer(page, stack):
    """A slow /v1/status answer that arrives after a newer one never overwrites it (the page once
    read "running 1" after the reply had finished)."""
    pg = page
    held = []

    def hold_first(route):
        if not held:
            held.append(route)
        else:
            route.continue_()

    pg.wait_for_function("document.getElementById('engine-status').dataset.ok === 'true'", timeout=10_000)
    pg.route("**/v1/status", hold_first)
    pg.evaluate("window.kaitenChat.pollStatus()")          # held: answers late
    pg.wait_for_timeout(100)
    assert len(held) == 1
    pg.evaluate("window.kaitenChat.pollStatus()")          # real: running 0
    pg.wait_for_function("document.getElementById('engine-status').dataset.running === '0'", timeout=5_000)
    stale = dict(stack.gateway.status(), num_requests_running=1)
    held[0].fulfill(status=200, content_type="application/json", body=json.dumps(stale))
    pg.wait_for_timeout(500)
    assert pg.locator("#engine-status").get_attribute("data-running") == "0"
    assert "running 0" in pg.inner_text("#engine-status")


def test_status_line_reads_idle_soon_after_a_reply(page, stack):
    pg = page
    settings(pg, temperature=1.0, top_p=1.0, max_tokens=40, seed=2)
    send(pg, "Count for me")
    wait_reply_state(pg, ("done", "error"))
    stack.wait_running(0)
    # Without waiting for the regular two-second poll: the page polls again when a reply ends.
    pg.wait_for_function("document.getElementById('engine-status').dataset.running === '0'", timeout=3_000)


# ---------------------------------------------------------------------- a server with an API key
PAGE_KEY = "page-key=/é 1"          # characters a raw subprotocol token could not carry


@pytest.fixture(scope="module")
def keyed_gateway(stack):
    """A second gateway on the same Redis and engine, started with --api-key."""
    gw = GatewayThread(stack.model_dir, stack.redis_url, free_port(), api_keys=(PAGE_KEY,))
    gw.start()
    try:
        gw.wait_ready(timeout=60)
        yield gw
    finally:
        gw.stop()


def test_a_keyed_server_asks_for_the_key_then_chats(browser, keyed_gateway):
    context = browser.new_context(viewport={"width": 1280, "height": 800})
    pg = context.new_page()
    errors: list[str] = []
    pg.on("pageerror", lambda e: errors.append(str(e)))
    sockets: list[str] = []
    pg.on("websocket", lambda ws: sockets.append(ws.url))
    status_auth: list[str | None] = []
    pg.on("request", lambda r: status_auth.append(r.headers.get("authorization")) if r.url.endswith("/v1/status")
          else None)
    try:
        pg.goto(keyed_gateway.url + "/")
        # No key: a clear prompt, no connection, and the status line says why.
        pg.wait_for_selector("#auth[data-reason=refused]:not([hidden])", timeout=10_000)
        pg.wait_for_selector("body[data-conn=auth]", timeout=10_000)
        assert "needs an API key" in pg.inner_text("#auth-text")
        assert pg.evaluate("document.activeElement.id") == "api-key"
        assert pg.inner_text("#conn-text") == "API key needed"
        pg.wait_for_function("document.getElementById('engine-status').textContent.includes('API key needed')",
                             timeout=10_000)
        assert not pg.locator("#conn-banner").is_visible()            # no reconnect countdown
        pg.screenshot(path=str(ARTIFACTS / "chat-key-prompt.png"))

        # A wrong key: refused again, said so.
        pg.fill("#api-key", "not-the-key")
        pg.click("#api-key-save")
        pg.wait_for_function("document.getElementById('auth-text').textContent.includes('did not accept')",
                             timeout=10_000)
        assert pg.locator("#auth").is_visible() and pg.get_attribute("body", "data-conn") == "auth"

        # The right key: connected, the status answers, a chat streams.
        pg.fill("#api-key", PAGE_KEY)
        pg.press("#api-key", "Enter")
        pg.wait_for_selector("body[data-conn=open]", timeout=10_000)
        assert not pg.locator("#auth").is_visible()
        pg.wait_for_function("document.getElementById('engine-status').dataset.ok === 'true'", timeout=10_000)
        settings(pg, temperature=1.0, top_p=1.0, max_tokens=8, seed=1)
        send(pg, "Hello with a key")
        reply = wait_reply_state(pg, ("done", "error"))
        assert reply.get_attribute("data-state") == "done", reply.inner_text()
        assert status_auth[-1] == f"Bearer {PAGE_KEY}"
        assert sockets and all("api_key" not in u and "key" not in u.split("/v1/chat/ws")[1] for u in sockets)

        # This tab only (sessionStorage): a reload keeps it, a new tab asks again.
        assert pg.evaluate("sessionStorage.getItem('kaiten.apiKey')") == PAGE_KEY
        assert pg.evaluate("localStorage.getItem('kaiten.apiKey')") is None
        pg.reload()
        pg.wait_for_selector("body[data-conn=open]", timeout=10_000)
        other = context.new_page()
        other.goto(keyed_gateway.url + "/")
        other.wait_for_selector("body[data-conn=auth]", timeout=10_000)
        # "Remember in this browser" keeps it in localStorage, for every tab.
        other.fill("#api-key", PAGE_KEY)
        other.check("#api-key-remember")
        other.click("#api-key-save")
        other.wait_for_selector("body[data-conn=open]", timeout=10_000)
        assert other.evaluate("localStorage.getItem('kaiten.apiKey')") == PAGE_KEY
        third = context.new_page()
        third.goto(keyed_gateway.url + "/")
        third.wait_for_selector("body[data-conn=open]", timeout=10_000)
        # Settings > Set API key > Forget key: the key is gone, and the server asks for one again.
        third.click("#api-key-open")
        assert third.locator("#api-key-forget").is_visible()
        third.click("#api-key-forget")
        assert third.evaluate("localStorage.getItem('kaiten.apiKey')") is None
        third.reload()
        third.wait_for_selector("body[data-conn=auth]", timeout=10_000)
    finally:
        context.close()
    assert not errors, f"JavaScript errors on the page: {errors}"
