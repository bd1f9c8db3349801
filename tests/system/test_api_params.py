"""Issue 11's sampling parameters, endpoints and chat-template options, each checked by its effect:
the official `openai` SDK (and httpx for vLLM's extra routes) against a real gateway and engine."""
from __future__ import annotations

import json
import logging

import httpx
import pytest

from tests.support.engine_support import e2e_worker, wait_until
from tests.support.gateway_support import openai_client, post_stream, start_gateway
from tests.support.redis_server import RedisServer

pytestmark = pytest.mark.timeout(180)

PROMPT = [40, 41, 42, 43, 44, 45]
EOS = 2                                    # <|im_end|> in the tiny tokenizer
NAMED_TEMPLATE = "{% for m in messages %}{{ m.get('name', m['role']) }}: {{ m['content'] }}\n{% endfor %}"


@pytest.fixture(scope="module")
def stack(tiny_model_dir, tmp_path_factory):
    """One engine, a gateway, and a second gateway with a --chat-template file that renders names."""
    server = RedisServer().start()
    w = e2e_worker(server.url, tiny_model_dir, "params-main").start()
    srv = start_gateway(server.url, tiny_model_dir, engine_timeout=3.0)
    template = tmp_path_factory.mktemp("template") / "named.jinja"
    template.write_text(NAMED_TEMPLATE)
    named = start_gateway(server.url, tiny_model_dir, engine_timeout=3.0, chat_template=str(template))
    wait_until(lambda: srv.gw.monitor.live_engines() and named.gw.monitor.live_engines(), 10)
    yield {"srv": srv, "named": named, "model": tiny_model_dir.name, "client": openai_client(srv)}
    named.stop()
    srv.stop()
    w.stop()
    server.stop()


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    from engine_worker import LLM
    return LLM(str(tiny_model_dir), dtype="float32", kv_cache_memory="4MiB")


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(tiny_model_dir))


def _complete(stack, **kw):
    kw = {"model": stack["model"], "prompt": PROMPT, "max_tokens": 6, "temperature": 0} | kw
    return stack["client"].completions.create(**kw)


def _greedy_ids(llm, n=8, prompt=PROMPT) -> list[int]:
    from engine_worker import SamplingParams
    return llm.generate([prompt], SamplingParams(temperature=0, max_tokens=n))[0].token_ids


# ---------------------------------------------------------------------- sampling
@pytest.mark.parametrize("temperature", [0, 1.0])
def test_logit_bias_forces_a_token(stack, tok, temperature):
    out = _complete(stack, temperature=temperature, seed=3, logit_bias={"77": 100})
    assert out.choices[0].text == tok.decode([77] * 6) and out.usage.completion_tokens == 6


def test_logit_bias_bans_the_greedy_token(stack, llm, tok):
    first = _greedy_ids(llm)[0]
    out = _complete(stack, logit_bias={str(first): -100}, logprobs=0,
                    extra_body={"return_tokens_as_token_ids": True})
    assert f"token_id:{first}" not in out.choices[0].logprobs.tokens


def test_min_tokens_holds_back_eos(stack):
    bias = {str(EOS): 100}
    plain = _complete(stack, logit_bias=bias)
    assert plain.choices[0].finish_reason == "stop" and plain.usage.completion_tokens == 1
    assert plain.choices[0].stop_reason is None                      # EOS: no stop_reason
    held = _complete(stack, logit_bias=bias, extra_body={"min_tokens": 3, "skip_special_tokens": False})
    assert held.usage.completion_tokens == 4 and held.choices[0].finish_reason == "stop"
    assert "<|im_end|>" not in held.choices[0].text           # the EOS that stopped it is not text
    shown = _complete(stack, logit_bias=bias, extra_body={"min_tokens": 3, "skip_special_tokens": False,
                                                          "include_stop_str_in_output": True})
    assert shown.choices[0].text == held.choices[0].text + "<|im_end|>"
    assert _complete(stack, logit_bias=bias, extra_body={"min_tokens": 3}).choices[0].text == held.choices[0].text


def test_min_p_one_is_greedy(stack, llm, tok):
    greedy = tok.decode(_greedy_ids(llm, 6))
    for seed in range(3):
        out = _complete(stack, temperature=1.0, seed=seed, extra_body={"min_p": 1.0})
        assert out.choices[0].text == greedy


