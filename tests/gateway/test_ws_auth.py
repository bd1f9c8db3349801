"""The WebSocket's key without the URL: the subprotocol pair ``kaiten.v1`` + ``kaiten.bearer.<base64url
key>`` (what a browser can send), next to the Authorization header and the older ``?api_key=``.
A real gateway (uvicorn) and Redis, the scripted fake engine, the `websockets` client."""
from __future__ import annotations

import json

import pytest
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

from gateway.api.http_common import WS_SUBPROTOCOL, bearer_subprotocol, token_from
from tests.support.gateway_support import FakeEngine, start_gateway

pytestmark = pytest.mark.timeout(60)
KEY = "k3y=/with spaces,é"           # no legal subprotocol token as it is: base64url makes it one


@pytest.fixture(scope="module")
def gateways(redis_server, tiny_model_dir):
    eng = FakeEngine(redis_server.url, engine_id="fake-ws-auth", model=tiny_model_dir.name).start()
    keyed = start_gateway(redis_server.url, tiny_model_dir, api_keys=("other-key", KEY))
    open_ = start_gateway(redis_server.url, tiny_model_dir)
    try:
        yield {"keyed": keyed, "open": open_}
    finally:
        keyed.stop()
        open_.stop()
        eng.stop()


def _url(srv, query: str = "") -> str:
    return srv.ws_url + "/v1/chat/ws" + query


def _refused(ws) -> tuple[dict, int]:
    """The error frame a refused socket gets, and the close code that follows it."""
    first = json.loads(ws.recv(5))
    with pytest.raises(ConnectionClosed) as closed:
        ws.recv(5)
    return first, closed.value.rcvd.code


def test_subprotocol_round_trip():
    proto = bearer_subprotocol(KEY)
    assert proto.startswith("kaiten.bearer.") and "=" not in proto and " " not in proto and "/" not in proto
    assert token_from({}, None, [WS_SUBPROTOCOL, proto]) == KEY
    assert token_from({}, None, ["kaiten.bearer.!!not base64!!"]) == ""
    assert token_from({"authorization": "Bearer h"}, {"api_key": "q"}, [proto]) == "h"      # the header first
    assert token_from({}, {"api_key": "q"}, [WS_SUBPROTOCOL]) == "q"


def test_the_right_key_as_a_subprotocol_streams_a_chat(gateways):
    with connect(_url(gateways["keyed"]), proxy=None, subprotocols=[WS_SUBPROTOCOL, bearer_subprotocol(KEY)]) as ws:
        assert ws.subprotocol == WS_SUBPROTOCOL
        answered = ws.response.headers.get_all("Sec-WebSocket-Protocol")
        assert answered == [WS_SUBPROTOCOL]                        # the key is never echoed back
        ws.send(json.dumps({"type": "chat", "id": "a", "messages": [{"role": "user", "content": "hi"}],
                            "max_tokens": 3}))
        frames = []
        while not frames or frames[-1]["type"] not in ("done", "error"):
            frames.append(json.loads(ws.recv(10)))
        assert [f["type"] for f in frames][0] == "start" and frames[-1]["type"] == "done", frames
        assert frames[-1]["usage"]["completion_tokens"] == 3


@pytest.mark.parametrize("offered", [
    [WS_SUBPROTOCOL, bearer_subprotocol("wrong")],
    [WS_SUBPROTOCOL, "kaiten.bearer.%%%"],                            # not base64url
    [WS_SUBPROTOCOL],                                                  # no key
], ids=["wrong-key", "malformed", "no-key"])
def test_a_wrong_or_missing_key_is_refused_with_401_then_1008(gateways, offered):
    with connect(_url(gateways["keyed"]), proxy=None, subprotocols=offered) as ws:
        assert ws.subprotocol == WS_SUBPROTOCOL                        # so a browser sees the error frame
        first, code = _refused(ws)
    assert first["type"] == "error" and first["status"] == 401 and first["error"]["code"] == "invalid_api_key"
    assert code == 1008


def test_no_subprotocol_at_all_is_refused_the_same_way(gateways):
    with connect(_url(gateways["keyed"]), proxy=None) as ws:
        assert ws.subprotocol is None
        first, code = _refused(ws)
    assert first["status"] == 401 and code == 1008


def test_the_bearer_subprotocol_alone_works_for_clients_that_are_no_browser(gateways):
    with connect(_url(gateways["keyed"]), proxy=None, subprotocols=[bearer_subprotocol(KEY)]) as ws:
        assert ws.subprotocol is None                                 # nothing to answer but the key
        ws.send(json.dumps({"type": "ping"}))
        assert json.loads(ws.recv(5)) == {"type": "pong"}


def test_the_header_and_the_query_key_still_work(gateways):
    with connect(_url(gateways["keyed"]), proxy=None, additional_headers={"Authorization": "Bearer other-key"}) as ws:
        ws.send(json.dumps({"type": "ping"}))
        assert json.loads(ws.recv(5)) == {"type": "pong"}
    with connect(_url(gateways["keyed"], "?api_key=other-key"), proxy=None) as ws:
        ws.send(json.dumps({"type": "ping"}))
        assert json.loads(ws.recv(5)) == {"type": "pong"}


def test_a_keyless_gateway_answers_a_page_that_offers_a_key(gateways):
    """A browser that offered subprotocols fails a handshake answered with none: a key-less gateway
    selects kaiten.v1 too (and ignores the key)."""
    with connect(_url(gateways["open"]), proxy=None, subprotocols=[WS_SUBPROTOCOL, bearer_subprotocol("x")]) as ws:
        assert ws.subprotocol == WS_SUBPROTOCOL
        ws.send(json.dumps({"type": "ping"}))
        assert json.loads(ws.recv(5)) == {"type": "pong"}
