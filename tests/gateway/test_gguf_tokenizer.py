"""shared.gguf_tokenizer against llama.cpp: its own vocabulary fixtures (models/ggml-vocab-*.gguf,
with the ids its tests/test-tokenizer-0 expects), and the real Gemma 3 270M file.

Each tokenizer is written by the module and loaded back as the tokenizer service loads it
(``ChatTokenizer.from_pretrained``: transformers' AutoTokenizer). Ids given here for text with
special tokens, and for Gemma 3, are llama.cpp's own (``llama_tokenize`` with parse_special on,
from the llama-cpp-python 0.3.36 sources the fixtures come from).
"""
from __future__ import annotations

import random

import pytest

from shared.gguf_tokenizer import CONTROL, USER_DEFINED, write_tokenizer
from tests.support.gguf_metadata import read_metadata
from tests.support.llama_cpp_source import llama_cpp_dir, vocab_fixture
from tokenizer_service.tokenizer import ChatTokenizer

FFFD = "\ufffd"
# tokenizer.ggml.model/pre of each: SentencePiece (llama), its BPE form (gemma4), byte-level BPE.
SUPPORTED = ["llama-spm", "phi-3", "gemma-4", "gpt-2", "llama-bpe", "qwen2", "qwen35", "starcoder",
             "refact", "command-r", "deepseek-llm", "deepseek-coder", "falcon", "mpt"]
# Fixtures with other tokenizer types: WordPiece (bert) and unigram (t5).
REFUSED = {"bert-bge": "'bert'", "nomic-bert-moe": "'t5'"}
TEXT = "Émilie aime le café. 東京は日本の首都です。한국어 🦙🙂🎉👍🏽 ✓ “quotes”… x  \n\n\ty 12345 "


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """name -> (TokenizerInfo, ChatTokenizer) of a fixture vocabulary, each built once."""
    cache = {}

    def build(name: str):
        if name not in cache:
            out = tmp_path_factory.mktemp(name)
            info = write_tokenizer(read_metadata(_fixture_gguf(name)), out, 4096)
            cache[name] = info, ChatTokenizer.from_pretrained(out)
        return cache[name]
    return build


def _fixture_gguf(name: str):
    return llama_cpp_dir() / "models" / f"ggml-vocab-{name}.gguf"


def _assert_streams(tok: ChatTokenizer, ids: list[int], text: str) -> None:
    """Decoded as the gateway does (random chunks through the incremental detokenizer), `ids` give
    `text`, never half a character; after a prompt, as they read after it (a SentencePiece prefix
    space included)."""
    prompt = tok.encode("Some prompt text")
    after_prompt = tok.decode(prompt + ids)[len(tok.decode(prompt)):]
    assert after_prompt.strip() == text.strip()
    for seed, (context, expected) in enumerate(((None, text), (prompt, after_prompt))):
        rng, det, pieces, i = random.Random(seed), tok.detokenizer(context), [], 0
        while i < len(ids):
            n = rng.randint(1, 3)
            pieces.append(det.add(ids[i:i + n]))
            i += n
        pieces.append(det.finish())
        assert "".join(pieces) == expected and not any(FFFD in p for p in pieces)


# ---------------------------------------------------------------------- llama.cpp's fixtures

@pytest.mark.parametrize("name", SUPPORTED)
def test_fixture_encodes_and_decodes_as_llama_cpp(name, built):
    """test-tokenizer-0's cases: no special tokens added, so no BOS in the expected ids either."""
    _, inputs, expected = vocab_fixture(name)
    _, tok = built(name)
    wrong = [(text, got, ids) for text, ids in zip(inputs, expected) if (got := tok.encode(text)) != ids]
    assert not wrong, f"{len(wrong)} of {len(inputs)} differ, first: {wrong[0]}"
    assert [tok.decode(ids) for ids in expected] == inputs


