"""The tokenizer as a library: encode, chat template, decode and an incremental detokenizer.

``ChatTokenizer`` wraps a Hugging Face tokenizer (``AutoTokenizer``). ``IncrementalDetokenizer``
turns a stream of generated token ids into text pieces, O(1) work per token:

* It keeps two offsets into the tokens, as vLLM does: ``prefix_offset`` .. ``read_offset`` is the
  window whose text was already emitted (kept as context), ``read_offset`` .. end is pending. Each
  step decodes only ``tokens[prefix_offset:]`` (a few tokens) and emits the text beyond the
  context's text, then moves the window forward.
* A byte-level BPE token can end inside a UTF-8 character; the text then decodes with a trailing
  U+FFFD, which is held back until the character is complete (or until ``finish()``). For byte-level
  decoders (UTF-8 with replacement) everything before that last U+FFFD is final and is emitted, so
  the window stays small even where no token boundary falls on a character boundary. For other
  decoders (SentencePiece byte fallback) the window advances only where the text ends in a complete
  character, as in vLLM; when several tokens arrive at once, the text up to the last complete
  character is emitted and only the tail waits.
* Special tokens decode to nothing (``skip_special_tokens=True``); they are dropped from the
  window so a run of them cannot grow it.
* Started after a prompt (``prompt_ids``), the window begins with the prompt's last few tokens,
  so tokenizers whose decoder strips the leading space of the *first* token (SentencePiece
  ``▁word``) still give " word" for the first generated token. The text is then
  ``decode(prompt + ids)[len(decode(prompt)):]``; for byte-level BPE tokenizers (SmolLM2, GPT-2
  style) that equals ``decode(ids)`` exactly, and without ``prompt_ids`` it always does.

Known limit (non-byte-level decoders only, as in vLLM): a long run of tokens that never forms valid
UTF-8 keeps its text pending, so the window grows for as long as the run lasts.
"""
from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any, Callable, Sequence

REPLACEMENT_CHAR = "\ufffd"
ROLES = ("system", "user", "assistant", "tool")
# Prompt tokens kept as decoding context for the first generated tokens.
PROMPT_CONTEXT_TOKENS = 5
# The window's consumed tokens are dropped from the detokenizer's list once this many pile up.
_TRIM_AT = 64
# HF's "no limit" sentinel for model_max_length is 1e30; anything this large means "unset".
_UNSET_MAX_LENGTH = 10**8
MAX_TOKEN_ID = 2**32 - 1


def validate_messages(messages: Any) -> list[dict[str, Any]]:
    """Check chat messages: a non-empty list of {"role": system|user|assistant|tool, "content": str}.

    Extra keys (e.g. "name") are kept for the template. Returns shallow copies; raises ValueError.
    """
    if not isinstance(messages, list):
        raise ValueError(f"'messages' must be a list of message objects, got {type(messages).__name__}")
    if not messages:
        raise ValueError("'messages' must not be empty")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ValueError(f"messages[{i}] must be an object with 'role' and 'content', got {type(m).__name__}")
        role = m.get("role")
        if not isinstance(role, str) or role not in ROLES:
            raise ValueError(f"messages[{i}].role must be one of {', '.join(ROLES)}; got {role!r}")
        if "content" not in m:
            raise ValueError(f"messages[{i}].content is required")
        content = m["content"]
        if not isinstance(content, str):
            raise ValueError(f"messages[{i}].content must be a string, got {type(content).__name__}")
        out.append(dict(m))
    return out


def validate_token_ids(ids: Any, name: str = "token_ids") -> list[int]:
    """A list of ints in [0, 2**32); raises ValueError."""
    if not isinstance(ids, (list, tuple)):
        raise ValueError(f"'{name}' must be a list of integers, got {type(ids).__name__}")
    for i, t in enumerate(ids):
        if isinstance(t, bool) or not isinstance(t, int):
            raise ValueError(f"'{name}[{i}]' must be an integer, got {type(t).__name__}")
        if t < 0 or t > MAX_TOKEN_ID:
            raise ValueError(f"'{name}[{i}]' = {t} is not a valid token id")
    return list(ids)


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _first_int(value: Any) -> int | None:
    if isinstance(value, list):
        value = value[0] if value else None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


