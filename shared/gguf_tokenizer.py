"""A GGUF file's tokenizer as Hugging Face tokenizer files that encode as llama.cpp does.

``write_tokenizer(meta, out_dir, context_length)`` reads the ``tokenizer.*`` metadata and writes
``tokenizer.json``, ``tokenizer_config.json`` (special tokens, BOS/EOS flags, the chat template)
and ``special_tokens_map.json``; it returns a ``TokenizerInfo`` with what the converter needs.

* ``tokenizer.ggml.model == "llama"`` (SentencePiece: Llama 2, Mistral, Phi-3, Gemma): a BPE over
  the vocabulary with byte fallback, its merges derived from the scores by transformers'
  ``get_merges`` (llama.cpp merges by score as well).
* ``"gemma4"``: the same shape with the file's own merges.
* ``"gpt2"`` (byte-level BPE: Llama 3, Qwen, SmolLM, Phi-4...): llama.cpp's pre-tokenizer regexes
  for ``tokenizer.ggml.pre`` (``PRE_TOKENIZERS``), each an isolated split, then the byte mapping.

What transformers' GGUF builders (``transformers.integrations.gguf.gguf_tokenizer_mapping``, 5.23)
get wrong against llama.cpp, and is done differently here:

* SentencePiece prefix space: its ``Metaspace(prepend_scheme="first")`` adds no ``▁`` to text that
  starts with a space (" Hello" loses a token) nor after a special token, and ignores
  ``tokenizer.ggml.add_space_prefix``. llama.cpp prefixes a space to every piece of text that
  starts the input or follows a special token, when the flag says so: a ``Prepend`` normalizer,
  which tokenizers applies to each piece between added tokens, does exactly that.
* User-defined tokens: it respells them (Gemma's runs of spaces to ``▁``, byte-level ones to the
  byte alphabet) and then no longer finds them, so they are not matched whole in the text as
  llama.cpp matches them (36 spaces: 16+20 instead of llama.cpp's 31+5; MPT's space runs).
  Here every control, unknown and user-defined token is added as the file spells it.
* Byte-level pre-tokenizers: it only knows the Llama 3, Qwen and GPT-4o/Tekken families and falls
  back to GPT-2's regex for the rest (StarCoder, SmolLM, Command-R: digits and "½" split wrong;
  DeepSeek, Falcon: their own splits missing), and it never sets ``ignore_merges`` (Llama 3:
  " Việt" is one token in llama.cpp, three from the merges).
* Special-token flags llama.cpp sets by model: Phi-3's control tokens strip the whitespace after
  them; and the end-of-generation set (eot, eom, ``<end_of_turn>``, ``<|im_end|>``...), which it
  does not compute at all.

A file without a chat template gets its family's where the vocabulary shows the family
(``shared.gguf_chat_templates``).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

# GGUF token types (llama.cpp's llama_token_type).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

SUPPORTED_MODELS = ("gpt2", "llama", "gemma4")
_SPACE = "\u2581"   # SentencePiece's visible space


class Metadata(Protocol):
    """GGUF metadata values by key (``gguf_convert._Meta``, or a plain dict)."""

    def get(self, key: str, default: Any = None) -> Any: ...


@dataclass(slots=True)
class TokenizerInfo:
    """What the model files other than the tokenizer's need to agree with it."""
    vocab_size: int            # tokens, added ones included: the embedding's rows
    bos_token_id: int | None
    eos_token_id: int | None   # the file's EOS
    pad_token_id: int | None
    eos_token_ids: list[int]   # everything generation stops on, EOS first (generation_config.json)


@dataclass(slots=True)
class Vocab:
    """The tokenizer.* metadata, with llama.cpp's defaults filled in."""
    model: str
    pre: str
    architecture: str
    name: str
    tokens: list[str]
    types: list[int]
    scores: list[float] | None
    merges: list[str] | None
    ids: dict[str, int]        # special token ids the file gives: bos, eos, unknown, padding, eot...
    add_bos: bool
    add_eos: bool
    add_space_prefix: bool
    chat_template: str | None

    def text(self, key: str) -> str | None:
        tid = self.ids.get(key)
        return None if tid is None else self.tokens[tid]