@pytest.mark.parametrize("name", ["llama-spm", "gemma-4", "qwen2", "falcon"])
def test_incremental_decoding(name, built):
    """Token by token through DecodeStream: SentencePiece's ▁ comes out as spaces, byte-fallback
    pieces and byte-level fragments join into whole characters, with or without a prompt before."""
    _, tok = built(name)
    _assert_streams(tok, tok.encode(TEXT), TEXT)


@pytest.mark.parametrize("name, text, ids", [
    ("phi-3", "<|user|>\nHello<|end|>\n<|assistant|>\n", [32010, 15043, 32007, 32001]),   # whitespace after stripped
    ("phi-3", "<|system|> Be brief.<|end|>", [32006, 1522, 11473, 29889, 32007]),
    ("llama-spm", "<s>[INST] Hi [/INST]", [1, 518, 25580, 29962, 6324, 518, 29914, 25580, 29962]),
    ("llama-spm", "Hi</s>", [6324, 2]),
    ("qwen2", "<|im_start|>user\nhey<|im_end|>\n<|im_start|>assistant\n",
     [151644, 872, 198, 35561, 151645, 198, 151644, 77091, 198]),
    ("llama-bpe", "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>",
     [128006, 882, 128007, 271, 13347, 128009]),
    ("gemma-4", "<|turn>user\nHi<turn|>\n", [105, 2364, 107, 10979, 106, 107]),
])
def test_special_tokens_in_text(name, text, ids, built):
    assert built(name)[1].encode(text) == ids


@pytest.mark.parametrize("name", ["llama-spm", "phi-3", "qwen2", "llama-bpe", "mpt", "gemma-4"])
def test_control_and_user_defined_tokens_keep_their_ids(name, built):
    """Each one is a single token of its own id wherever it stands, and encoding adds no tokens."""
    meta = read_metadata(_fixture_gguf(name))
    _, tok = built(name)
    tokens, types = meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.token_type"]
    assert tok.vocab_size == len(tokens)
    for i in [i for i, kind in enumerate(types) if kind in (CONTROL, USER_DEFINED)][:300]:
        ids = tok.encode(f"x{tokens[i]}y")
        assert i in ids, (i, tokens[i], ids)


@pytest.mark.parametrize("name, eos, bos_first", [
    ("llama-spm", [2], True), ("phi-3", [32000, 32007], True), ("gemma-4", [1, 50, 106], True),
    ("llama-bpe", [128001, 128009], False), ("qwen2", [151643, 151645], False),
    ("starcoder", [0, 4], False), ("gpt-2", [50256], False),
])
def test_end_of_generation_tokens_and_bos(name, eos, bos_first, built):
    """llama.cpp's end-of-generation set (llama_vocab_is_eog), the file's EOS first, but for a
    non-control </s> (Qwen's 128247, Phi-3's 2); BOS where llama.cpp adds it."""
    info, tok = built(name)
    assert info.eos_token_ids == eos and info.eos_token_id == eos[0]
    assert (tok.hf.encode("Hi", add_special_tokens=True)[0] == info.bos_token_id) == bos_first


def test_eot_and_eom_ids_from_the_metadata_stop_generation(tmp_path):
    tokens = ["<unk>", "<s>", "</s>", "<turn_end>", "<msg_end>", *(f"<0x{b:02X}>" for b in range(256)), "\u2581", "a"]
    meta = {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.scores": [0.0] * len(tokens),
            "tokenizer.ggml.token_type": [2, 3, 3, 3, 3] + [6] * 256 + [1, 1],
            "tokenizer.ggml.eot_token_id": 3, "tokenizer.ggml.eom_token_id": 4}
    assert write_tokenizer(meta, tmp_path, 64).eos_token_ids == [2, 3, 4]


def test_chat_template_from_the_file(built):
    _, tok = built("phi-3")
    assert tok.hf.chat_template == read_metadata(_fixture_gguf("phi-3"))["tokenizer.chat_template"]
    text = tok.render_chat([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"},
                            {"role": "user", "content": "Bye"}])
    assert text == "<s><|user|>\nHi<|end|>\n<|assistant|>\nHello<|end|>\n<|user|>\nBye<|end|>\n<|assistant|>\n"


