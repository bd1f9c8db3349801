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

import functools
import json
from dataclasses import dataclass, field
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


# Arguments of HF's apply_chat_template: not template variables a request may set.
RESERVED_TEMPLATE_KWARGS = frozenset({"conversation", "messages", "chat_template", "add_generation_prompt",
                                      "continue_final_message", "tokenize", "return_dict", "return_tensors",
                                      "padding", "truncation", "max_length", "tokenizer_kwargs",
                                      "return_assistant_tokens_mask", "tools"})


@dataclass(slots=True)
class ChatTemplateOptions:
    """How a conversation is rendered beyond add_generation_prompt (vLLM's request fields)."""
    continue_final_message: bool = False   # the last (assistant) message is left open: a prefill
    chat_template: str | None = None       # a Jinja template instead of the tokenizer's own
    kwargs: dict[str, Any] = field(default_factory=dict)   # extra template variables
    tools: list[dict] | None = None        # OpenAI tool objects (tokenizer_service/tool_prompt.py)

    def validate(self, add_generation_prompt: bool, messages: list[dict]) -> None:
        if not isinstance(self.continue_final_message, bool):
            raise ValueError("continue_final_message must be a boolean")
        if self.continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be true")
        if self.continue_final_message and messages and messages[-1].get("role") != "assistant":
            raise ValueError("continue_final_message needs an assistant message last")
        if self.chat_template is not None and not isinstance(self.chat_template, str):
            raise ValueError("chat_template must be a string")
        if not isinstance(self.kwargs, dict) or not all(isinstance(k, str) for k in self.kwargs):
            raise ValueError("chat_template_kwargs must be an object")
        reserved = sorted(set(self.kwargs) & RESERVED_TEMPLATE_KWARGS)
        if reserved:
            raise ValueError(f"chat_template_kwargs may not set {', '.join(reserved)}")
        if self.tools is not None and (not isinstance(self.tools, list)
                                       or not all(isinstance(t, dict) for t in self.tools)):
            raise ValueError("tools must be a list of objects")

    def to_dict(self) -> dict[str, Any]:
        d = {"continue_final_message": self.continue_final_message, "chat_template": self.chat_template,
             "chat_template_kwargs": self.kwargs}
        if self.tools:
            d["tools"] = self.tools
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ChatTemplateOptions":
        return cls(d.get("continue_final_message") or False, d.get("chat_template"),
                   d.get("chat_template_kwargs") or {}, d.get("tools"))


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
    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`; special tokens (BOS...) are added only when asked (special-token
        text is parsed either way)."""
        if not isinstance(text, str):
            raise ValueError(f"text must be a string, got {type(text).__name__}")
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`, special tokens skipped unless told otherwise."""
        try:
            return self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens)
        except (OverflowError, TypeError) as e:
            raise ValueError(f"cannot decode token ids: {e}") from None

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                    options: ChatTemplateOptions | None = None) -> str:
        """The prompt text the chat template gives for `messages` (with options.tools: a template
        that renders no tools gets them as a Hermes system prompt instead)."""
        msgs = validate_messages(messages)
        if not isinstance(add_generation_prompt, bool):
            raise ValueError("add_generation_prompt must be a boolean")
        options = options or ChatTemplateOptions()
        options.validate(add_generation_prompt, msgs)
        tools = options.tools
        template_kw = dict(options.kwargs)
        if tools or any(m.get("tool_calls") for m in msgs):
            if template_handles_tools(options.chat_template or getattr(self.hf, "chat_template", None)):
                if tools:
                    template_kw["tools"] = tools
            else:
                msgs = hermes_messages(msgs, tools)
        try:
            from jinja2 import TemplateError
        except ImportError:   # jinja2 comes with transformers' chat templates
            TemplateError = Exception  # type: ignore[misc,assignment]
        try:
            text = self.hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=add_generation_prompt,
                                               continue_final_message=options.continue_final_message,
                                               chat_template=options.chat_template, **template_kw)
        except TemplateError as e:
            raise ValueError(f"the chat template rejected the messages: {e}") from None
        if not isinstance(text, str):   # defensive: some versions wrap single results in a list
            text = text[0]
        return text

    def chat_prompt(self, messages: list[dict], add_generation_prompt: bool = True,
                    options: ChatTemplateOptions | None = None) -> tuple[str, list[int]]:
        """(prompt text, prompt token ids) for `messages`."""
        text = self.render_chat(messages, add_generation_prompt, options)
        return text, self.encode(text)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            options: ChatTemplateOptions | None = None) -> list[int]:
        """Prompt token ids for `messages` (the template's text, encoded without added specials)."""
        return self.chat_prompt(messages, add_generation_prompt, options)[1]

    def detokenizer(self, prompt_ids: Sequence[int] | None = None, skip_special_tokens: bool = True) -> "Detokenizer":
        return Detokenizer(self, self._prompt_context(prompt_ids) if prompt_ids else [], skip_special_tokens)

    def token_strings(self, ids: Sequence[int]) -> list[str]:
        """The text of each token alone, special tokens as their text (logprobs): one batched call.
        A token that is only part of a UTF-8 character is written as OpenAI does, "bytes:\\xe2\\x80"."""
        try:
            texts = self.backend.decode_batch([[i] for i in ids], skip_special_tokens=False)
        except (OverflowError, TypeError, ValueError) as e:
            raise ValueError(f"cannot decode token ids: {e}") from None
        return [t if REPLACEMENT_CHAR not in t else self._bytes_string(i, t) for i, t in zip(ids, texts)]

    def _bytes_string(self, token_id: int, text: str) -> str:
        raw = self.token_bytes(token_id)
        if raw is None:
            return text
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)

    def token_bytes(self, token_id: int) -> bytes | None:
        """The bytes a token stands for, where its vocabulary entry says (byte-level BPE, or a
        SentencePiece byte-fallback "<0xNN>"); None when it cannot tell."""
        piece = self.backend.id_to_token(token_id)
        if piece is None:
            return None
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            return bytes([int(piece[3:5], 16)])
        table = _byte_decoder()
        if all(c in table for c in piece):
            return bytes(table[c] for c in piece)
        return None

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


@functools.lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2 byte-level BPE's character -> byte table."""
    printable = set(range(ord("!"), ord("~") + 1)) | set(range(0xA1, 0xAD)) | set(range(0xAE, 0x100))
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[chr(b)] = b
        else:
            table[chr(256 + extra)] = b
            extra += 1
    return table


class Detokenizer:
    """Streaming text of one generated sequence (not thread-safe; one per request).

    ``DecodeStream`` holds the tokens whose text ends inside a character; they are kept here too
    (``_pending``, with the tokens of the last released piece as context) so ``finish()`` can
    release their text.
    """

    __slots__ = ("_tok", "_stream", "_context", "_pending", "_pieces", "num_tokens", "finished", "_skip")

    def __init__(self, tokenizer: ChatTokenizer, context: list[int], skip_special_tokens: bool = True):
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._stream = DecodeStream(ids=context or None, skip_special_tokens=skip_special_tokens)
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
        def decode(ids):
            return self._tok.decode(ids, self._skip)
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
