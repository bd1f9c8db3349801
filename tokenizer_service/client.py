"""One async tokenizer interface for the gateway's prompts: in-process by default, over HTTP when given a URL.

Only prompts go through it (encode, chat templates, an echoed prompt's text). Generated tokens are
always detokenized in the gateway process (``ChatTokenizer.detokenizer``), never over HTTP.

    t = make_tokenizer(model_dir)                        # in-process (wraps ChatTokenizer)
    t = make_tokenizer(model_dir, "http://127.0.0.1:8001")  # the tokenizer service

Errors: ValueError for bad input (the service's 400s become ValueError too), TokenizerUnavailable
when the service cannot be reached, times out or fails.
"""
from __future__ import annotations

import abc
import asyncio
from typing import Any

import httpx

from .tokenizer import ChatTemplateOptions, ChatTokenizer, validate_messages

# Above this much text (characters) or this many ids, in-process work runs on a worker thread so
# the event loop keeps serving other requests.
OFFLOAD_CHARS = 8192
OFFLOAD_IDS = 8192


class TokenizerUnavailable(RuntimeError):
    """The tokenizer service cannot be reached, timed out, or failed (not the caller's fault)."""


class AsyncTokenizer(abc.ABC):
    """What the gateway uses. eos_token_id, vocab_size and model_max_length are ints."""

    eos_token_id: int
    vocab_size: int
    model_max_length: int

    @abc.abstractmethod
    async def encode(self, text: str, add_special_tokens: bool = False) -> list[int]: ...

    @abc.abstractmethod
    async def chat_prompt(self, messages: list[dict], add_generation_prompt: bool = True,
                          options: ChatTemplateOptions | None = None) -> tuple[str, list[int]]: ...

    @abc.abstractmethod
    async def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...

    async def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                                  options: ChatTemplateOptions | None = None) -> list[int]:
        return (await self.chat_prompt(messages, add_generation_prompt, options))[1]

    async def render_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                          options: ChatTemplateOptions | None = None) -> str:
        return (await self.chat_prompt(messages, add_generation_prompt, options))[0]

    async def start(self) -> None:
        """Optional: get ready (the remote tokenizer fetches /info) without blocking the loop."""

    async def aclose(self) -> None:
        pass

    async def __aenter__(self) -> "AsyncTokenizer":
        await self.start()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.aclose()


# ---------------------------------------------------------------------- in-process
class LocalAsyncTokenizer(AsyncTokenizer):
    def __init__(self, tokenizer: ChatTokenizer):
        self.tokenizer = tokenizer

    @property
    def eos_token_id(self) -> int:  # type: ignore[override]
        return self.tokenizer.eos_token_id

    @property
    def vocab_size(self) -> int:  # type: ignore[override]
        return self.tokenizer.vocab_size

    @property
    def model_max_length(self) -> int:  # type: ignore[override]
        return self.tokenizer.model_max_length

    @property
    def special_token_ids(self) -> frozenset[int]:
        return self.tokenizer.special_token_ids

    async def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        if isinstance(text, str) and len(text) > OFFLOAD_CHARS:
            return await asyncio.to_thread(self.tokenizer.encode, text, add_special_tokens)
        return self.tokenizer.encode(text, add_special_tokens)

    async def chat_prompt(self, messages: list[dict], add_generation_prompt: bool = True,
                          options: ChatTemplateOptions | None = None) -> tuple[str, list[int]]:
        msgs = validate_messages(messages)
        if sum(len(m["content"]) for m in msgs) > OFFLOAD_CHARS or (options is not None and options.tools):
            return await asyncio.to_thread(self.tokenizer.chat_prompt, msgs, add_generation_prompt, options)
        return self.tokenizer.chat_prompt(msgs, add_generation_prompt, options)

    async def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        if len(ids) > OFFLOAD_IDS:
            return await asyncio.to_thread(self.tokenizer.decode, ids, skip_special_tokens)
        return self.tokenizer.decode(ids, skip_special_tokens)


# ---------------------------------------------------------------------- over HTTP
def default_timeout() -> httpx.Timeout:
    return httpx.Timeout(connect=2.0, read=30.0, write=30.0, pool=10.0)