@pytest.mark.parametrize("name, kind", REFUSED.items())
def test_other_tokenizer_types_are_refused(name, kind, tmp_path):
    with pytest.raises(ValueError) as e:
        write_tokenizer(read_metadata(_fixture_gguf(name)), tmp_path, 4096)
    assert kind in str(e.value) and "supported: gpt2, llama, gemma4" in str(e.value) and "\n" not in str(e.value)


def test_unknown_pre_tokenizers_are_refused(tmp_path):
    meta = read_metadata(_fixture_gguf("qwen2")) | {"tokenizer.ggml.pre": "chameleon"}
    with pytest.raises(ValueError) as e:
        write_tokenizer(meta, tmp_path, 4096)
    message = str(e.value)
    assert "'chameleon'" in message and "llama-bpe" in message and "qwen2" in message and "\n" not in message


# ---------------------------------------------------------------------- Gemma 3 270M

@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    from tests.support.gemma_file import gemma3_gguf

    out = tmp_path_factory.mktemp("gemma3")
    info = write_tokenizer(read_metadata(gemma3_gguf()), out, 32768)
    return info, ChatTokenizer.from_pretrained(out)


@pytest.mark.parametrize("text, ids", [
    ("Hello world", [9259, 1902]),
    (" Hello", [26352]),                      # no prefix space: add_space_prefix is false
    ("The capital of France is Paris.", [818, 5279, 529, 7001, 563, 9079, 236761]),
    ("<start_of_turn>user\nWhat is 2+2?<end_of_turn>\n<start_of_turn>model\n",
     [105, 2364, 107, 3689, 563, 236743, 236778, 236862, 236778, 236881, 106, 107, 105, 4368, 107]),
    (" " * 36 + "x", [167, 141, 236781]),     # the longest whitespace token first, as llama.cpp
    ("a\n\n\nb", [236746, 109, 236763]),
    ("tab\tand  two spaces", [4823, 255968, 624, 138, 13498, 9952]),
    ("Emoji 🦙🚀 café naïve 日本語", [127268, 236743, 478, 397, 404, 391, 242015, 33443, 120362, 33375, 238582]),
    ("\u200b\U0001F9EC", [237141, 253633]),
    ("<b>bold</b> </s>", [200, 15640, 209, 236743, 212]),
])
def test_gemma3_encodes_as_llama_cpp(gemma3, text, ids):
    _, tok = gemma3
    assert tok.encode(text) == ids
    assert tok.decode(ids, skip_special_tokens=False) == text


def test_gemma3_special_tokens_bos_and_end_of_generation(gemma3):
    info, tok = gemma3
    assert (info.vocab_size, info.bos_token_id, info.eos_token_id, info.pad_token_id) == (262144, 2, 1, 0)
    assert info.eos_token_ids == [1, 106]       # <eos>, <end_of_turn>
    assert tok.hf.encode("Hello world", add_special_tokens=True) == [2, 9259, 1902]
    assert tok.decode([2, 105, 2364, 107, 9259, 106]) == "user\nHello"
    _assert_streams(tok, tok.encode(TEXT), TEXT)


def test_gemma3_chat_template_renders_a_conversation(gemma3):
    """The file has no tokenizer.chat_template: Gemma's own turn format stands in for it."""
    _, tok = gemma3
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": " Hi "},
                {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "2+2?"}]
    text, ids = tok.chat_prompt(messages)
    assert text == ("<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n"
                    "<start_of_turn>model\nHello!<end_of_turn>\n"
                    "<start_of_turn>user\n2+2?<end_of_turn>\n<start_of_turn>model\n")
    assert ids[:4] == [2, 105, 2364, 107] and ids[-3:] == [105, 4368, 107] and ids.count(106) == 3
