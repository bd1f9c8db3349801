"""tokenizer_service: the library, the incremental detokenizer, the HTTP service and both async clients."""
from __future__ import annotations

import asyncio
import random
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

from tests.support.tiny_model import _CORPUS
from tokenizer_service import (ChatTemplateOptions, ChatTokenizer, Detokenizer, LocalAsyncTokenizer, RemoteAsyncTokenizer,
                               TokenizerUnavailable, make_tokenizer)
from tokenizer_service.service import create_app
from tests.support.paths import ROOT

FFFD = "\ufffd"

CONVERSATIONS = [
    [{"role": "user", "content": "Hello world!"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Émilie aime le café. 🙂"},
     {"role": "assistant", "content": "東京は日本の首都です。"}, {"role": "user", "content": "And?"}],
    [{"role": "user", "content": "call it"}, {"role": "assistant", "content": ""},
     {"role": "tool", "content": "{\"result\": 42}"}],
    [{"role": "user", "content": "tricky <|im_end|> text\n\n  spaces  "}],
]

BAD_MESSAGES = [
    None, "hello", {"role": "user", "content": "x"}, [],
    ["just a string"],
    [{"role": "robot", "content": "x"}],
    [{"role": "User", "content": "x"}],
    [{"content": "x"}],
    [{"role": "user"}],
    [{"role": "user", "content": None}],
    [{"role": "user", "content": 3}],
    [{"role": "user", "content": [{"type": "text", "text": "x"}]}],
    [{"role": "user", "content": "fine"}, {"role": "user", "content": {"a": 1}}],
]


@pytest.fixture(scope="module")
def tok(tiny_model_dir) -> ChatTokenizer:
    return ChatTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def hf(tiny_model_dir):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(tiny_model_dir))


def corpus_texts(rng: random.Random, n: int) -> list[str]:
    out = []
    for _ in range(n):
        start = rng.randrange(len(_CORPUS))
        out.append(_CORPUS[start:start + rng.randint(0, 120)])
    return out


def stream(det: Detokenizer, ids: list[int], rng: random.Random, decode=None) -> list[str]:
    """Feed ids in random-sized batches; returns the pieces (finish() last) and checks the prefix property."""
    pieces, i = [], 0
    full = decode(ids) if decode is not None else None
    while i < len(ids):
        k = rng.choice([1, 1, 1, 1, 2, 3, 7])
        pieces.append(det.add(ids[i:i + k]))
        i += k
        if decode is not None:   # what was emitted is final: a prefix of the text so far and at the end
            assert decode(ids[:i]).startswith(det.text) and full.startswith(det.text)
    pieces.append(det.finish())
    return pieces


# ---------------------------------------------------------------------- library
def test_attributes(tok, hf):
    assert tok.eos_token_id == 2 == hf.eos_token_id
    assert tok.vocab_size == len(hf)
    assert tok.model_max_length == 512     # tokenizer has no limit -> config.json max_position_embeddings
    assert {0, 1, 2} <= tok.special_token_ids


def test_encode_decode(tok, hf):
    for line in _CORPUS.splitlines() + ["", " leading space", "trailing  ", "🙂🙂", "東京"]:
        ids = tok.encode(line)
        assert ids == hf.encode(line, add_special_tokens=False)
        assert tok.decode(ids) == line
    # No special tokens are added; special tokens are skipped when decoding.
    ids = tok.encode("Hello")
    assert tok.decode([1] + ids + [2, 0]) == "Hello"
    assert tok.decode([]) == ""
    with pytest.raises(ValueError):
        tok.encode(123)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        tok.decode([-1])


@pytest.mark.parametrize("agp", [True, False])
def test_chat_template_matches_transformers(tok, hf, agp):
    for msgs in CONVERSATIONS:
        want_text = hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=agp)
        want_ids = list(hf.apply_chat_template(msgs, tokenize=True, add_generation_prompt=agp, return_dict=False))
        assert tok.render_chat(msgs, add_generation_prompt=agp) == want_text
        assert tok.apply_chat_template(msgs, add_generation_prompt=agp) == want_ids
        assert tok.chat_prompt(msgs, agp) == (want_text, want_ids)
    text = tok.render_chat(CONVERSATIONS[0])
    assert text.endswith("<|im_start|>assistant\n")
    assert not tok.render_chat(CONVERSATIONS[0], add_generation_prompt=False).endswith("assistant\n")