def test_stop_reason_for_a_stop_token_id_and_a_stop_string(stack, llm, tok):
    ids = _greedy_ids(llm)
    out = _complete(stack, max_tokens=8, extra_body={"stop_token_ids": [ids[2]]})
    assert out.choices[0].finish_reason == "stop" and out.choices[0].stop_reason == ids[2]
    text = tok.decode(ids)
    stop = text[len(tok.decode(ids[:3])):][:2]
    assert stop.strip(), "the greedy text has no usable stop string"
    for stream in (False, True):
        kw = dict(max_tokens=8, stop=[stop], stream=stream)
        if stream:
            chunks = list(_complete(stack, **kw))
            got = "".join(c.choices[0].text for c in chunks if c.choices)
            last = next(c.choices[0] for c in reversed(chunks) if c.choices and c.choices[0].finish_reason)
        else:
            last = _complete(stack, **kw).choices[0]
            got = last.text
        assert got == text[:text.index(stop)] and last.stop_reason == stop and last.finish_reason == "stop"
    inc = _complete(stack, max_tokens=8, stop=[stop], extra_body={"include_stop_str_in_output": True})
    assert inc.choices[0].text == text[:text.index(stop) + len(stop)]


def test_stop_reason_in_chat_streamed_and_not(stack, llm, tok):
    messages = [{"role": "user", "content": "Hello"}]
    ids = list(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False))
    first = _greedy_ids(llm, 4, ids)[0]
    client = stack["client"]
    out = client.chat.completions.create(model=stack["model"], messages=messages, max_tokens=4, temperature=0,
                                         extra_body={"stop_token_ids": [first]})
    assert out.choices[0].stop_reason == first and out.choices[0].message.content == ""
    chunks = list(client.chat.completions.create(model=stack["model"], messages=messages, max_tokens=4,
                                                 temperature=0, stream=True, extra_body={"stop_token_ids": [first]}))
    final = [c.choices[0] for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(final) == 1 and final[0].stop_reason == first


def test_continuous_usage_stats(stack):
    chunks = list(_complete(stack, max_tokens=5, stream=True, stream_options={"include_usage": True,
                                                                               "continuous_usage_stats": True}))
    with_choices = [c for c in chunks if c.choices]
    assert with_choices and all(c.usage is not None for c in with_choices)
    counts = [c.usage.completion_tokens for c in with_choices]
    assert counts == sorted(counts) and counts[0] >= 1 and counts[-1] == chunks[-1].usage.completion_tokens == 5
    assert all(c.usage.prompt_tokens == len(PROMPT) for c in chunks)
    plain = list(_complete(stack, max_tokens=5, stream=True, stream_options={"include_usage": True}))
    assert all(c.usage is None for c in plain[:-1]) and plain[-1].usage.completion_tokens == 5


def test_logprob_tokens_name_special_and_partial_tokens(stack, tok):
    # The sampled token is forced with logit_bias: the byte 0xE2 alone (a partial character), then EOS.
    e2 = tok.convert_tokens_to_ids("\u00e2")
    out = stack["client"].chat.completions.create(
        model=stack["model"], messages=[{"role": "user", "content": "Hi"}], max_tokens=2, temperature=0,
        logprobs=True, top_logprobs=3, logit_bias={str(e2): 100}, extra_body={"min_tokens": 1})
    first = out.choices[0].logprobs.content[0]
    assert first.token == "bytes:\\xe2" and first.bytes == [0xE2]
    out = _complete(stack, max_tokens=1, logit_bias={str(EOS): 100}, logprobs=2)
    assert out.choices[0].logprobs.tokens == ["<|im_end|>"]
    assert "" not in out.choices[0].logprobs.top_logprobs[0]


def test_every_token_has_its_own_logprob_name(tiny_model_dir):
    from tokenizer_service import ChatTokenizer
    t = ChatTokenizer.from_pretrained(tiny_model_dir)
    names = t.token_strings(list(range(t.vocab_size)))
    assert len(set(names)) == t.vocab_size and "" not in names


# ---------------------------------------------------------------------- request fields
def test_unknown_fields_are_ignored_with_one_warning(stack, caplog):
    with caplog.at_level(logging.WARNING, logger="kaiten.gateway"):
        out = _complete(stack, extra_body={"frobnicate": 1, "wibble": {"x": 2}})
    assert out.choices[0].finish_reason in ("stop", "length")
    lines = [r.getMessage() for r in caplog.records if "unknown request fields" in r.getMessage()]
    assert lines == ["ignoring unknown request fields: frobnicate, wibble"]


def test_known_unsupported_field_is_a_400(stack):
    import openai
    with pytest.raises(openai.BadRequestError, match="use_beam_search"):
        _complete(stack, extra_body={"use_beam_search": True})
    assert _complete(stack, extra_body={"use_beam_search": False}).choices   # its "off" value passes


# ---------------------------------------------------------------------- endpoints
def test_tokenize_detokenize_version_ping(stack, tok):
    with httpx.Client(base_url=stack["srv"].url, trust_env=False, timeout=10) as c:
        r = c.post("/tokenize", json={"model": stack["model"], "prompt": "Hello world", "return_token_strs": True})
        body = r.json()
        want = tok.encode("Hello world", add_special_tokens=True)
        assert r.status_code == 200 and body["tokens"] == want and body["count"] == len(want)
        assert body["max_model_len"] == 512 and body["token_strs"] == tok.convert_ids_to_tokens(want)
        r = c.post("/detokenize", json={"model": stack["model"], "tokens": want})
        assert r.json() == {"prompt": "Hello world"}
        msgs = [{"role": "user", "content": "Hi"}]
        chat = c.post("/tokenize", json={"messages": msgs}).json()
        assert chat["tokens"] == tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True,
                                                         return_dict=False)
        assert chat["token_strs"] is None
        for bad in ({"tokens": [10**6]}, {"tokens": "abc"}):
            r = c.post("/detokenize", json=bad)
            assert r.status_code == 400 and r.json()["error"]["param"] == "tokens"
        assert c.post("/tokenize", json={"prompt": 5}).status_code == 400
        assert c.get("/version").json()["version"]
        assert c.get("/ping").status_code == 200 and c.post("/ping").status_code == 200


