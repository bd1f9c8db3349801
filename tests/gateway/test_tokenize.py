"""POST /tokenize's add_special_tokens, as vLLM's: applied, checked against the tokenizer's own encode,
with a tokenizer that adds a BOS (the tiny tokenizer with a post-processor writing <|im_start|>)."""
from __future__ import annotations

import shutil

import httpx
import pytest

from tests.support.gateway_support import start_gateway
from tests.support.tiny_model import build_tokenizer

BOS = 1        # <|im_start|>
MSGS = [{"role": "user", "content": "Hello world"}]


@pytest.fixture(scope="module")
def bos_model_dir(tiny_model_dir, tmp_path_factory):
    from tokenizers import processors
    path = tmp_path_factory.mktemp("tiny-bos")
    for name in ("config.json", "generation_config.json", "model.safetensors"):
        shutil.copy(tiny_model_dir / name, path / name)
    tok = build_tokenizer()
    tok._tokenizer.post_processor = processors.TemplateProcessing(single="<|im_start|> $A",
                                                                  special_tokens=[("<|im_start|>", BOS)])
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def hf(bos_model_dir):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(bos_model_dir))
    assert tok.encode("Hello world", add_special_tokens=True)[0] == BOS         # the fixture adds a BOS
    assert tok.encode("Hello world", add_special_tokens=False)[0] != BOS
    return tok


@pytest.fixture(scope="module")
def srv(bos_model_dir, redis_server):
    srv = start_gateway(redis_server.url, bos_model_dir)
    yield srv
    srv.stop()


def _tokens(srv, **body) -> list[int]:
    r = httpx.post(srv.url + "/tokenize", json=body, trust_env=False, timeout=10)
    assert r.status_code == 200, r.text
    assert r.json()["count"] == len(r.json()["tokens"])
    return r.json()["tokens"]


def test_prompt_add_special_tokens(srv, hf):
    with_bos = hf.encode("Hello world", add_special_tokens=True)
    assert _tokens(srv, prompt="Hello world") == with_bos                          # vLLM's default: true
    assert _tokens(srv, prompt="Hello world", add_special_tokens=True) == with_bos
    assert _tokens(srv, prompt="Hello world", add_special_tokens=False) == hf.encode("Hello world",
                                                                                      add_special_tokens=False)


def test_messages_add_special_tokens(srv, hf):
    text = hf.apply_chat_template(MSGS, tokenize=False, add_generation_prompt=True)
    plain = hf.encode(text, add_special_tokens=False)
    assert _tokens(srv, messages=MSGS) == plain                                    # vLLM's default: false
    assert _tokens(srv, messages=MSGS, add_special_tokens=False) == plain
    assert _tokens(srv, messages=MSGS, add_special_tokens=True) == hf.encode(text, add_special_tokens=True)
    assert hf.encode(text, add_special_tokens=True) == [BOS] + plain
    # The other chat fields still apply with it.
    text = hf.apply_chat_template(MSGS, tokenize=False, add_generation_prompt=False)
    assert _tokens(srv, messages=MSGS, add_special_tokens=True, add_generation_prompt=False) == \
        hf.encode(text, add_special_tokens=True)


@pytest.mark.parametrize("body", [{"prompt": "hi", "add_special_tokens": "yes"},
                                  {"messages": MSGS, "add_special_tokens": 1}])
def test_add_special_tokens_must_be_a_boolean(srv, body):
    r = httpx.post(srv.url + "/tokenize", json=body, trust_env=False, timeout=10)
    assert r.status_code == 400 and r.json()["error"]["param"] == "add_special_tokens", r.text


@pytest.fixture(scope="module")
def engine(bos_model_dir, redis_server, srv):
    from tests.support.engine_support import e2e_worker, wait_until
    w = e2e_worker(redis_server.url, bos_model_dir, "special-tokens").start()
    wait_until(lambda: srv.gw.monitor.live_engines(), 10)
    yield w
    w.stop()


def _usage(srv, path: str, body: dict) -> int:
    r = httpx.post(srv.url + path, json={"max_tokens": 1, "temperature": 0, **body}, trust_env=False, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens"]


def test_completions_and_chat_add_special_tokens_as_vllm(srv, hf, engine):
    """/v1/completions encodes a text prompt with the tokenizer's special tokens (vLLM's default,
    a model's BOS: Gemma and Llama 3 need it), and not with add_special_tokens false; a chat's
    template writes its own, and add_special_tokens true adds the tokenizer's on top."""
    text = "Hello world"
    assert _usage(srv, "/v1/completions", {"prompt": text}) == len(hf.encode(text, add_special_tokens=True))
    assert _usage(srv, "/v1/completions", {"prompt": text, "add_special_tokens": False}) == \
        len(hf.encode(text, add_special_tokens=False))
    plain = hf.apply_chat_template(MSGS, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert _usage(srv, "/v1/chat/completions", {"messages": MSGS}) == len(plain)
    assert _usage(srv, "/v1/chat/completions", {"messages": MSGS, "add_special_tokens": True}) == len(plain) + 1