@pytest.mark.parametrize("messages", BAD_MESSAGES)
def test_bad_messages(tok, messages):
    with pytest.raises(ValueError, match="messages"):
        tok.apply_chat_template(messages)


def test_bad_add_generation_prompt(tok):
    with pytest.raises(ValueError, match="add_generation_prompt"):
        tok.apply_chat_template(CONVERSATIONS[0], add_generation_prompt="yes")  # type: ignore[arg-type]


# ---------------------------------------------------------------------- incremental detokenizer
def test_detokenizer_text_never_splits_characters(tok):
    rng = random.Random(0)
    split_chars = 0
    for text in corpus_texts(rng, 400):
        ids = tok.encode(text)
        split_chars += sum(tok.decode([i]).endswith(FFFD) for i in ids)
        det = tok.detokenizer()
        pieces = stream(det, ids, rng, tok.decode)
        assert not any(FFFD in p for p in pieces), (ids, pieces)
        assert "".join(pieces) == det.text == tok.decode(ids) == text
    assert split_chars > 50   # the corpus really does split multi-byte characters across tokens


def test_detokenizer_one_token_at_a_time_holds_partial_characters(tok):
    ids = tok.encode("🙂 東京")
    assert any(tok.decode([i]).endswith(FFFD) for i in ids)
    det = tok.detokenizer()
    pieces = [det.add([i]) for i in ids] + [det.finish()]
    assert "" in pieces                       # something was held back
    assert pieces[-1] == ""                   # ...and released before finish()
    assert "".join(pieces) == "🙂 東京"


def test_detokenizer_random_ids(tok):
    """Arbitrary ids (invalid UTF-8, special tokens): the end result is still exactly decode(all)."""
    rng = random.Random(1)
    for _ in range(600):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randint(0, 60))]
        det = tok.detokenizer()
        pieces = stream(det, ids, rng, tok.decode)
        # (a piece may end in U+FFFD here: that of an invalid byte, final, not of half a character)
        assert "".join(pieces) == det.text == tok.decode(ids)
        assert det.finish() == "" and det.finished


def test_detokenizer_high_bytes_and_specials(tok):
    """Runs of lone high bytes, specials inside a character, a stream ending mid-character."""
    bytes_ = [i for i in range(3, tok.vocab_size) if tok.decode([i]) == FFFD]
    assert bytes_
    rng = random.Random(2)
    for _ in range(200):
        ids = []
        for _ in range(rng.randint(1, 30)):
            ids.append(rng.choice(bytes_) if rng.random() < 0.6 else rng.choice([0, 1, 2] + tok.encode("é東🙂 a")))
        det = tok.detokenizer()
        assert "".join(stream(det, ids, rng, tok.decode)) == tok.decode(ids)
    emoji = tok.encode("🙂")
    det = tok.detokenizer()
    assert det.add(emoji[:1]) == ""
    assert det.add([2]) == ""                       # a special token in the middle of a character
    assert det.add(emoji[1:]) == "🙂"
    det = tok.detokenizer()
    assert det.add(emoji[:-1]) == ""
    assert det.finish() == tok.decode(emoji[:-1])   # the unfinished character, as decode() gives it
    with pytest.raises(RuntimeError):
        det.add([5])


def test_detokenizer_after_prompt(tok):
    rng = random.Random(3)
    prompt = tok.apply_chat_template(CONVERSATIONS[1])
    for text in corpus_texts(rng, 100):
        ids = tok.encode(text)
        det = tok.detokenizer(prompt)
        pieces = stream(det, ids, rng)
        assert not any(FFFD in p for p in pieces)
        assert det.text == tok.decode(ids) == text
    # A prompt that ends inside a character is not used as context.
    emoji = tok.encode("🙂")
    det = tok.detokenizer(emoji[:2])
    assert "".join([det.add(emoji[2:]), det.finish()]) == tok.decode(emoji[2:])


def test_detokenizer_uses_decode_stream_one_call_per_add(tok, monkeypatch):
    """One DecodeStream.step per add(), whatever the number of tokens; decode() only in finish()."""
    ids = tok.encode(_CORPUS)
    det = tok.detokenizer(tok.encode("prompt " * 50))
    calls = []
    real = tok.decode
    monkeypatch.setattr(tok, "decode", lambda x: (calls.append(len(x)), real(x))[1])
    pieces = [det.add(ids[i:i + 5]) for i in range(0, len(ids), 5)]
    assert calls == [] and "".join(pieces) == det.text
    pieces.append(det.finish())
    assert "".join(pieces) == real(ids)