def test_tokenize_is_behind_the_api_key(tiny_model_dir, redis_url):
    srv = start_gateway(redis_url, tiny_model_dir, api_keys=("k1",))
    try:
        with httpx.Client(base_url=srv.url, trust_env=False, timeout=10) as c:
            assert c.post("/tokenize", json={"prompt": "hi"}).status_code == 401
            assert c.post("/detokenize", json={"tokens": [5]}).status_code == 401
            ok = c.post("/tokenize", json={"prompt": "hi"}, headers={"authorization": "Bearer k1"})
            assert ok.status_code == 200
    finally:
        srv.stop()


def test_models_listed_while_no_engine_is_up(tiny_model_dir, redis_url):
    srv = start_gateway(redis_url, tiny_model_dir)
    try:
        with httpx.Client(base_url=srv.url, trust_env=False, timeout=10) as c:
            data = c.get("/v1/models").json()["data"]
            assert [m["id"] for m in data] == [tiny_model_dir.name] and data[0]["engines"] == 0
            card = c.get(f"/v1/models/{tiny_model_dir.name}").json()
            assert card["max_model_len"] == 512
    finally:
        srv.stop()


# ---------------------------------------------------------------------- chat templates
def _prompt_text(srv, tok, **body) -> str:
    r = httpx.post(srv.url + "/tokenize", json=body, trust_env=False, timeout=10)
    assert r.status_code == 200, r.text
    return tok.decode(r.json()["tokens"])


def test_add_generation_prompt_and_continue_final_message(stack, tok, llm):
    from engine_worker import SamplingParams
    msgs = [{"role": "user", "content": "Hi"}]
    assert _prompt_text(stack["srv"], tok, messages=msgs).endswith("<|im_start|>assistant\n")
    assert _prompt_text(stack["srv"], tok, messages=msgs, add_generation_prompt=False).endswith("Hi<|im_end|>\n")
    prefill = msgs + [{"role": "assistant", "content": "The quick"}]
    text = _prompt_text(stack["srv"], tok, messages=prefill, continue_final_message=True,
                        add_generation_prompt=False)
    assert text.endswith("<|im_start|>assistant\nThe quick")
    # The answer continues the prefill: the engine's greedy output for exactly that prompt.
    want = llm.generate([tok.encode(text)], SamplingParams(temperature=0, max_tokens=5))[0].text
    out = stack["client"].chat.completions.create(
        model=stack["model"], messages=prefill, max_tokens=5, temperature=0,
        extra_body={"continue_final_message": True, "add_generation_prompt": False})
    assert out.choices[0].message.content == want


def test_chat_template_kwargs_and_request_template(stack, tok):
    template = "{{ greeting }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    text = _prompt_text(stack["srv"], tok, messages=[{"role": "user", "content": "Hi"}], chat_template=template,
                        chat_template_kwargs={"greeting": "Bonjour "})
    assert text == "Bonjour Hi"


def test_chat_template_file_renders_the_message_name(stack, tok, llm):
    from engine_worker import SamplingParams
    msgs = [{"role": "user", "name": "alice", "content": "Hi"}, {"role": "user", "content": "Yo"}]
    assert _prompt_text(stack["named"], tok, messages=msgs) == "alice: Hi\nuser: Yo\n"
    want = llm.generate(["alice: Hi\nuser: Yo\n"], SamplingParams(temperature=0, max_tokens=5))[0].text
    client = openai_client(stack["named"])
    out = client.chat.completions.create(model=stack["model"], messages=msgs, max_tokens=5, temperature=0)
    assert out.choices[0].message.content == want