class ChatTokenizer:
    """A Hugging Face tokenizer with the operations the server needs. Thread-safe for reads."""

    def __init__(self, hf_tokenizer: Any, model_dir: str | Path | None = None):
        self.hf = hf_tokenizer
        self.model_dir = str(model_dir) if model_dir is not None else None
        cfg = _read_json(Path(model_dir) / "config.json") if model_dir else {}
        gen = _read_json(Path(model_dir) / "generation_config.json") if model_dir else {}

        eos = _first_int(hf_tokenizer.eos_token_id)
        if eos is None:
            eos = _first_int(gen.get("eos_token_id"))
        if eos is None:
            eos = _first_int(cfg.get("eos_token_id"))
        self.eos_token_id: int = -1 if eos is None else eos
        self.bos_token_id: int | None = _first_int(hf_tokenizer.bos_token_id)
        self.vocab_size: int = len(hf_tokenizer)
        mml = getattr(hf_tokenizer, "model_max_length", None)
        if not isinstance(mml, int) or not 0 < mml < _UNSET_MAX_LENGTH:
            mml = _first_int(cfg.get("max_position_embeddings")) or 2**31 - 1
        self.model_max_length: int = mml
        self.special_token_ids: frozenset[int] = frozenset(
            int(i) for i in (getattr(hf_tokenizer, "all_special_ids", None) or []))

        # Window decoding: straight to the Rust tokenizer when that is exactly what HF's decode
        # does (3-5x less overhead per call), with special ids filtered out before they enter the
        # window. Otherwise HF's decode, with special tokens left in the window.
        self._window_decode: Callable[[list[int]], str] = self.decode
        self._skip_ids: frozenset[int] = frozenset()
        backend = getattr(hf_tokenizer, "_tokenizer", None)
        if backend is not None and hasattr(backend, "decode") and hasattr(backend, "get_added_tokens_decoder"):
            try:
                skip = frozenset(i for i, t in backend.get_added_tokens_decoder().items() if t.special)
                fast = lambda ids: backend.decode(ids, skip_special_tokens=True)  # noqa: E731
                if self._same_decode(fast, skip):
                    self._window_decode, self._skip_ids = fast, skip
            except Exception:
                pass
        # Byte-level decoders (GPT-2 style BPE: SmolLM2, Llama 3, Qwen) decode the token bytes as
        # UTF-8 with replacement, which lets the detokenizer emit text between token boundaries
        # that split characters. Other decoders (SentencePiece byte fallback replaces a whole byte
        # run) advance only at token boundaries where the text ends in a complete character.
        self._byte_level = (backend is not None and type(getattr(backend, "decoder", None)).__name__ == "ByteLevel"
                            and self._check_byte_level())

    @classmethod
    def from_pretrained(cls, model_dir: str | Path, **kwargs: Any) -> "ChatTokenizer":
        from transformers import AutoTokenizer
        return cls(AutoTokenizer.from_pretrained(str(model_dir), **kwargs), model_dir)

    def _same_decode(self, fast: Callable[[list[int]], str], skip: frozenset[int]) -> bool:
        """Check on random id sequences that filtered fast decoding equals HF's decode."""
        rng = random.Random(0)
        n = self.vocab_size
        specials = sorted(skip | self.special_token_ids)
        for _ in range(48):
            ids = [rng.randrange(n) for _ in range(rng.randint(1, 12))]
            if specials and rng.random() < 0.5:
                ids.insert(rng.randrange(len(ids) + 1), rng.choice(specials))
            if fast([i for i in ids if i not in skip]) != self.decode(ids):
                return False
        return True

    def _check_byte_level(self) -> bool:
        """Sanity check: decoding a prefix of the tokens gives the full text's prefix, but for a
        trailing U+FFFD; and a window starting inside a character only adds leading U+FFFDs."""
        try:
            for text in ("Émilie 東京は日本の首都です 🙂✓ ü", "a\u00e9\u6771\U0001F642b"):
                ids = self.encode(text)
                for k in range(len(ids) + 1):
                    t = self._window_decode(ids[:k])
                    if not text.startswith(t[:-1] if t.endswith(REPLACEMENT_CHAR) else t):
                        return False
                    tail = self._window_decode(ids[k:]).lstrip(REPLACEMENT_CHAR)
                    if not text.endswith(tail):
                        return False
            return True
        except Exception:
            return False

    # ------------------------------------------------------------------ basic operations
    def encode(self, text: str) -> list[int]:
        """Token ids of `text`; no special tokens are added (special-token text is still parsed)."""
        if not isinstance(text, str):
            raise ValueError(f"text must be a string, got {type(text).__name__}")
        return list(self.hf.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int]) -> str:
        """Text of `ids` with special tokens skipped."""
        try:
            return self.hf.decode(list(ids), skip_special_tokens=True)
        except (OverflowError, TypeError) as e:
            raise ValueError(f"cannot decode token ids: {e}") from None

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """The prompt text the chat template gives for `messages`."""
        msgs = validate_messages(messages)
        if not isinstance(add_generation_prompt, bool):
            raise ValueError("add_generation_prompt must be a boolean")
        try:
            from jinja2 import TemplateError
        except ImportError:   # jinja2 comes with transformers' chat templates
            TemplateError = Exception  # type: ignore[misc,assignment]
        try:
            text = self.hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=add_generation_prompt)
        except TemplateError as e:
            raise ValueError(f"the chat template rejected the messages: {e}") from None
        if not isinstance(text, str):   # defensive: some versions wrap single results in a list
            text = text[0]
        return text

    def chat_prompt(self, messages: list[dict], add_generation_prompt: bool = True) -> tuple[str, list[int]]:
        """(prompt text, prompt token ids) for `messages`."""
        text = self.render_chat(messages, add_generation_prompt)
        return text, self.encode(text)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        """Prompt token ids for `messages` (the template's text, encoded without added specials)."""
        return self.chat_prompt(messages, add_generation_prompt)[1]

    def detokenizer(self, prompt_ids: Sequence[int] | None = None) -> "IncrementalDetokenizer":
        return IncrementalDetokenizer(self, prompt_ids)

    # ------------------------------------------------------------------ incremental decoding
    def _filter(self, ids: Sequence[int]) -> list[int]:
        skip = self._skip_ids
        return [i for i in ids if i not in skip] if skip else list(ids)

    def _prompt_context(self, prompt_ids: Sequence[int]) -> list[int]:
        """The last few (non-special) prompt tokens, or [] when they end inside a character."""
        tail: list[int] = []
        skip = self._skip_ids
        for i in reversed(prompt_ids):
            if i not in skip:
                tail.append(i)
                if len(tail) == PROMPT_CONTEXT_TOKENS:
                    break
        tail.reverse()
        if tail and self._window_decode(tail).endswith(REPLACEMENT_CHAR):
            return []
        return tail

    def _step(self, ids: list[int], prefix_offset: int, read_offset: int, final: bool) -> tuple[str, int, int]:
        """Text completed by ids[read_offset:], given that the text of ids[prefix_offset:read_offset]
        was emitted (less its unfinished last character, in byte-level mode).

        Returns (text, new prefix_offset, new read_offset).
        """
        n = len(ids)
        if read_offset >= n and not (final and self._byte_level):
            return "", prefix_offset, read_offset
        decode = self._window_decode
        prefix_text = decode(ids[prefix_offset:read_offset]) if read_offset > prefix_offset else ""
        new_text = decode(ids[prefix_offset:])
        if self._byte_level:
            # The token bytes are decoded as UTF-8 with replacement: only a trailing U+FFFD (an
            # unfinished character, at most 3 bytes) can still change, all text before it is final.
            # So text is emitted even where no token boundary falls on a character boundary (with
            # BPE merges across characters, as in CJK text, that can last a long stretch).
            raw = new_text
            held = not final and raw.endswith(REPLACEMENT_CHAR)
            if prefix_text.endswith(REPLACEMENT_CHAR):
                prefix_text = prefix_text[:-1]
            if held:
                new_text = raw[:-1]
            if len(new_text) <= len(prefix_text):
                return "", prefix_offset, n
            text = new_text[len(prefix_text):]
            if final:
                return text, n, n
            # Move the window to start at read_offset. It may start inside the last emitted
            # character: those bytes decode as U+FFFD alike in both window texts, so they cancel.
            # The unfinished character, if any, starts at or after read_offset, so it is whole in
            # the new window. Only when the window's text would end in such a leading U+FFFD (the
            # new tokens hold nothing but the rest of one character) keep the old start, or that
            # U+FFFD would later be taken for an unfinished character.
            if held or raw[-1] < "\x80" or not decode(ids[read_offset:]).endswith(REPLACEMENT_CHAR):
                return text, read_offset, n
            return text, prefix_offset, n
        if final or not new_text.endswith(REPLACEMENT_CHAR):
            if len(new_text) > len(prefix_text):
                return new_text[len(prefix_text):], read_offset, n
            return "", prefix_offset, n      # tokens without text: consume them, keep the context
        # The text ends inside a character: emit up to the last complete one. An incomplete UTF-8
        # character is at most 3 bytes, so it starts within the last 3 tokens.
        for end in range(n - 1, max(read_offset, n - 4), -1):
            text = decode(ids[prefix_offset:end])
            if not text.endswith(REPLACEMENT_CHAR):
                if len(text) > len(prefix_text):
                    return text[len(prefix_text):], read_offset, end
                return "", prefix_offset, end
        return "", prefix_offset, read_offset

    def _pending(self, ids: list[int], prefix_offset: int, read_offset: int) -> bool:
        """Whether text is held back (so that finishing would emit more)."""
        if read_offset < len(ids):
            return True
        return (self._byte_level and read_offset > prefix_offset
                and self._window_decode(ids[prefix_offset:read_offset]).endswith(REPLACEMENT_CHAR))

    def detokenize_step(self, token_ids: Sequence[int], prefix_offset: int, read_offset: int,
                        final: bool = False) -> tuple[str, int, int]:
        """Stateless incremental detokenization (what POST /detokenize with offsets does).

        `token_ids[prefix_offset:read_offset]` is text already emitted (kept as context),
        `token_ids[read_offset:]` is new. Returns (new text, prefix_offset, read_offset) for the next
        call with the same list extended by new tokens. Text ending inside a UTF-8 character is held
        back unless `final`. Start with prefix_offset = read_offset = 0 (or the prompt's last tokens
        with prefix_offset = 0, read_offset = their count).
        """
        ids = validate_token_ids(token_ids)
        for name, v in (("prefix_offset", prefix_offset), ("read_offset", read_offset)):
            if type(v) is not int:
                raise ValueError(f"'{name}' must be an integer")
        if not 0 <= prefix_offset <= read_offset <= len(ids):
            raise ValueError(f"offsets must satisfy 0 <= prefix_offset <= read_offset <= len(token_ids); got "
                             f"prefix_offset={prefix_offset}, read_offset={read_offset}, len={len(ids)}")
        try:
            return self._step(ids, prefix_offset, read_offset, bool(final))
        except (OverflowError, TypeError) as e:
            raise ValueError(f"cannot decode token ids: {e}") from None


