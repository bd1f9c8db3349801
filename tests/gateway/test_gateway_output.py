"""The gateway's output processor (detokenizing, stop strings, logprob strings, once per TokenBatch),
its liveness key and its bounded Redis pool."""
from __future__ import annotations

import asyncio
import random
import time

import httpx
import pytest
import redis

from gateway.api.errors import GenerationError
from gateway.metrics import GatewayMetrics
from gateway.models import ServedModel
from gateway.backend.output import OutputProcessor, Piece, RequestState, StopChecker
from shared import names
from shared.protocol import Delta, TokenLogprob
from tests.support.engine_support import wait_until
from tests.support.gateway_support import FakeEngine, start_gateway
from tests.support.tiny_model import _CORPUS
from tokenizer_service import ChatTokenizer

pytestmark = pytest.mark.timeout(120)
FFFD = "\ufffd"


@pytest.fixture(scope="module")
def tok(tiny_model_dir) -> ChatTokenizer:
    return ChatTokenizer.from_pretrained(tiny_model_dir)


class Harness:
    """An OutputProcessor over real states; records what it fails and aborts."""

    def __init__(self, tok: ChatTokenizer):
        self.tok = tok
        self.streams: dict[str, RequestState] = {}
        self.aborted: list[str] = []
        self.failed: list[tuple[str, GenerationError]] = []
        self.counters = {k: 0 for k in ("deltas", "unknown_request", "bad_messages", "duplicates", "gaps",
                                        "foreign_engine")}
        self.model = ServedModel("m", text_tokenizer=tok, metrics=GatewayMetrics().model("m"))
        self.proc = OutputProcessor(self.counters, finish=self._finish, fail=self._fail, abort=self.aborted.extend)

    def _finish(self, s: RequestState) -> None:
        self.streams.pop(s.request_id, None)
        s.done = True

    def _fail(self, s: RequestState, e: GenerationError) -> None:
        self._finish(s)
        self.failed.append((s.request_id, e))
        s.queue.put_nowait(e)

    def add(self, rid: str, prompt: list[int], stop: list[str] = (), logprobs: bool = False) -> RequestState:
        s = RequestState(rid, 0, prompt, 1e18, self.tok.detokenizer(prompt), StopChecker(list(stop)),
                         want_logprobs=logprobs, model=self.model)
        self.streams[rid] = s
        return s

    def batch(self, deltas: list[Delta]) -> None:
        self.proc.process("eng", deltas, self.streams)


def drain(s: RequestState) -> list[Piece]:
    out = []
    while not s.queue.empty():
        out.append(s.queue.get_nowait())
    return out


def feed(h: Harness, plan: dict[str, list[int]], rng: random.Random) -> None:
    """Send every request's tokens in random-sized deltas, several requests per TokenBatch."""
    pos = {rid: 0 for rid in plan}
    seq = {rid: 0 for rid in plan}
    while pos:
        deltas = []
        for rid in rng.sample(sorted(pos), k=rng.randint(1, len(pos))):
            ids = plan[rid]
            k = rng.choice([1, 1, 1, 2, 3])
            chunk, pos[rid] = ids[pos[rid]:pos[rid] + k], pos[rid] + k
            last = pos[rid] >= len(ids)
            deltas.append(Delta(rid, seq[rid], chunk, finish_reason="length" if last else None))
            seq[rid] += 1
            if last:
                del pos[rid]
        h.batch(deltas)


def test_text_equals_full_decode_interleaved(tok):
    """Many requests interleaved in batches, random delta sizes: the text is decode(all tokens), and
    no piece carries half a character."""
    rng = random.Random(0)
    h = Harness(tok)
    prompt = tok.encode("Some prompt: ")
    plan = {}
    for i in range(60):
        start = rng.randrange(len(_CORPUS))
        plan[f"r{i}"] = tok.encode(_CORPUS[start:start + rng.randint(1, 150)]) + ([tok.eos_token_id] if i % 3 == 0 else [])
    states = {rid: h.add(rid, prompt) for rid in plan}
    feed(h, plan, rng)
    for rid, ids in plan.items():
        pieces = drain(states[rid])
        assert all(isinstance(p, Piece) for p in pieces)
        assert not any(FFFD in p.text for p in pieces)
        assert "".join(p.text for p in pieces) == tok.decode(ids)
        assert pieces[-1].finish_reason == "length" and states[rid].token_ids == ids
    assert not h.streams and not h.aborted and not h.failed