class RemoteAsyncTokenizer(AsyncTokenizer):
    """The tokenizer service over HTTP (httpx.AsyncClient with explicit timeouts).

    eos_token_id, vocab_size and model_max_length come from GET /info, fetched once: by start(),
    by the first request, or (blocking, once) by the first attribute read before either.
    """

    def __init__(self, url: str, timeout: httpx.Timeout | None = None, transport: Any = None):
        if not url:
            raise ValueError("the tokenizer service URL is empty")
        self.url = url.rstrip("/")
        self._timeout = timeout or default_timeout()
        self._client = httpx.AsyncClient(
            base_url=self.url, timeout=self._timeout,
            transport=transport or httpx.AsyncHTTPTransport(retries=1),   # retries failed connects only
            limits=httpx.Limits(max_connections=256, max_keepalive_connections=64),
            trust_env=False,   # an internal service: never through HTTP(S)_PROXY
        )
        self._info: dict[str, Any] | None = None
        self._skip: frozenset[int] = frozenset()

    # ---- /info
    def _set_info(self, info: Any) -> dict[str, Any]:
        try:
            info = dict(info)
            for k in ("eos_token_id", "vocab_size", "model_max_length"):
                info[k] = int(info[k])
            self._skip = frozenset(int(i) for i in info.get("special_token_ids") or ())
        except (KeyError, TypeError, ValueError):
            raise TokenizerUnavailable("the tokenizer service sent a malformed /info answer") from None
        self._info = info
        return info

    async def info(self) -> dict[str, Any]:
        if self._info is None:
            self._set_info(await self._request("GET", "/info"))
        return self._info  # type: ignore[return-value]

    async def start(self) -> None:
        await self.info()

    def _info_sync(self) -> dict[str, Any]:
        if self._info is None:
            try:
                r = httpx.get(self.url + "/info", timeout=httpx.Timeout(5.0, connect=2.0), trust_env=False)
                r.raise_for_status()
                self._set_info(r.json())
            except (httpx.HTTPError, ValueError) as e:
                raise TokenizerUnavailable(f"tokenizer service at {self.url} is unavailable: {e}") from None
        return self._info  # type: ignore[return-value]

    @property
    def eos_token_id(self) -> int:  # type: ignore[override]
        return self._info_sync()["eos_token_id"]

    @property
    def vocab_size(self) -> int:  # type: ignore[override]
        return self._info_sync()["vocab_size"]

    @property
    def model_max_length(self) -> int:  # type: ignore[override]
        return self._info_sync()["model_max_length"]

    @property
    def special_token_ids(self) -> frozenset[int]:
        self._info_sync()
        return self._skip

    # ---- requests
    async def _request(self, method: str, path: str, body: Any = None) -> Any:
        try:
            r = await self._client.request(method, path, json=body)
        except httpx.TransportError as e:
            raise TokenizerUnavailable(f"tokenizer service at {self.url} is unavailable: "
                                       f"{type(e).__name__}: {e}") from None
        if r.status_code in (400, 413, 422):
            raise ValueError(_error_message(r))
        if r.status_code != 200:
            raise TokenizerUnavailable(f"tokenizer service at {self.url} answered {r.status_code}: {_error_message(r)}")
        try:
            return r.json()
        except ValueError:
            raise TokenizerUnavailable(f"tokenizer service at {self.url} sent invalid JSON") from None

    async def _ready(self) -> None:
        if self._info is None:
            await self.info()

    async def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        if not isinstance(text, str):
            raise ValueError(f"text must be a string, got {type(text).__name__}")
        await self._ready()
        body = {"text": text, "add_special_tokens": add_special_tokens}
        return list((await self._request("POST", "/tokenize", body))["token_ids"])

    async def chat_prompt(self, messages: list[dict], add_generation_prompt: bool = True,
                          options: ChatTemplateOptions | None = None) -> tuple[str, list[int]]:
        msgs = validate_messages(messages)
        if not isinstance(add_generation_prompt, bool):
            raise ValueError("add_generation_prompt must be a boolean")
        options = options or ChatTemplateOptions()
        options.validate(add_generation_prompt, msgs)
        await self._ready()
        data = await self._request("POST", "/chat/template", {"messages": msgs, "add_generation_prompt":
                                                              add_generation_prompt, **options.to_dict()})
        return data["prompt"], list(data["token_ids"])

    async def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        await self._ready()
        body = {"token_ids": list(ids), "skip_special_tokens": skip_special_tokens}
        return (await self._request("POST", "/detokenize", body))["text"]

    async def aclose(self) -> None:
        await self._client.aclose()


def _error_message(r: httpx.Response) -> str:
    try:
        err = r.json().get("error") or {}
        msg = err.get("message") if isinstance(err, dict) else str(err)
        if msg:
            return str(msg)
    except (ValueError, AttributeError):
        pass
    return (r.text or r.reason_phrase or str(r.status_code))[:500]


def make_tokenizer(model_dir: str, url: str = "", local: ChatTokenizer | None = None) -> AsyncTokenizer:
    """The gateway's tokenizer: in-process (`local`, or loaded from `model_dir`) when `url` is "",
    else the service at `url`.

    `model_dir` "" means the default model (shared.gguf_convert.ensure_default_model()). The remote
    tokenizer does not connect here; it fetches /info on first use.
    """
    if url:
        return RemoteAsyncTokenizer(url)
    if local is not None:
        return LocalAsyncTokenizer(local)
    if not model_dir:
        from shared.gguf_convert import ensure_default_model
        model_dir = str(ensure_default_model())
    return LocalAsyncTokenizer(ChatTokenizer.from_pretrained(model_dir))
