"""The tokenizer as a library: encode, chat template, decode and an incremental detokenizer.

``ChatTokenizer`` wraps a Hugging Face fast tokenizer (``AutoTokenizer``). ``Detokenizer`` turns a
stream of generated token ids into text pieces with the tokenizers library's ``DecodeStream``
(special tokens skipped): a piece is released once its text no longer ends inside a UTF-8
character, so a character split over tokens arrives whole. Started after a prompt, the stream
begins with the prompt's last few tokens as context, so decoders that strip the leading space of
the first token (SentencePiece ``▁word``) still give " word". ``finish()`` releases what is held
back, as ``decode`` gives it (an unfinished character as U+FFFD).

``token_strings`` gives the text of many single tokens in one call (logprobs).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

from tokenizers.decoders import DecodeStream

from .tool_prompt import hermes_messages, template_handles_tools

REPLACEMENT_CHAR = "\ufffd"
ROLES = ("system", "user", "assistant", "tool")
# Prompt tokens kept as decoding context for the first generated tokens.
PROMPT_CONTEXT_TOKENS = 5
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

        self.backend = getattr(hf_tokenizer, "_tokenizer", None)   # tokenizers.Tokenizer
        if self.backend is None or not hasattr(self.backend, "decode_batch"):
            raise ValueError("a fast (tokenizers-backed) tokenizer is required")
        self._skip_ids: frozenset[int] = frozenset(
            i for i, t in self.backend.get_added_tokens_decoder().items() if t.special) | self.special_token_ids

    @classmethod
    def from_pretrained(cls, model_dir: str | Path, **kwargs: Any) -> "ChatTokenizer":
        from transformers import AutoTokenizer
        return cls(AutoTokenizer.from_pretrained(str(model_dir), **kwargs), model_dir)

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

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                    tools: list[dict] | None = None) -> str:
        """The prompt text the chat template gives for `messages` (and `tools`: OpenAI tool objects)."""
        msgs = validate_messages(messages)
        if not isinstance(add_generation_prompt, bool):
            raise ValueError("add_generation_prompt must be a boolean")
        if tools is not None and (not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools)):
            raise ValueError("tools must be a list of objects")
        uses_tools = bool(tools) or any(m.get("tool_calls") for m in msgs)
        template_kw = {}
        if uses_tools and template_handles_tools(getattr(self.hf, "chat_template", None)):
            template_kw = {"tools": tools} if tools else {}
        elif uses_tools:
            msgs = hermes_messages(msgs, tools)
        try:
            from jinja2 import TemplateError
        except ImportError:   # jinja2 comes with transformers' chat templates
            TemplateError = Exception  # type: ignore[misc,assignment]
        try:
            text = self.hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=add_generation_prompt,
                                               **template_kw)
        except TemplateError as e:
            raise ValueError(f"the chat template rejected the messages: {e}") from None
        if not isinstance(text, str):   # defensive: some versions wrap single results in a list
            text = text[0]
        return text

    def chat_prompt(self, messages: list[dict], add_generation_prompt: bool = True,
                    tools: list[dict] | None = None) -> tuple[str, list[int]]:
        """(prompt text, prompt token ids) for `messages`."""
        text = self.render_chat(messages, add_generation_prompt, tools)
        return text, self.encode(text)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None) -> list[int]:
        """Prompt token ids for `messages` (the template's text, encoded without added specials)."""
        return self.chat_prompt(messages, add_generation_prompt, tools)[1]

    def detokenizer(self, prompt_ids: Sequence[int] | None = None) -> "Detokenizer":
        return Detokenizer(self, self._prompt_context(prompt_ids) if prompt_ids else [])

    def token_strings(self, ids: Sequence[int]) -> list[str]:
        """The text of each token alone (special tokens give ""): one batched call."""
        try:
            return self.backend.decode_batch([[i] for i in ids], skip_special_tokens=True)
        except (OverflowError, TypeError, ValueError) as e:
            raise ValueError(f"cannot decode token ids: {e}") from None

    def _prompt_context(self, prompt_ids: Sequence[int]) -> list[int]:
        """The last few (non-special) prompt tokens, or [] when they end inside a character."""
        tail: list[int] = []
        for i in reversed(prompt_ids):
            if i not in self._skip_ids:
                tail.append(i)
                if len(tail) == PROMPT_CONTEXT_TOKENS:
                    break
        tail.reverse()
        if tail and self.decode(tail).endswith(REPLACEMENT_CHAR):
            return []
        return tail


class Detokenizer:
    """Streaming text of one generated sequence (not thread-safe; one per request).

    ``DecodeStream`` holds the tokens whose text ends inside a character; they are kept here too
    (``_pending``, with the tokens of the last released piece as context) so ``finish()`` can
    release their text.
    """

    __slots__ = ("_tok", "_stream", "_context", "_pending", "_pieces", "num_tokens", "finished")

    def __init__(self, tokenizer: ChatTokenizer, context: list[int]):
        self._tok = tokenizer
        self._stream = DecodeStream(ids=context or None, skip_special_tokens=True)
        self._context: list[int] = list(context)
        self._pending: list[int] = []
        self._pieces: list[str] = []
        self.num_tokens = 0          # generated tokens added so far (special tokens included)
        self.finished = False

    def add(self, token_ids: Sequence[int]) -> str:
        """Add generated tokens; returns the newly completed text (never half a character)."""
        if self.finished:
            raise RuntimeError("add() after finish()")
        ids = [token_ids] if isinstance(token_ids, int) else list(token_ids)
        if not ids:
            return ""
        try:
            text = self._stream.step(self._tok.backend, ids)
        except Exception as e:      # the Rust side raises its own exception types
            raise ValueError(f"cannot decode token ids: {e}") from None
        self.num_tokens += len(ids)
        if text is None:
            self._pending.extend(ids)
            return ""
        self._context = self._pending + ids
        self._pending = []
        self._pieces.append(text)
        return text

    def finish(self) -> str:
        """The text still held back (an unfinished character decodes as U+FFFD). Idempotent."""
        if self.finished:
            return ""
        self.finished = True
        if not self._pending:
            return ""
        decode = self._tok.decode
        base, full = decode(self._context), decode(self._context + self._pending)
        text = full[len(base):] if full.startswith(base) else decode(self._pending)
        self._pending = []
        if text:
            self._pieces.append(text)
        return text

    @property
    def text(self) -> str:
        """All text released so far."""
        if len(self._pieces) > 1:
            self._pieces = ["".join(self._pieces)]
        return self._pieces[0] if self._pieces else ""