def test_multibyte_characters_split_over_tokens(tok):
    text = "🙂 東京は日本の首都です ü"
    ids = tok.encode(text)
    assert sum(tok.decode([i]).endswith(FFFD) for i in ids) > 3      # characters really are split
    h = Harness(tok)
    s = h.add("a", [])
    for i, t in enumerate(ids):
        h.batch([Delta("a", i, [t], finish_reason="length" if i == len(ids) - 1 else None)])
    pieces = drain(s)
    assert "" in [p.text for p in pieces[:-1]]                     # something was held back
    assert all(FFFD not in p.text for p in pieces)
    assert "".join(p.text for p in pieces) == text


def test_unfinished_character_at_the_end_is_flushed(tok):
    emoji = tok.encode("a🙂")
    h = Harness(tok)
    s = h.add("a", [])
    h.batch([Delta("a", 0, emoji[:-1])])
    h.batch([Delta("a", 1, [], finish_reason="length")])
    assert "".join(p.text for p in drain(s)) == tok.decode(emoji[:-1])    # "a" and U+FFFD, like decode()


@pytest.mark.parametrize("text,stops,expected", [
    ("Hello world, fox jumps", ["fox"], "Hello world, "),
    ("one two three", ["two", "e t"], "on"),                 # the match completing first wins
    ("東京は日本の首都です", ["日本"], "東京は"),                   # a multi-byte stop string
    ("abc\n\nUser: hi", ["\n\nUser:"], "abc"),
])
def test_stop_strings_across_token_boundaries(tok, text, stops, expected):
    ids = tok.encode(text) + tok.encode(" and more text after it")
    for sizes in ([1], [2, 1], [3]):
        h = Harness(tok)
        s = h.add("a", [], stop=stops)
        i = seq = 0
        while i < len(ids):
            k = sizes[seq % len(sizes)]
            h.batch([Delta("a", seq, ids[i:i + k])])
            i, seq = i + k, seq + 1
        pieces = drain(s)
        assert "".join(p.text for p in pieces) == expected
        assert pieces[-1].finish_reason == "stop" and s.finish_reason == "stop"
        assert not any(stops[0][:2] in p.text for p in pieces if stops[0][:2] not in expected)
        assert h.aborted == ["a"] and s.abort_sent       # the engine is told to stop once
        assert h.counters["unknown_request"] > 0         # later deltas are dropped
        assert not h.streams


def test_stop_string_held_back_until_known(tok):
    """Text that could start a stop string is not sent until it is known not to be one."""
    h = Harness(tok)
    s = h.add("a", [], stop=["STOP"])
    seq = 0
    for part in ("abc S", "T", "x rest"):
        h.batch([Delta("a", seq, tok.encode(part))])
        seq += 1
    texts = [p.text for p in drain(s)]
    assert texts[0] == "abc " and texts[1] == "" and "".join(texts) == "abc STx rest"
    h.batch([Delta("a", seq, tok.encode(" end"), finish_reason="length")])
    assert "".join(p.text for p in drain(s)) == " end" and not h.aborted


def test_logprob_strings_one_batched_call_per_step(tok, monkeypatch):
    calls = []
    real = tok.token_strings
    monkeypatch.setattr(tok, "token_strings", lambda ids: (calls.append(list(ids)), real(ids))[1])
    h = Harness(tok)
    a, b, c = h.add("a", [], logprobs=True), h.add("b", [], logprobs=True), h.add("c", [])
    ida, idb = tok.encode("Émilie 🙂"), tok.encode("hello")
    lp = lambda t: TokenLogprob(t, -0.5, [(t, -0.5), (5, -1.0), (2, -2.0)])   # noqa: E731
    h.batch([Delta("a", 0, ida[:3], [lp(t) for t in ida[:3]]),
             Delta("b", 0, idb[:2], [lp(t) for t in idb[:2]]),
             Delta("c", 0, idb[:2])])
    assert len(calls) == 1 and sorted(calls[0]) == sorted(set(ida[:3] + idb[:2] + [5, 2]))
    pa, pb, pc = drain(a)[0], drain(b)[0], drain(c)[0]
    assert [x.token for x in pa.logprobs] == real(ida[:3])
    assert [x.token for x in pb.logprobs] == [tok.decode([t]) for t in idb[:2]]
    assert pb.logprobs[0].top == [(tok.decode([idb[0]]), -0.5), (tok.decode([5]), -1.0), ("<|im_end|>", -2.0)]
    assert pc.logprobs is None
    h.batch([Delta("c", 1, [7])])
    assert len(calls) == 1                    # no logprobs asked for in that batch: no call