def test_streamed_chat_carries_stop_reason_field(stack):
    """Raw SSE: every finished choice has a stop_reason key (null for length)."""
    with httpx.Client(base_url=stack["srv"].url, trust_env=False, timeout=30) as c:
        status, frames = post_stream(c, "/v1/chat/completions",
                                     {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3,
                                      "temperature": 0, "stream": True, "ignore_eos": True})
    assert status == 200
    final = [f["choices"][0] for f in frames if isinstance(f, dict) and f.get("choices")
             and f["choices"][0].get("finish_reason")]
    assert final == [{"index": 0, "delta": {}, "logprobs": None, "finish_reason": "length", "stop_reason": None}]
    assert json.dumps(final)


# ---------------------------------------------------------------------- prompt scoring (lm-eval style)
def _prompt_scores(llm, ids, n=1):
    from engine_worker import SamplingParams
    return llm.generate([ids], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=n))[0].prompt_logprobs


def test_echo_logprobs_with_max_tokens_zero_scores_the_prompt(stack, llm, tok):
    text = "Paris is the capital of France."
    ids = tok.encode(text)
    want = _prompt_scores(llm, ids)
    out = _complete(stack, prompt=text, echo=True, logprobs=1, max_tokens=0)
    c = out.choices[0]
    assert c.text == text and c.finish_reason == "length" and out.usage.completion_tokens == 0
    assert out.usage.prompt_tokens == len(ids)
    lp = c.logprobs
    assert len(lp.tokens) == len(ids) and "".join(lp.tokens) == text
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:] == pytest.approx([w.logprob for w in want[1:]], abs=1e-4)
    assert all(len(t) == 1 for t in lp.top_logprobs[1:])
    assert lp.text_offset == [len(tok.decode(ids[:i])) for i in range(len(ids))]
    # lm-eval's loglikelihood: the sum over the continuation's tokens.
    total = sum(lp.token_logprobs[-3:])
    assert total == pytest.approx(sum(w.logprob for w in want[-3:]), abs=1e-3)


def test_echo_logprobs_with_generation_streamed_and_not(stack, llm, tok):
    text = "Hello world"
    ids = tok.encode(text)
    gen = _greedy_ids(llm, 3, ids)
    out = _complete(stack, prompt=text, echo=True, logprobs=0, max_tokens=3)
    c = out.choices[0]
    assert c.text == text + tok.decode(gen) and len(c.logprobs.tokens) == len(ids) + 3
    assert c.logprobs.token_logprobs[0] is None and all(v is not None for v in c.logprobs.token_logprobs[1:])
    chunks = list(_complete(stack, prompt=text, echo=True, logprobs=0, max_tokens=3, stream=True))
    assert chunks[0].choices[0].text == text and len(chunks[0].choices[0].logprobs.tokens) == len(ids)
    assert "".join(ch.choices[0].text for ch in chunks) == c.text
    assert sum((len(ch.choices[0].logprobs.tokens) for ch in chunks), 0) == len(ids) + 3
    only = list(_complete(stack, prompt=text, echo=True, logprobs=0, max_tokens=0, stream=True))
    assert "".join(ch.choices[0].text for ch in only) == text and only[-1].choices[0].finish_reason == "length"


def test_prompt_logprobs_field(stack, llm, tok):
    ids = tok.encode("The quick brown fox")
    want = _prompt_scores(llm, ids, 2)
    out = _complete(stack, prompt=ids, max_tokens=1, extra_body={"prompt_logprobs": 2})
    got = out.choices[0].prompt_logprobs
    assert got[0] is None and len(got) == len(ids)
    for i, (entry, w) in enumerate(zip(got[1:], want[1:]), start=1):
        own = entry[str(ids[i])]
        assert own["logprob"] == pytest.approx(w.logprob, abs=1e-4) and own["rank"] == w.rank
        assert own["decoded_token"] == tok.decode([ids[i]])
        for rank, (t, v) in enumerate(w.top, start=1):
            assert entry[str(t)]["rank"] in (rank, w.rank)
    chat = stack["client"].chat.completions.create(model=stack["model"], messages=[{"role": "user", "content": "Hi"}],
                                                   max_tokens=1, extra_body={"prompt_logprobs": 0})
    assert chat.prompt_logprobs[0] is None and len(chat.prompt_logprobs) == chat.usage.prompt_tokens
    assert all(len(e) == 1 for e in chat.prompt_logprobs[1:])