class IncrementalDetokenizer:
    """Streaming text for one sequence of generated tokens (not thread-safe; one per request)."""

    def __init__(self, tokenizer: ChatTokenizer, prompt_ids: Sequence[int] | None = None):
        self._tok = tokenizer
        self._ids: list[int] = tokenizer._prompt_context(prompt_ids) if prompt_ids else []
        self._prefix = 0
        self._read = len(self._ids)
        self._pieces: list[str] = []
        self._text = ""
        self._dirty = False
        self._finished = False
        self.num_tokens = 0   # generated tokens added so far (special tokens included)

    def add(self, token_ids: Sequence[int]) -> str:
        """Add generated tokens; returns the newly completed text (never half a character)."""
        if self._finished:
            raise RuntimeError("add() after finish()")
        if isinstance(token_ids, int):
            token_ids = [token_ids]
        self.num_tokens += len(token_ids)
        new = self._tok._filter(token_ids)
        if not new:
            return ""
        n0 = len(self._ids)
        self._ids.extend(new)
        try:
            return self._advance(False)
        except ValueError:
            del self._ids[n0:]   # leave the detokenizer as it was
            raise

    def finish(self) -> str:
        """The text still held back (an unfinished character decodes as U+FFFD). Idempotent."""
        if self._finished:
            return ""
        self._finished = True
        return self._advance(True)

    def _advance(self, final: bool) -> str:
        try:
            text, self._prefix, self._read = self._tok._step(self._ids, self._prefix, self._read, final)
        except (OverflowError, TypeError) as e:
            raise ValueError(f"cannot decode token ids: {e}") from None
        if self._prefix >= _TRIM_AT:
            del self._ids[:self._prefix]
            self._read -= self._prefix
            self._prefix = 0
        if text:
            self._pieces.append(text)
            self._dirty = True
        return text

    @property
    def text(self) -> str:
        """All text emitted so far."""
        if self._dirty:
            self._text = "".join(self._pieces)
            self._pieces = [self._text]
            self._dirty = False
        return self._text

    @property
    def finished(self) -> bool:
        return self._finished