# ----------------------------------------------------------------------------------- reading

_ID_KEYS = ("bos", "eos", "unknown", "padding", "eot", "eom", "fim_pad", "fim_rep", "fim_sep")


def read_vocab(meta: Metadata) -> Vocab:
    model = meta.get("tokenizer.ggml.model")
    if model not in SUPPORTED_MODELS:
        raise ValueError(f"unsupported GGUF tokenizer {model!r} (supported: {', '.join(SUPPORTED_MODELS)})")
    tokens = list(meta.get("tokenizer.ggml.tokens") or [])
    if not tokens:
        raise ValueError("GGUF metadata has no tokenizer.ggml.tokens")
    if len(set(tokens)) != len(tokens):
        raise ValueError("duplicate tokens in tokenizer.ggml.tokens")
    scores = meta.get("tokenizer.ggml.scores")
    merges = meta.get("tokenizer.ggml.merges")
    sentencepiece = model == "llama"
    ids = {}
    for key in _ID_KEYS:
        tid = meta.get(f"tokenizer.ggml.{key}_token_id")
        if tid is not None and 0 <= int(tid) < len(tokens):   # llama.cpp ignores ids out of range
            ids[key] = int(tid)
    if sentencepiece:   # llama.cpp's defaults for a SentencePiece vocabulary
        ids = {"bos": 1, "eos": 2, "unknown": 0, **ids}
    return Vocab(
        model=model,
        pre=meta.get("tokenizer.ggml.pre") or "default",
        architecture=meta.get("general.architecture") or "",
        name=meta.get("general.name") or "",
        tokens=tokens,
        types=[int(t) for t in (meta.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens))],
        scores=None if scores is None else [float(s) for s in scores],
        merges=None if merges is None else list(merges),
        ids=ids,
        # llama.cpp adds BOS to SentencePiece unless told otherwise, and always for Gemma 4
        # (llama.cpp#21500).
        add_bos=model == "gemma4" or bool(meta.get("tokenizer.ggml.add_bos_token", sentencepiece)),
        add_eos=bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        add_space_prefix=sentencepiece and bool(meta.get("tokenizer.ggml.add_space_prefix", True)),
        chat_template=meta.get("tokenizer.chat_template") or None,
    )


# ----------------------------------------------------------------------------------- pre-tokenizers

_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
# DeepSeek's own classes, as llama.cpp's llama-vocab.cpp copies them from its tokenizer.json;
# escaped, since several of the characters are not in Unicode normal form and editors fold them.
_DEEPSEEK_LETTERS = (
    "\\s?[A-Za-z\u00b5\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af"
    "\u0370-\u0373\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1\u03a3-\u03f5"
    "\u03f7-\u0481\u048a-\u052f\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5\u13f8-\u13fd\u1c90-\u1cba"
    "\u1cbd-\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45"
    "\u1f48-\u1f4d\u1f50-\u1f57\u1f59\u1f5b\u1f5d\u1f5f-\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe"
    "\u1fc2-\u1fc4\u1fc6-\u1fcc\u1fd0-\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4\u1ff6-\u1ffc\u2102"
    "\u2107\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134\u2139"
    "\u213c-\u213f\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee\u2cf2\u2cf3"
    "\ua640-\ua66d\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e\uab70-\uabbf\ufb00-\ufb06"
    "\ufb13-\ufb17\uff21-\uff3a\uff41-\uff5a\U00010400-\U0001044f\U000104b0-\U000104d3"
    "\U000104d8-\U000104fb\U00010c80-\U00010cb2\U00010cc0-\U00010cf2\U000118a0-\U000118df"
    "\U0001e900-\U0001e943]+"
)
_DEEPSEEK_PUNCTUATION = "\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+"
_DEEPSEEK_CJK = "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+"
_DIGITS_THEN_GPT2 = [r"\p{N}", _GPT2]


@dataclass(slots=True)
class PreTokenizer:
    splits: list[str]          # regexes applied in turn, each piece split again by the next
    ignore_merges: bool = False  # a piece that is a token is that token (llama.cpp's ignore_merges)