def test_token_strings_batched(tok):
    """Special tokens by their text; a token that is part of a character by its bytes, as OpenAI
    writes them ("bytes:\\xf0\\x9f"), so no two tokens share a name."""
    ids = tok.encode("Émilie 🙂 hello") + [2]
    names = tok.token_strings(ids)
    assert names[-1] == "<|im_end|>" and any(n.startswith("bytes:") for n in names)
    raw = b"".join(bytes.fromhex(n[6:].replace("\\x", "")) if n.startswith("bytes:") else n.encode()
                   for n in names[:-1])
    assert raw.decode() == "Émilie 🙂 hello"
    assert tok.token_strings([]) == []


def _sentencepiece_style_tokenizer():
    """A Llama-style tokenizer: '▁' for spaces, byte fallback, the decoder strips the first space."""
    from tokenizers import Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for c in "▁abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,!?'":
        vocab[c] = len(vocab)
    t = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    t.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    t.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                   decoders.Strip(" ", 1, 0)])
    return ChatTokenizer(PreTrainedTokenizerFast(tokenizer_object=t, bos_token="<s>", eos_token="</s>",
                                                 unk_token="<unk>"))


def test_detokenizer_leading_space_after_prompt():
    tok = _sentencepiece_style_tokenizer()
    prompt = [1] + tok.encode("The capital of France is")
    gen = tok.encode("Paris, 東京 🙂!")           # "▁Paris": a word start, as a model generates it
    assert tok.decode(gen) == "Paris, 東京 🙂!"    # decoded alone, the first space is stripped
    rng = random.Random(5)
    det = tok.detokenizer(prompt)
    pieces = stream(det, gen, rng)
    assert not any(FFFD in p for p in pieces)
    full = tok.decode(prompt + gen)
    assert det.text == " Paris, 東京 🙂!" == full[len(tok.decode(prompt)):]
    det = tok.detokenizer()                       # without a prompt: exactly decode(ids)
    assert "".join(stream(det, gen, rng)) == tok.decode(gen)


# ---------------------------------------------------------------------- service over ASGI
def _asgi_client(tok) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(tok)), base_url="http://tok")


def test_service_endpoints(tok):
    async def main():
        async with _asgi_client(tok) as c:
            assert (await c.get("/health")).json() == {"status": "ok"}
            info = (await c.get("/info")).json()
            assert info["eos_token_id"] == tok.eos_token_id and info["vocab_size"] == tok.vocab_size
            assert info["model_max_length"] == tok.model_max_length and info["special_token_ids"] == [0, 1, 2]
            text = "Émilie aime le café. 東京は日本の首都です。 🙂"
            r = await c.post("/tokenize", json={"text": text})
            assert r.status_code == 200 and r.json() == {"token_ids": tok.encode(text)}
            r = await c.post("/detokenize", json={"token_ids": [1] + tok.encode(text) + [2]})
            assert r.json() == {"text": text}
            for msgs in CONVERSATIONS:
                for agp in (True, False):
                    r = await c.post("/chat/template", json={"messages": msgs, "add_generation_prompt": agp})
                    assert r.json() == {"prompt": tok.render_chat(msgs, agp),
                                        "token_ids": tok.apply_chat_template(msgs, agp)}
            r = await c.post("/chat/template", json={"messages": CONVERSATIONS[0]})   # default: True
            assert r.json()["token_ids"] == tok.apply_chat_template(CONVERSATIONS[0])
    asyncio.run(main())


BAD_REQUESTS = [
    ("/tokenize", b"{not json"),
    ("/tokenize", b"\xff\xfe"),
    ("/tokenize", b"[1, 2]"),
    ("/tokenize", b"{}"),
    ("/tokenize", {"text": 5}),
    ("/tokenize", {"text": ["a"]}),
    ("/detokenize", {}),
    ("/detokenize", {"token_ids": "abc"}),
    ("/detokenize", {"token_ids": [1, "2"]}),
    ("/detokenize", {"token_ids": [1, 2.5]}),
    ("/detokenize", {"token_ids": [True]}),
    ("/detokenize", {"token_ids": [-1]}),
    ("/detokenize", {"token_ids": [2**40]}),
    ("/chat/template", {}),
    ("/chat/template", {"messages": CONVERSATIONS[0], "add_generation_prompt": 1}),
] + [("/chat/template", {"messages": m}) for m in BAD_MESSAGES if m is not None]