def test_seq_checks(tok):
    h = Harness(tok)
    s = h.add("a", [])
    ids = tok.encode("hello world")
    h.batch([Delta("a", 0, ids[:1]), Delta("a", 0, ids[:1]), Delta("a", 1, ids[1:2])])   # a repeat is dropped
    assert h.counters["duplicates"] == 1 and s.next_seq == 2
    h.batch([Delta("a", 5, ids[2:])])                                                     # a gap fails it
    assert h.failed and h.failed[0][1].code == "stream_gap"
    assert "".join(p.text for p in drain(s) if isinstance(p, Piece)) == tok.decode(ids[:2])


def test_engine_error_and_abort_deltas(tok):
    h = Harness(tok)
    s1, s2 = h.add("a", []), h.add("b", [])
    h.batch([Delta("a", 0, [], finish_reason="error", error="bad"), Delta("b", 0, [], finish_reason="abort")])
    assert [e.code for _, e in h.failed] == ["engine_rejected", "aborted"]
    assert s1.engine_finished and s2.engine_finished


# ---------------------------------------------------------------------- with Redis
def _gw_connections(r: redis.Redis, gateway_id: str) -> int:
    return sum(1 for c in r.client_list() if c.get("name") == f"kaiten-gateway-{gateway_id}")


def test_liveness_key_and_bounded_pool(redis_server, tiny_model_dir):
    """The liveness key lives while the gateway runs and is gone after it stops; 200 concurrent
    requests share at most redis_max_connections command connections."""
    r = redis.Redis.from_url(redis_server.url)
    r.flushall()
    eng = FakeEngine(redis_server.url, engine_id="fake-pool", model=tiny_model_dir.name, step_s=0.002).start()
    srv = start_gateway(redis_server.url, tiny_model_dir, redis_max_connections=4, max_queued_requests=1000)
    try:
        gid = srv.gw.gateway_id
        key = names.gateway_alive_key(gid)
        assert r.get(key) == gid.encode()
        assert 0 < r.pttl(key) <= names.GATEWAY_ALIVE_TTL_S * 1000
        # Refreshed: still there after several TTLs.
        deadline = time.monotonic() + 2.5 * names.GATEWAY_ALIVE_TTL_S
        while time.monotonic() < deadline:
            assert r.exists(key)
            time.sleep(0.1)

        peak = 0

        async def run() -> list[int]:
            nonlocal peak
            async with httpx.AsyncClient(base_url=srv.url, timeout=60, trust_env=False,
                                         limits=httpx.Limits(max_connections=250)) as c:
                async def one(i: int) -> int:
                    resp = await c.post("/v1/completions", json={"prompt": f"hello {i}", "max_tokens": 3})
                    return resp.status_code

                async def watch() -> None:
                    nonlocal peak
                    while True:
                        peak = max(peak, await asyncio.to_thread(_gw_connections, r, gid))
                        await asyncio.sleep(0.02)

                w = asyncio.create_task(watch())
                try:
                    return await asyncio.gather(*(one(i) for i in range(200)))
                finally:
                    w.cancel()

        codes = asyncio.run(run())
        assert codes == [200] * 200
        after = _gw_connections(r, gid)
        assert 1 <= peak <= 4 and after <= 4, (peak, after)
    finally:
        srv.stop()
        eng.stop()
    assert not srv.thread.is_alive(), "the gateway did not stop within 15 s"
    assert not r.exists(key)                          # deleted on a clean stop


def test_liveness_key_expires_without_refresh(redis_server, tiny_model_dir):
    r = redis.Redis.from_url(redis_server.url)
    eng = FakeEngine(redis_server.url, engine_id="fake-ttl", model=tiny_model_dir.name).start()
    srv = start_gateway(redis_server.url, tiny_model_dir)
    try:
        key = names.gateway_alive_key(srv.gw.gateway_id)
        assert r.exists(key)
        # A gateway that stops refreshing (hung, killed): the key is gone within the TTL.
        srv.gw.alive.stop_refreshing()
        assert wait_until(lambda: not r.exists(key), timeout=names.GATEWAY_ALIVE_TTL_S + 1.0)
    finally:
        srv.stop()
        eng.stop()


def test_liveness_key_outlives_a_blocked_event_loop(redis_server, tiny_model_dir):
    """A gateway whose event loop is busy for longer than the key's TTL (a load spike) is still
    alive to the engines: the key is refreshed by its own thread and connection."""
    r = redis.Redis.from_url(redis_server.url)
    eng = FakeEngine(redis_server.url, engine_id="fake-busy", model=tiny_model_dir.name).start()
    srv = start_gateway(redis_server.url, tiny_model_dir)
    try:
        key = names.gateway_alive_key(srv.gw.gateway_id)
        srv.gw._tasks[0].get_loop().call_soon_threadsafe(time.sleep, 2.5 * names.GATEWAY_ALIVE_TTL_S)
        deadline = time.monotonic() + 2.5 * names.GATEWAY_ALIVE_TTL_S
        while time.monotonic() < deadline:
            assert r.exists(key)
            time.sleep(0.05)
    finally:
        srv.stop()
        eng.stop()


