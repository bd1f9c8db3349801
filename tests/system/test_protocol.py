"""The wire protocol (shared/protocol.py) and the engine's publisher (engine_worker/publisher.py):
pure functions, no Redis."""
from __future__ import annotations

import msgpack
import pytest

from engine_worker.engine.llm_engine import RequestOutput
from engine_worker.publisher import Publisher
from shared import names
from shared.protocol import (PROTOCOL_VERSION, Delta, GenerateRequest, Handoff, ProtocolError, TokenBatch,
                             decode, encode)


def test_continuation_fields_round_trip_and_are_left_out_at_their_default():
    req = GenerateRequest("r~1", "gw", [1, 2, 3, 4], {"max_tokens": 3}, num_generated=2, first_seq=5)
    assert decode(encode(req)) == req
    plain = msgpack.unpackb(encode(GenerateRequest("r", "gw", [1], {})), raw=False)
    assert plain["v"] == PROTOCOL_VERSION and "num_generated" not in plain and "first_seq" not in plain
    with pytest.raises(ProtocolError, match="num_generated"):
        decode(encode(GenerateRequest("r", "gw", [1, 2], {}, num_generated=2)))
    with pytest.raises(ProtocolError, match="first_seq"):
        decode(encode(GenerateRequest("r", "gw", [1, 2], {}, first_seq=-1)))


def test_lora_name_round_trips_and_is_left_out_for_the_base_model():
    req = GenerateRequest("r", "gw", [1, 2], {}, lora_name="sql-adapter")
    assert decode(encode(req)) == req
    assert "lora_name" not in msgpack.unpackb(encode(GenerateRequest("r", "gw", [1], {})), raw=False)
    body = msgpack.unpackb(encode(req), raw=False)
    with pytest.raises(ProtocolError, match="lora_name"):
        decode(msgpack.packb({**body, "lora_name": 7}))


def test_version_1_messages_still_decode():
    body = {"v": 1, "t": "tokens", "engine_id": "e", "deltas": [{"request_id": "r", "seq": 0, "token_ids": [7]}]}
    batch = decode(msgpack.packb(body))
    assert batch.admitted == [] and batch.deltas[0].token_ids == [7]
    with pytest.raises(ProtocolError, match="version"):
        decode(msgpack.packb({**body, "v": PROTOCOL_VERSION + 1}))


def test_handoff_round_trips_and_is_validated():
    msg = Handoff("e1", ["a", "b"], "shutdown")
    assert decode(encode(msg)) == msg
    for bad in ({"reason": "bored"}, {"request_ids": "a"}, {"request_ids": [1]}):
        body = {"v": PROTOCOL_VERSION, "t": "handoff", "engine_id": "e1", "request_ids": ["a"], "reason": "shutdown"}
        with pytest.raises(ProtocolError, match="handoff"):
            decode(msgpack.packb({**body, **bad}))


def _out(rid: str, tokens: list[int], finish: str | None = None) -> RequestOutput:
    return RequestOutput(rid, tokens, None, finish, None, 3, 0, len(tokens))


def test_publisher_admits_continues_seqs_and_hands_off_after_the_tokens():
    pub = Publisher("e1")
    pub.admitted("gw", "r~1", first_seq=7)
    pub.add("gw", _out("r~1", [5]))
    pub.handoff("gw", "r~1", "shutdown")
    out = pub.take()
    channel = names.reply_channel("gw")
    assert [c for c, _ in out.messages] == [channel, channel]
    batch, handoff = (decode(m) for _, m in out.messages)
    assert isinstance(batch, TokenBatch) and batch.admitted == ["r~1"]
    assert batch.deltas == [Delta("r~1", 7, [5])]
    assert handoff == Handoff("e1", ["r~1"], "shutdown")
    assert not pub.has_outgoing() and pub.take().messages == []      # nothing left for r~1
