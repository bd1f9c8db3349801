"""Streaming and non-streaming OpenAI responses built from the choices' pieces, each body and chunk
written through its model in gateway/api/response_models.py."""
from __future__ import annotations

import asyncio
import logging
import math
from typing import Any, AsyncIterator, Awaitable, Callable

from ..backend.generation import SubGeneration
from ..backend.output import Logprob, Piece
from .errors import APIError, GenerationError
from .openai_api import ParsedRequest
from .response_models import (ChatCompletionChunk, ChatCompletionResponse, CompletionChunk, CompletionResponse,
                              ErrorResponse, Reply, encode, sse)
from .tools import ToolStream, extract

log = logging.getLogger("kaiten.gateway")

DONE = b"data: [DONE]\n\n"


def _lp(v: float) -> float:
    """A JSON-safe logprob (no -inf/NaN)."""
    v = float(v)
    if math.isnan(v):
        return -9999.0
    return max(v, -9999.0)


# ---------------------------------------------------------------------- merging choices
async def merged(gens: list[SubGeneration]) -> AsyncIterator[tuple[SubGeneration, Piece]]:
    """The pieces of every choice as they come; the first error raises (GenerationError)."""
    if len(gens) == 1:
        g = gens[0]
        async for p in g.pieces():
            yield g, p
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(g: SubGeneration) -> None:
        try:
            async for p in g.pieces():
                queue.put_nowait((g, p))
            queue.put_nowait((g, None))
        except GenerationError as e:
            queue.put_nowait((g, e))
        except asyncio.CancelledError:
            raise
        except Exception as e:
            log.exception("choice %s failed", g.sub.request_id)
            queue.put_nowait((g, GenerationError(500, f"internal error: {type(e).__name__}", code="internal_error")))

    tasks = [asyncio.create_task(pump(g)) for g in gens]
    try:
        remaining = len(gens)
        while remaining:
            g, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield g, item
    finally:
        for t in tasks:
            t.cancel()


def usage(parsed: ParsedRequest, gens: list[SubGeneration]) -> dict[str, Any]:
    prompt = sum(len(p) for p in parsed.prompts)
    completion = 0 if parsed.echo_only else sum(g.completion_tokens for g in gens)
    cached = sum(g.num_cached_tokens for g in gens if g.sub.index % parsed.n == 0)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def _token_bytes(token: str) -> list[int]:
    """A logprob token's bytes: those a "bytes:\\xNN..." name spells out, else its UTF-8."""
    if token.startswith("bytes:\\x"):
        try:
            return list(bytes.fromhex(token[6:].replace("\\x", "")))
        except ValueError:
            pass
    return list(token.encode("utf-8"))


# ---------------------------------------------------------------------- logprobs shapes
class CompletionLogprobs:
    """Completions API: {tokens, token_logprobs, top_logprobs, text_offset}."""

    def __init__(self, top_n: int, offset: int = 0):
        self.top_n, self.offset = top_n, offset

    def build_prompt(self, g: SubGeneration) -> dict[str, Any]:
        """The echoed prompt's entries: its first token has no logprob (None, as in vLLM)."""
        s = g.state
        out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for tid, lp in zip(g.sub.prompt_ids, s.prompt_logprobs or [None] * len(g.sub.prompt_ids)):
            text = s.prompt_strings.get(tid, "")
            out["tokens"].append(text)
            out["token_logprobs"].append(None if lp is None else _lp(lp.logprob))
            top = None
            if lp is not None and self.top_n > 0:
                top = {}
                for t, v in lp.top[: self.top_n]:
                    top.setdefault(s.prompt_strings.get(t, ""), _lp(v))
            out["top_logprobs"].append(top)
            out["text_offset"].append(self.offset)
            self.offset += len(text)
        return out

    @staticmethod
    def join(a: dict[str, list], b: dict[str, list]) -> dict[str, list]:
        return {k: a[k] + b[k] for k in a}

    def build(self, lps: list[Logprob] | None) -> dict[str, Any]:
        out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for lp in lps or []:
            s = lp.token
            out["tokens"].append(s)
            out["token_logprobs"].append(_lp(lp.logprob))
            if self.top_n > 0:
                # A dict keyed by token text (the API's shape): where two tokens share a text
                # (say, a special token and its plain spelling) the likelier one's entry is kept.
                top: dict[str, float] = {}
                for t, v in lp.top[: self.top_n]:
                    top.setdefault(t, _lp(v))
                out["top_logprobs"].append(top)
            else:
                out["top_logprobs"].append(None)
            out["text_offset"].append(self.offset)
            self.offset += len(s)
        return out