@pytest.mark.parametrize("path,body", BAD_REQUESTS)
def test_service_bad_input_is_400_openai_shape(tok, path, body):
    async def main():
        async with _asgi_client(tok) as c:
            if isinstance(body, bytes):
                r = await c.post(path, content=body, headers={"content-type": "application/json"})
            else:
                r = await c.post(path, json=body)
            return r
    r = asyncio.run(main())
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error" and isinstance(err["message"], str) and err["message"]


def test_service_not_found_and_method(tok):
    async def main():
        async with _asgi_client(tok) as c:
            return await c.get("/nope"), await c.get("/tokenize")
    r404, r405 = asyncio.run(main())
    assert r404.status_code == 404 and r404.json()["error"]["type"] == "not_found_error"
    assert r405.status_code == 405 and "message" in r405.json()["error"]


# ---------------------------------------------------------------------- async clients, real server
class UvicornThread:
    def __init__(self, app):
        import uvicorn
        # IPPROTO_TCP explicitly: asyncio sets TCP_NODELAY on accepted sockets only for that proto,
        # and without it every response waits out delayed ACKs (~40 ms).
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self.sock.bind(("127.0.0.1", 0))
        self.url = "http://127.0.0.1:%d" % self.sock.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self):
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.02)
        return self

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(10)
        self.sock.close()


async def _exercise(t, tok: ChatTokenizer) -> None:
    """The same calls against an AsyncTokenizer and the in-process ChatTokenizer."""
    rng = random.Random(6)
    assert (t.eos_token_id, t.vocab_size, t.model_max_length) == (tok.eos_token_id, tok.vocab_size,
                                                                   tok.model_max_length)
    for text in corpus_texts(rng, 20) + ["x" * 20000]:
        ids = await t.encode(text)
        assert ids == tok.encode(text)
        assert await t.decode(ids) == tok.decode(ids)
    for msgs in CONVERSATIONS:
        assert await t.apply_chat_template(msgs) == tok.apply_chat_template(msgs)
        assert await t.apply_chat_template(msgs, add_generation_prompt=False) == tok.apply_chat_template(msgs, False)
        assert await t.render_chat(msgs) == tok.render_chat(msgs)
    for bad in BAD_MESSAGES:
        with pytest.raises(ValueError):
            await t.apply_chat_template(bad)
    with pytest.raises(ValueError):
        await t.decode([-5])
    # vLLM's chat template options travel to the service too.
    prefill = CONVERSATIONS[0] + [{"role": "assistant", "content": "The quick"}]
    text = await t.render_chat(prefill, False, ChatTemplateOptions(continue_final_message=True))
    assert text.endswith("<|im_start|>assistant\nThe quick") and text == tok.render_chat(
        prefill, False, ChatTemplateOptions(continue_final_message=True))
    named = ChatTemplateOptions(chat_template="{{ hi }}{% for m in messages %}{{ m.name }}{% endfor %}",
                                kwargs={"hi": "Hey "})
    assert await t.render_chat([{"role": "user", "content": "x", "name": "bo"}], True, named) == "Hey bo"
    for bad in (ChatTemplateOptions(continue_final_message=True), ChatTemplateOptions(kwargs={"tokenize": 1})):
        with pytest.raises(ValueError):
            await t.render_chat(prefill, True, bad)
    assert await t.decode([1, 40, 2], skip_special_tokens=False) == tok.decode([1, 40, 2], False)
    assert (await t.decode([1, 40, 2], skip_special_tokens=False)).startswith("<|im_start|>")


def test_local_async_tokenizer(tok, tiny_model_dir):
    t = make_tokenizer(str(tiny_model_dir))
    assert isinstance(t, LocalAsyncTokenizer)

    async def main():
        async with t:
            await _exercise(t, tok)
    asyncio.run(main())