def test_requests_are_added_without_maxlen(redis_server, tiny_model_dir):
    """XADD of requests carries no MAXLEN (a trim could drop entries nobody served yet)."""
    r = redis.Redis.from_url(redis_server.url)
    eng = FakeEngine(redis_server.url, engine_id="fake-maxlen", model=tiny_model_dir.name).start()
    srv = start_gateway(redis_server.url, tiny_model_dir)
    try:
        with r.monitor() as m:
            resp = httpx.post(srv.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=30,
                              trust_env=False)
            assert resp.status_code == 200
            cmds = []
            for _ in range(200):
                cmd = m.next_command()["command"]
                cmds.append(cmd)
                if cmd.startswith("XADD " + eng.stream):
                    break
        xadds = [c for c in cmds if c.startswith("XADD " + eng.stream + " ")]
        assert xadds and "MAXLEN" not in xadds[0].upper()
        sets = [i for i, c in enumerate(cmds) if c.startswith("SET " + names.gateway_alive_key(srv.gw.gateway_id))]
        assert sets and sets[0] < cmds.index(xadds[0])     # the liveness key is set before the XADD
    finally:
        srv.stop()
        eng.stop()


def test_stop_checker_include_stop_and_min_tokens():
    from gateway.backend.output import StopChecker
    c = StopChecker(["ab"], include_stop=True)
    assert c.feed("xxab yy", 1) == ("xxab", True) and c.stopped == "ab"
    c = StopChecker(["ab"], min_tokens=2)
    assert c.feed("ab", 1) == ("ab", False)            # within min_tokens: no match
    assert c.feed("a", 2) == ("a", False)
    assert c.feed("b x ab", 3) == ("b x ", True)     # the "a" of the min_tokens text does not start one


def test_fencing_a_moved_request_ignores_its_old_engine(tok):
    """After a move (rekeyed to <origin>~1, now held by eng-b): the old engine's late deltas for
    the old id are unknown, its deltas for the new id are foreign; the client sees neither."""
    h = Harness(tok)
    s = h.add("r", [1, 2])
    h.proc.process("eng-a", [Delta("r", 0, [40])], h.streams, ["r"])
    h.streams.pop("r")
    s.request_id, s.origin_id, s.engine_id = "r~1", "r", None      # what ReplyRouter.rekey does
    h.streams["r~1"] = s
    h.proc.process("eng-b", [Delta("r~1", 1, [41])], h.streams, ["r~1"])
    h.proc.process("eng-a", [Delta("r", 1, [99]), Delta("r", 2, [98])], h.streams)     # healed, late
    h.proc.process("eng-a", [Delta("r~1", 2, [97])], h.streams)                        # not its engine
    h.proc.process("eng-b", [Delta("r~1", 2, [42], finish_reason="length")], h.streams)
    assert s.token_ids == [40, 41, 42] and not h.failed
    assert h.counters["unknown_request"] == 2 and h.counters["foreign_engine"] == 1
    assert [p.finish_reason for p in drain(s)][-1] == "length"


def test_fencing_a_stale_handoff_moves_nothing():
    """A shutdown handoff from an engine that no longer holds the request (delayed across a
    partition), or naming an id moved already, is counted stale; the holder's own one moves it."""
    from gateway.backend.router import ReplyRouter
    from shared.protocol import Handoff, encode
    router = ReplyRouter(None, "gw", monitor=None, engine_timeout=5.0)
    moved: list[tuple[list[str], str]] = []
    router.on_move = lambda states, why, abort_old: moved.append(([s.request_id for s in states], why))
    s = RequestState("r~1", 0, [1], 1e18, None, StopChecker([]))
    s.engine_id = "eng-b"
    router.register(s)
    router._on_message(encode(Handoff("eng-a", ["r~1"], "shutdown")))
    router._on_message(encode(Handoff("eng-a", ["r"], "shutdown")))
    assert not moved and router.counters["stale_handoffs"] == 2
    router._on_message(encode(Handoff("eng-b", ["r~1"], "shutdown")))
    assert moved == [(["r~1"], "engine eng-b is shutting down")] and router.counters["handoffs"] == 1