def prompt_logprobs_field(g: SubGeneration, top_n: int | None) -> list | None:
    """vLLM's prompt_logprobs: per prompt token None (the first) or {token id: {logprob, rank,
    decoded_token}}, the prompt token itself first, then the top `top_n`."""
    s = g.state
    if top_n is None or s.prompt_logprobs is None:
        return None
    out: list = []
    for lp in s.prompt_logprobs:
        if lp is None:
            out.append(None)
            continue
        entry = {str(lp.token_id): {"logprob": _lp(lp.logprob), "rank": lp.rank,
                                    "decoded_token": s.prompt_strings.get(lp.token_id, "")}}
        for rank, (t, v) in enumerate(lp.top[:top_n], start=1):
            entry.setdefault(str(t), {"logprob": _lp(v), "rank": rank, "decoded_token": s.prompt_strings.get(t, "")})
        out.append(entry)
    return out


def chat_logprobs(lps: list[Logprob] | None, top_n: int) -> dict[str, Any]:
    content = []
    for lp in lps or []:
        content.append({
            "token": lp.token, "logprob": _lp(lp.logprob), "bytes": _token_bytes(lp.token),
            "top_logprobs": [{"token": t, "logprob": _lp(v), "bytes": _token_bytes(t)}
                             for t, v in lp.top[:top_n]],
        })
    return {"content": content, "refusal": None}


# ---------------------------------------------------------------------- streams
def _chunker(parsed: ParsedRequest, gens: list[SubGeneration], rid: str, created: int,
             model: type[Reply], obj: str) -> Callable[..., bytes]:
    """The SSE frame of one streamed chunk (a `model` whose "object" field is `obj`). With
    continuous_usage_stats every chunk carries the usage so far."""
    def chunk(choices: list, **extra) -> bytes:
        d = {"id": rid, "object": obj, "created": created, "model": parsed.model, "choices": choices}
        if parsed.include_usage:
            d["usage"] = usage(parsed, gens) if parsed.continuous_usage and choices else None
        d.update(extra)
        return sse(model, d)
    return chunk