def test_remote_async_tokenizer_real_server(tok, tiny_model_dir):
    with UvicornThread(create_app(ChatTokenizer.from_pretrained(tiny_model_dir))) as srv:
        async def main():
            t = make_tokenizer(str(tiny_model_dir), srv.url)
            assert isinstance(t, RemoteAsyncTokenizer)
            try:
                await t.start()
                await _exercise(t, tok)
                # Bad input the client does not check itself comes back from the service as ValueError.
                with pytest.raises(ValueError, match="token id"):
                    await t.decode([2**40])
                with pytest.raises(ValueError, match="string"):
                    await t.encode(None)  # type: ignore[arg-type]
            finally:
                await t.aclose()
        asyncio.run(main())
        # Attributes read before any request fetch /info once (synchronously).
        t2 = RemoteAsyncTokenizer(srv.url)
        assert t2.eos_token_id == tok.eos_token_id and t2.special_token_ids == {0, 1, 2}
        asyncio.run(t2.aclose())


def _closed_port_url() -> str:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return f"http://127.0.0.1:{port}"


def test_remote_unavailable():
    url = _closed_port_url()

    async def main():
        t = RemoteAsyncTokenizer(url)
        try:
            with pytest.raises(TokenizerUnavailable):
                await t.encode("hello")
            with pytest.raises(TokenizerUnavailable):
                await t.decode([1, 2])
            with pytest.raises(TokenizerUnavailable):
                await t.apply_chat_template(CONVERSATIONS[0])
        finally:
            await t.aclose()
    asyncio.run(main())
    with pytest.raises(TokenizerUnavailable):
        RemoteAsyncTokenizer(url).vocab_size


def test_remote_timeout_is_unavailable(tok):
    """A service that accepts but never answers hits the read timeout -> TokenizerUnavailable."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)
    url = "http://127.0.0.1:%d" % srv.getsockname()[1]

    async def main():
        t = RemoteAsyncTokenizer(url, timeout=httpx.Timeout(0.3))
        try:
            with pytest.raises(TokenizerUnavailable):
                await t.encode("hello")
        finally:
            await t.aclose()
    try:
        asyncio.run(main())
    finally:
        srv.close()


def test_cli_runs_the_service(tiny_model_dir):
    url = _closed_port_url()
    port = url.rsplit(":", 1)[1]
    proc = subprocess.Popen([sys.executable, "-m", "shared.cli", "tokenizer", "--host", "127.0.0.1", "--port", port,
                             "--model", str(tiny_model_dir), "--log-level", "warning"], cwd=ROOT)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, "kaiten tokenizer exited"
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "kaiten tokenizer did not start"
            time.sleep(0.2)
        r = httpx.post(url + "/tokenize", json={"text": "Hello world!"}, timeout=10)
        assert r.json()["token_ids"] == ChatTokenizer.from_pretrained(tiny_model_dir).encode("Hello world!")
    finally:
        proc.terminate()
        assert proc.wait(30) in (0, -15)   # uvicorn re-raises SIGTERM after a graceful shutdown


# ---------------------------------------------------------------------- the real default tokenizer
@pytest.mark.slow
def test_smollm2_tokenizer():
    from transformers import AutoTokenizer

    from shared.gguf_convert import ensure_default_model
    model_dir = str(ensure_default_model())
    tok, hf = ChatTokenizer.from_pretrained(model_dir), AutoTokenizer.from_pretrained(model_dir)
    assert tok.eos_token_id == hf.eos_token_id and tok.vocab_size == len(hf)
    for msgs in CONVERSATIONS:
        assert tok.render_chat(msgs) == hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        assert tok.apply_chat_template(msgs) == list(hf.apply_chat_template(
            msgs, tokenize=True, add_generation_prompt=True, return_dict=False))
    text = "Émilie aime le café. 東京は日本の首都です。中文测试，한국어 🙂🎉👍🏽 ✓ “quotes”… " * 3
    ids = tok.encode(text)
    assert sum(tok.decode([i]).endswith(FFFD) for i in ids) > 10
    rng = random.Random(7)
    prompt = tok.apply_chat_template(CONVERSATIONS[0])
    for prompt_ids in (None, prompt):
        det = tok.detokenizer(prompt_ids)
        pieces = stream(det, ids, rng, tok.decode)
        assert not any(FFFD in p for p in pieces) and det.text == text
    for _ in range(100):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randint(1, 40))]
        assert "".join(stream(tok.detokenizer(prompt), ids, rng, tok.decode)) == tok.decode(ids)