def _pre_tokenizers() -> dict[str, PreTokenizer]:
    """``tokenizer.ggml.pre`` -> how llama.cpp splits text before BPE (llm_tokenizer_bpe).

    Families transformers knows come from its ``GGUF_PRE_TOKENIZER_SPLITS``: the regexes of the
    models' own tokenizer.json, which llama.cpp rewrites for std::regex to the same effect. The
    rest are llama.cpp's, and ``ignore_merges`` is set where llama.cpp sets it."""
    from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_PRE_TOKENIZER_SPLITS

    table = {name: PreTokenizer([regex]) for name, regex in GGUF_PRE_TOKENIZER_SPLITS.items()}
    for name in ("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
                 "jina-v5-nano", "tekken"):
        table[name].ignore_merges = True
    table.update({name: PreTokenizer([_GPT2]) for name in ("gpt-2", "phi-2", "mpt", "olmo")})
    table.update({name: PreTokenizer(_DIGITS_THEN_GPT2) for name in (
        "smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b")})
    table["deepseek-llm"] = PreTokenizer(["[\r\n]", _DEEPSEEK_LETTERS, _DEEPSEEK_PUNCTUATION, r"\s+$",
                                          _DEEPSEEK_CJK, r"\p{N}+"])
    table["deepseek-coder"] = PreTokenizer(["[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _DEEPSEEK_CJK, r"\p{N}"])
    table["falcon"] = PreTokenizer([r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, r"[0-9][0-9][0-9]"])
    # A file without tokenizer.ggml.pre (an old converter): llama.cpp's fallback, not GPT-2's.
    table["default"] = PreTokenizer([r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"])
    return table


def pre_tokenizer_for(pre: str) -> PreTokenizer:
    table = _pre_tokenizers()
    if pre not in table:
        raise ValueError(f"unsupported GGUF pre-tokenizer {pre!r} (supported: {', '.join(sorted(table))})")
    return table[pre]


# ----------------------------------------------------------------------------------- building

def build_tokenizer(vocab: Vocab):
    """The ``tokenizers.Tokenizer`` for `vocab`: model, splitting, decoding and added tokens."""
    builders = {"gpt2": _byte_level_bpe, "llama": _sentencepiece, "gemma4": _sentencepiece_bpe}
    tok = builders[vocab.model](vocab)
    _add_vocab_tokens(tok, vocab)
    tok.post_processor = _post_processor(vocab)
    return tok


def _byte_level_bpe(vocab: Vocab):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    if vocab.merges is None:
        raise ValueError("byte-level BPE GGUF without tokenizer.ggml.merges")
    pre = pre_tokenizer_for(vocab.pre)
    tok = Tokenizer(models.BPE(vocab=_ids(vocab), merges=_merge_pairs(vocab.merges), fuse_unk=False,
                               byte_fallback=False, ignore_merges=pre.ignore_merges))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in pre.splits]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    return tok


def _sentencepiece(vocab: Vocab):
    from transformers.integrations.gguf.gguf_tokenizer_mapping import get_merges

    if vocab.scores is None:
        raise ValueError("SentencePiece GGUF without tokenizer.ggml.scores")
    # Best score first, as llama.cpp picks the pair to merge. Gemma's scores follow its vocabulary
    # order, which transformers' Gemma builder uses instead: the same merges.
    merges = get_merges({"tokens": vocab.tokens, "scores": vocab.scores})
    return _spm_shaped(vocab, merges)


def _sentencepiece_bpe(vocab: Vocab):
    # llama.cpp also cuts the text at newlines first; no merge joins a newline to anything else,
    # so the merges give the same tokens without that cut.
    if vocab.merges is None:
        raise ValueError(f"{vocab.model} GGUF without tokenizer.ggml.merges")
    return _spm_shaped(vocab, _merge_pairs(vocab.merges))


def _spm_shaped(vocab: Vocab, merges: list[tuple[str, str]]):
    """SentencePiece's shape: spaces as ``▁``, a prefix space where llama.cpp adds one, byte
    fallback (``<0xNN>``), no pre-tokenizer (merges run over each piece of text whole)."""
    from tokenizers import Tokenizer, decoders, models, normalizers

    tok = Tokenizer(models.BPE(vocab=_ids(vocab), merges=merges, unk_token=vocab.text("unknown"),
                               fuse_unk=True, byte_fallback=True))
    steps = [normalizers.Replace(" ", _SPACE)]
    if vocab.add_space_prefix:
        steps.insert(0, normalizers.Prepend(_SPACE))
    tok.normalizer = normalizers.Sequence(steps)
    steps = [decoders.Replace(_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if vocab.add_space_prefix:   # the prefix space of the text's first piece
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    tok.decoder = decoders.Sequence(steps)
    return tok


def _ids(vocab: Vocab) -> dict[str, int]:
    return {token: i for i, token in enumerate(vocab.tokens)}


def _merge_pairs(merges: list[str]) -> list[tuple[str, str]]:
    """"a b" -> ("a", "b"), cut at the first space after the first character, as llama.cpp does."""
    pairs = []
    for merge in merges:
        cut = merge.find(" ", 1)
        if cut > 0:   # llama.cpp keeps a merge without a space as one that never applies
            pairs.append((merge[:cut], merge[cut + 1:]))
    return pairs


# ----------------------------------------------------------------------------------- special tokens

def _add_vocab_tokens(tok, vocab: Vocab) -> None:
    """Control, unknown and user-defined tokens are matched whole in the text before anything else,
    as llama.cpp's tokenizer_st_partition does; control and unknown ones (and whatever llama.cpp
    ends generation on) are special: skipped when decoding. They keep their ids."""
    from tokenizers import AddedToken

    stops = set(end_of_generation_ids(vocab))
    rstrip = _rstrip_ids(vocab)
    special, plain = [], []
    for i, (text, kind) in enumerate(zip(vocab.tokens, vocab.types)):
        if kind in (CONTROL, UNKNOWN) or i in stops:
            special.append(AddedToken(text, special=True, normalized=False, rstrip=i in rstrip))
        elif kind == USER_DEFINED:
            plain.append(AddedToken(text, special=False, normalized=False, rstrip=i in rstrip))
    tok.add_special_tokens(special)
    tok.add_tokens(plain)
    for added in special + plain:
        i = tok.token_to_id(added.content)
        if i is None or vocab.tokens[i] != added.content:
            raise ValueError(f"added token {added.content!r} got id {i}, not its own")


def _rstrip_ids(vocab: Vocab) -> set[int]:
    """Tokens that swallow the whitespace after them. llama.cpp: every control, unknown and
    user-defined token of a Phi-3 file (named so), and </s>, but not <unk>, <s>, <|endoftext|>,
    as Phi-3's tokenizer.json has it. Phi-3.5 files are named "Phi 3.5 ...", which llama.cpp
    misses though their tokenizer is Phi-3's; its architecture and SentencePiece vocabulary catch
    them here (Phi-4's byte-level vocabulary does not strip)."""
    name = vocab.name.lower()
    if not ("phi-3" in name or "phi3" in name or (vocab.architecture == "phi3" and vocab.model == "llama")):
        return set()
    ids = {i for i, kind in enumerate(vocab.types) if kind in (CONTROL, UNKNOWN, USER_DEFINED)}
    index = _ids(vocab)
    if "</s>" in index:
        ids.add(index["</s>"])
    return ids - {index[t] for t in ("<unk>", "<s>", "<|endoftext|>") if t in index}


# llama.cpp's end-of-generation tokens by text (llama-vocab.cpp, "special_eog_ids"), and the
# fill-in-the-middle ones it ends generation on too (pad, repo, file separator).
_EOG_TEXTS = frozenset({
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
    "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
    "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
    "<｜end▁of▁sentence｜>", "[e~[",
})
_FIM_TEXTS = {
    "fim_pad": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
    "fim_rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "fim_sep": ("<|file_sep|>",),
}


def end_of_generation_ids(vocab: Vocab) -> list[int]:
    """The tokens llama.cpp stops generating on, the file's EOS first.

    One exception: ``</s>`` counts only as a control token. llama.cpp's text match (meant for
    PaddleOCR) also takes HTML's strikethrough end tag, an ordinary token in Qwen's and Gemma's
    vocabularies and a leftover one in Phi-3's, which their own tokenizers never stop on: stopping
    there cuts an answer that writes HTML."""
    index = _ids(vocab)
    stops = {i for i, (text, kind) in enumerate(zip(vocab.tokens, vocab.types))
             if text in _EOG_TEXTS and (text != "</s>" or kind == CONTROL)}
    stops |= {vocab.ids[k] for k in ("eos", "eot", "eom") if k in vocab.ids}
    for key, texts in _FIM_TEXTS.items():
        # Where a vocabulary has several, llama.cpp takes the one its hash map yields first; the
        # first of its list here.
        found = vocab.ids.get(key, next((index[t] for t in texts if t in index), None))
        if found is not None:
            stops.add(found)
    texts = {vocab.tokens[i] for i in stops}
    # gpt-oss (and Solar Open) end a message with <|end|> and the whole answer with <|return|>.
    if "<|end|>" in texts and ({"<|return|>", "<|call|>"} <= texts or {"<|calls|>", "<|flush|>"} <= texts):
        stops.discard(index["<|end|>"])
    # Gemma 4 and PLaMo 2 have </s> as a normal token.
    if "</s>" in texts and texts & {"<|tool_response>", "<|plamo:eos|>"}:
        stops.discard(index["</s>"])
    eos = vocab.ids.get("eos")
    return ([eos] if eos is not None else []) + sorted(stops - {eos})


def _post_processor(vocab: Vocab):
    """BOS/EOS around a sequence where the file says to add them (encode with special tokens)."""
    from tokenizers import processors

    before = ["bos"] if vocab.add_bos and "bos" in vocab.ids else []
    after = ["eos"] if vocab.add_eos and "eos" in vocab.ids else []

    def sequence(name: str, segment: int) -> list[str]:
        return ([f"{vocab.text(k)}:{segment}" for k in before] + [f"{name}:{segment}"]
                + [f"{vocab.text(k)}:{segment}" for k in after])

    specials = list({vocab.text(k): vocab.ids[k] for k in before + after}.items())
    return processors.TemplateProcessing(single=sequence("$A", 0), pair=sequence("$A", 0) + sequence("$B", 1),
                                         special_tokens=specials)


# ----------------------------------------------------------------------------------- files

def tokenizer_config(vocab: Vocab, context_length: int) -> dict:
    from shared.gguf_chat_templates import fallback_chat_template

    pad = vocab.text("padding") or vocab.text("eos")
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": vocab.add_bos and vocab.text("bos") is not None,
        "add_eos_token": vocab.add_eos and vocab.text("eos") is not None,
        "bos_token": vocab.text("bos"),
        "eos_token": vocab.text("eos"),
        "unk_token": vocab.text("unknown"),
        "pad_token": pad,
        "clean_up_tokenization_spaces": False,
        "model_max_length": context_length,
        "chat_template": vocab.chat_template or fallback_chat_template(vocab.tokens),
    }
    return {k: v for k, v in cfg.items() if v is not None}


def write_tokenizer(meta: Metadata, out_dir: Path, context_length: int) -> TokenizerInfo:
    """Write tokenizer.json, tokenizer_config.json and special_tokens_map.json into `out_dir`."""
    out_dir = Path(out_dir)
    vocab = read_vocab(meta)
    tok = build_tokenizer(vocab)
    tok.save(str(out_dir / "tokenizer.json"))
    cfg = tokenizer_config(vocab, context_length)
    _write_json(out_dir / "tokenizer_config.json", cfg)
    _write_json(out_dir / "special_tokens_map.json",
                {k: cfg[k] for k in ("bos_token", "eos_token", "unk_token", "pad_token") if k in cfg})
    pad = vocab.ids.get("padding", vocab.ids.get("eos"))
    return TokenizerInfo(vocab_size=tok.get_vocab_size(with_added_tokens=True), bos_token_id=vocab.ids.get("bos"),
                         eos_token_id=vocab.ids.get("eos"), pad_token_id=pad,
                         eos_token_ids=end_of_generation_ids(vocab))


def _write_json(path: Path, obj) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