async def _stream(gw, parsed: ParsedRequest, gens: list[SubGeneration], rid: str, chunk: Callable[..., bytes],
                  frames: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """`frames`, the usage chunk if asked for, then [DONE]. An error ends the stream with an error
    frame (never a cut); the outcome is recorded either way."""
    error: APIError | None = None
    try:
        async for frame in frames:
            yield frame
        if parsed.include_usage:
            yield chunk([], usage=usage(parsed, gens))
    except APIError as e:
        error = e
        yield sse(ErrorResponse, e.body())
    except asyncio.CancelledError:
        gw.metrics_of(parsed).error("client_disconnected")
        raise
    except Exception as e:              # a bug: still end the stream with an error, not a cut
        log.exception("stream %s failed", rid)
        error = APIError(500, f"internal error: {type(e).__name__}", code="internal_error")
        yield sse(ErrorResponse, error.body())
    gw.record(gens, error)
    yield DONE


# ---------------------------------------------------------------------- completions
def completion_sse(gw, parsed: ParsedRequest, gens: list[SubGeneration], rid: str,
                   created: int) -> AsyncIterator[bytes]:
    chunk = _chunker(parsed, gens, rid, created, CompletionChunk, "text_completion")
    lp_builders = {g.sub.index: CompletionLogprobs(parsed.logprobs or 0) for g in gens}

    # With logprobs the echoed prompt waits for its logprobs, which come with the first token.
    echo_waits = parsed.echo and parsed.logprobs is not None

    async def echo_chunk(g: SubGeneration) -> bytes:
        text = (g.sub.prompt_text if g.sub.prompt_text is not None
                else await parsed.ctx.tokenizer.decode(g.sub.prompt_ids))
        lp = lp_builders[g.sub.index].build_prompt(g) if parsed.logprobs is not None else None
        return chunk([{"index": g.sub.index, "text": text, "logprobs": lp, "finish_reason": None,
                       "stop_reason": None}])

    async def frames() -> AsyncIterator[bytes]:
        echoed = set()
        if parsed.echo and not echo_waits:
            for g in gens:
                echoed.add(g.sub.index)
                yield await echo_chunk(g)
        async for g, p in merged(gens):
            if parsed.echo and p.index not in echoed:
                echoed.add(p.index)
                yield await echo_chunk(g)
            if parsed.echo_only:
                if p.finish_reason is not None:
                    yield chunk([{"index": p.index, "text": "", "logprobs": None, "finish_reason": "length",
                                  "stop_reason": None}])
                continue
            if not p.text and p.finish_reason is None and not p.logprobs:
                continue
            lp = lp_builders[p.index].build(p.logprobs) if parsed.logprobs is not None else None
            yield chunk([{"index": p.index, "text": p.text, "logprobs": lp, "finish_reason": p.finish_reason,
                          "stop_reason": g.stop_reason if p.finish_reason else None}])

    return _stream(gw, parsed, gens, rid, chunk, frames())


def completion_response(gw, parsed: ParsedRequest, gens: list[SubGeneration], pieces: dict[int, list[Piece]],
                        rid: str, created: int, prompt_texts: dict[int, str]) -> bytes:
    choices = []
    for g in sorted(gens, key=lambda g: g.sub.index):
        ps = [] if parsed.echo_only else pieces.get(g.sub.index, [])
        text = "".join(p.text for p in ps)
        prefix = prompt_texts.get(g.sub.index, "") if parsed.echo else ""
        lp = None
        if parsed.logprobs is not None:
            lps = [x for p in ps for x in (p.logprobs or [])]
            if parsed.echo:
                builder = CompletionLogprobs(parsed.logprobs)
                lp = builder.join(builder.build_prompt(g), builder.build(lps))
            else:
                lp = CompletionLogprobs(parsed.logprobs, len(prefix)).build(lps)
        finish, stop_reason = ("length", None) if parsed.echo_only else (g.finish_reason, g.stop_reason)
        choices.append({"index": g.sub.index, "text": prefix + text, "logprobs": lp, "finish_reason": finish,
                        "stop_reason": stop_reason,
                        "prompt_logprobs": prompt_logprobs_field(g, parsed.prompt_logprobs)})
    return encode(CompletionResponse, {"id": rid, "object": "text_completion", "created": created,
                                       "model": parsed.model, "choices": choices, "usage": usage(parsed, gens)})


# ---------------------------------------------------------------------- chat
def chat_sse(gw, parsed: ParsedRequest, gens: list[SubGeneration], rid: str,
             created: int) -> AsyncIterator[bytes]:
    chunk = _chunker(parsed, gens, rid, created, ChatCompletionChunk, "chat.completion.chunk")
    want_lp = parsed.logprobs is not None
    calling = parsed.tools if parsed.tools is not None and parsed.tools.parses_output else None
    tool_streams = {g.sub.index: ToolStream(calling) for g in gens} if calling else {}

    async def frames() -> AsyncIterator[bytes]:
        for g in gens:
            yield chunk([{"index": g.sub.index, "delta": {"role": "assistant", "content": ""},
                          "logprobs": None, "finish_reason": None}])
        async for g, p in merged(gens):
            lp = chat_logprobs(p.logprobs, parsed.logprobs or 0) if want_lp and p.logprobs else None
            ts = tool_streams.get(p.index)
            deltas = ts.feed(p.text) if ts and p.text else [{"content": p.text}] if p.text else []
            if lp is not None and not deltas:
                deltas = [{"content": ""}]
            for i, delta in enumerate(deltas):
                yield chunk([{"index": p.index, "delta": delta, "logprobs": lp if i == 0 else None,
                              "finish_reason": None}])
            if p.finish_reason is not None:
                finish = p.finish_reason
                if ts is not None:
                    for delta in ts.finish():
                        yield chunk([{"index": p.index, "delta": delta, "logprobs": None, "finish_reason": None}])
                    finish = "tool_calls" if ts.num_calls and finish == "stop" else finish
                yield chunk([{"index": p.index, "delta": {}, "logprobs": None, "finish_reason": finish,
                              "stop_reason": g.stop_reason}])

    return _stream(gw, parsed, gens, rid, chunk, frames())


def chat_response(gw, parsed: ParsedRequest, gens: list[SubGeneration], pieces: dict[int, list[Piece]],
                  rid: str, created: int) -> bytes:
    choices = []
    for g in sorted(gens, key=lambda g: g.sub.index):
        ps = pieces.get(g.sub.index, [])
        lp = None
        if parsed.logprobs is not None:
            lp = chat_logprobs([x for p in ps for x in (p.logprobs or [])], parsed.logprobs)
        message, finish = _chat_message(parsed, "".join(p.text for p in ps), g.finish_reason)
        choices.append({"index": g.sub.index, "message": message, "logprobs": lp, "finish_reason": finish,
                        "stop_reason": g.stop_reason})
    return encode(ChatCompletionResponse, {
        "id": rid, "object": "chat.completion", "created": created, "model": parsed.model, "choices": choices,
        "usage": usage(parsed, gens), "prompt_logprobs": prompt_logprobs_field(gens[0], parsed.prompt_logprobs)})


def _chat_message(parsed: ParsedRequest, text: str, finish: str | None) -> tuple[dict[str, Any], str | None]:
    """The assistant message of a finished choice, its tool calls parsed out, and its finish reason."""
    if parsed.tools is None or not parsed.tools.parses_output or finish != "stop":
        return {"role": "assistant", "content": text}, finish
    content, calls = extract(parsed.tools, text)
    if not calls:
        return {"role": "assistant", "content": text}, finish
    return {"role": "assistant", "content": content, "tool_calls": calls}, "tool_calls"


async def collect(gens: list[SubGeneration]) -> dict[int, list[Piece]]:
    pieces: dict[int, list[Piece]] = {g.sub.index: [] for g in gens}
    async for g, p in merged(gens):
        pieces[g.sub.index].append(p)
    return pieces


# ---------------------------------------------------------------------- the SSE response
KEEPALIVE_COMMENT = b": keep-alive\n\n"


class SSEResponse:
    """Streams an async iterator of SSE frames; a client disconnect cancels it at once.

    ``on_close`` always runs at the end (normal end, error or disconnect): the gateway aborts the
    engine requests that may still run. With ``keepalive`` > 0 (off by default, as in vLLM), while no
    frame comes for that long a ``: keep-alive`` comment keeps proxies from closing the idle
    connection; clients that strip each network read before splitting events (vllm bench serve)
    glue a comment that arrives alone to every event after it.
    """

    def __init__(self, frames: AsyncIterator[bytes], on_close: Callable[[], Awaitable[None] | None],
                 keepalive: float = 0.0):
        self.frames = frames
        self.on_close = on_close
        self.keepalive = keepalive if keepalive > 0 else None

    async def __call__(self, scope, receive, send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": [
            (b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
            (b"x-accel-buffering", b"no")]})

        async def wait_disconnect() -> None:
            while True:
                msg = await receive()
                if msg["type"] == "http.disconnect":
                    return

        listener = asyncio.create_task(wait_disconnect())
        disconnected = False
        try:
            while True:
                nxt = asyncio.ensure_future(self.frames.__anext__())
                done, _ = await asyncio.wait({nxt, listener}, timeout=self.keepalive,
                                             return_when=asyncio.FIRST_COMPLETED)
                while not done:              # idle for `keepalive` seconds
                    try:
                        await send({"type": "http.response.body", "body": KEEPALIVE_COMMENT, "more_body": True})
                    except OSError:
                        done = {listener}    # gone: handled as a disconnect below
                        break
                    done, _ = await asyncio.wait({nxt, listener}, timeout=self.keepalive,
                                                 return_when=asyncio.FIRST_COMPLETED)
                if nxt not in done:
                    disconnected = True
                    nxt.cancel()
                    await asyncio.gather(nxt, return_exceptions=True)
                    break
                try:
                    frame = nxt.result()
                except StopAsyncIteration:
                    break
                try:
                    await send({"type": "http.response.body", "body": frame, "more_body": True})
                except OSError:
                    disconnected = True
                    break
            if not disconnected:
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            listener.cancel()
            try:
                await self.frames.aclose()
            except BaseException:
                pass
            r = self.on_close()
            if asyncio.iscoroutine(r):
                await r
