"""The output processor: token deltas in, text pieces out, once per TokenBatch.

Every request the gateway has in flight owns one ``RequestState``: its queue of pieces, the seq
number it expects next, its detokenizer, its stop-string buffer, its tokens and timings. That one
object is the request's whole output state: a continuation on another engine (failover.py) carries
on with it, under a new engine-side ``request_id``.

``OutputProcessor.process`` handles one ``TokenBatch`` in ONE loop over its deltas: the seq
check, incremental detokenizing (``DecodeStream``), the stop-string check (held-back text, a match
truncates and aborts the engine request), logprob token strings (one batched call for the whole
batch, before the loop), and the resulting ``Piece`` (or error) put on the request's queue.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from shared.protocol import Delta, TokenLogprob

from ..api.errors import GenerationError


class StopChecker:
    """Finds stop strings in streamed text.

    Only a tail that is the start of some stop string is held back, so a client never sees a
    piece of a stop string and sees all other text at once. ``feed`` returns what may be emitted now and whether a stop string
    ended the text (which is then truncated before it, or after it with ``include_stop``). As in
    vLLM, nothing is matched in the text of the first ``min_tokens`` tokens.
    """

    __slots__ = ("stops", "max_len", "text", "emitted", "stopped", "include_stop", "min_tokens", "floor")

    def __init__(self, stops: list[str], include_stop: bool = False, min_tokens: int = 0):
        self.stops = stops
        self.max_len = max((len(s) for s in stops), default=0)
        self.text = ""
        self.emitted = 0
        self.stopped: str | None = None
        self.include_stop = include_stop
        self.min_tokens = min_tokens
        self.floor = 0                   # no match starts before this (text of the first min_tokens)

    def feed(self, piece: str, num_tokens: int | None = None) -> tuple[str, bool]:
        """`piece`: new text; `num_tokens`: output tokens so far, this piece's included."""
        if self.stopped is not None:
            return "", True
        if not self.stops:
            return piece, False
        old_len = len(self.text)
        self.text += piece
        if num_tokens is not None and num_tokens <= self.min_tokens:
            out, self.emitted = self.text[self.emitted:], len(self.text)
            self.floor = self.emitted
            return out, False
        start = max(self.floor, old_len - self.max_len + 1)
        best, best_end = -1, 0
        for s in self.stops:      # the match that completes first wins (as if fed one character at a time)
            i = self.text.find(s, start)
            if i != -1 and (best == -1 or (i + len(s), i) < (best_end, best)):
                best, best_end, self.stopped = i, i + len(s), s
        if best != -1:
            end = best_end if self.include_stop else best
            out = self.text[self.emitted:end]
            self.text = self.text[:end]
            self.emitted = end
            return out, True
        safe = len(self.text) - self._partial_match()
        out = ""
        if safe > self.emitted:
            out = self.text[self.emitted:safe]
            self.emitted = safe
        # Only the held-back tail (< max_len characters) is ever searched again.
        if self.emitted > 4 * self.max_len:
            cut = self.emitted - self.max_len
            self.text, self.emitted = self.text[cut:], self.emitted - cut
            self.floor = max(0, self.floor - cut)
        return out, False

    def _partial_match(self) -> int:
        """Length of the longest held-back tail that is the start of a stop string."""
        hold, pending = 0, len(self.text) - self.emitted
        for s in self.stops:
            for k in range(min(len(s) - 1, pending), hold, -1):
                if self.text.endswith(s[:k]):
                    hold = k
                    break
        return hold

    def flush(self) -> str:
        out = self.text[self.emitted:]
        self.emitted = len(self.text)
        return out


@dataclass(slots=True, frozen=True)
class OutputOptions:
    """A request's text options (vLLM's request fields)."""
    skip_special_tokens: bool = True
    # Fast tokenizers (the only kind Kaiten loads) join special tokens' text without spaces, as
    # in vLLM, which applies this flag on its slow-tokenizer path only.
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    tokens_as_ids: bool = False            # logprob tokens as "token_id:N" (return_tokens_as_token_ids)


@dataclass(slots=True)
class Logprob:
    """One sampled token's logprob, with its text and the top alternatives' (text, logprob)."""
    token: str
    logprob: float
    top: list[tuple[str, float]]


@dataclass(slots=True)
class Piece:
    """What one choice got from one delta: text, the tokens behind it, and maybe the finish."""
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[Logprob] | None
    finish_reason: str | None = None


@dataclass(slots=True, eq=False)
class RequestState:
    """One engine request's output state, owned by the gateway from submission to the end."""
    request_id: str
    index: int                            # choice index in the response
    prompt_ids: list[int]
    deadline: float                       # time.monotonic()
    detokenizer: Any                      # tokenizer_service.Detokenizer
    stop: StopChecker
    want_logprobs: bool = False
    options: OutputOptions = field(default_factory=OutputOptions)
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)   # Piece | GenerationError
    next_seq: int = 0
    engine_id: str | None = None
    submitted: float = field(default_factory=time.monotonic)
    first_delta: float | None = None
    first_token_at: float | None = None
    last_token_at: float | None = None
    finished_at: float | None = None
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None      # "stop" | "length", once finished
    stop_reason: str | int | None = None  # the stop string or stop token id that finished it
    # Prompt logprobs as the engine sent them (first token: None) and the text of every token
    # they name (the prompt's own included).
    prompt_logprobs: list[TokenLogprob | None] | None = None
    prompt_strings: dict[int, str] = field(default_factory=dict)
    num_cached_tokens: int = 0
    engine_finished: bool = False         # the engine sent its terminal delta
    abort_sent: bool = False
    done: bool = False                    # terminal piece or error delivered
    # What a continuation needs (failover.py): the sampling params and the deadline sent, and how
    # often the request was moved. `request_id` is then "<origin_id>~<failovers>".
    params: dict = field(default_factory=dict)
    wall_deadline: float | None = None    # unix seconds, as sent to the engines
    origin_id: str = ""
    failovers: int = 0
    routed_to: str | None = None          # the engine whose own stream got it (not admitted yet)
    model: Any = None                     # gateway.models.ServedModel: its tokenizer, metrics, stream
    lora_name: str = ""                   # the LoRA adapter it runs through ("" for the base model)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids)


class OutputProcessor:
    """Turns the deltas of each TokenBatch into pieces on the requests' queues."""

    def __init__(self, counters: dict[str, int],
                 finish: Callable[[RequestState], None], fail: Callable[[RequestState, GenerationError], None],
                 abort: Callable[[list[str]], None]):
        self.counters = counters
        self._finish = finish                 # forget a state that is done
        self._fail = fail                     # end a state with an error (and abort the engine)
        self._abort = abort

    def process(self, engine_id: str, deltas: list[Delta], streams: dict[str, RequestState],
                admitted: list[str] = ()) -> None:
        for rid in admitted:              # from now on the gateway knows who holds these
            s = streams.get(rid)
            if s is not None and s.engine_id is None:
                s.engine_id = engine_id
        now = time.monotonic()
        strings = self._token_strings(deltas, streams)
        m = None                          # the model's metrics (an engine serves one model)
        new_tokens = 0
        to_abort: list[str] = []
        for d in deltas:
            self.counters["deltas"] += 1
            s = streams.get(d.request_id) if isinstance(d.request_id, str) else None
            if s is None or s.done:
                self.counters["unknown_request"] += 1
                continue
            if not self._in_order(engine_id, d, s):
                continue
            if s.model.metrics is not m:
                if new_tokens:
                    m.generation_tokens.inc(new_tokens)
                m, new_tokens = s.model.metrics, 0
            if s.first_delta is None:
                s.first_delta = now
            if d.prompt_logprobs is not None:
                s.prompt_logprobs = d.prompt_logprobs
                s.prompt_strings = {t: strings.get(t, "") for t in _prompt_token_ids(d, s)}
            if d.token_ids:
                if s.first_token_at is None:
                    s.first_token_at = now
                    m.ttft.observe(now - s.submitted)
                elif s.last_token_at is not None:
                    m.itl.observe(now - s.last_token_at)
                s.last_token_at = now
                s.token_ids.extend(d.token_ids)
                new_tokens += len(d.token_ids)
            if d.finish_reason is not None:
                s.engine_finished = True
                # A continuation's cache hits may cover its earlier output: report prompt tokens only.
                s.num_cached_tokens = min(int(d.num_cached_tokens or 0), s.num_prompt_tokens)
                if d.finish_reason in ("error", "abort"):
                    self._fail(s, _engine_error(d, s))
                    continue
                m.finished(s.num_prompt_tokens, len(s.token_ids), d.metrics)
            ids = d.token_ids
            if d.finish_reason == "stop" and ids and not s.options.include_stop_str_in_output:
                ids = ids[:-1]                # the EOS or stop token id: not text (vLLM's rule)
            try:
                text = s.detokenizer.add(ids) if ids else ""
                if d.finish_reason is not None:
                    text += s.detokenizer.finish()
            except ValueError as e:
                self._fail(s, GenerationError(502, f"cannot detokenize the output: {e}", code="bad_tokens"))
                continue
            out, stopped = s.stop.feed(text, len(s.token_ids))
            finish = None
            if stopped:
                finish, s.stop_reason = "stop", s.stop.stopped
                if not s.engine_finished:
                    to_abort.append(s.request_id)
                    s.abort_sent = True
            elif d.finish_reason is not None:
                out += s.stop.flush()
                finish = d.finish_reason if d.finish_reason in ("stop", "length") else "stop"
                s.stop_reason = d.stop_reason if finish == "stop" else None
            lps = None
            if s.want_logprobs:
                name = _token_name(strings, s.options.tokens_as_ids)
                lps = [Logprob(name(lp.token_id), lp.logprob, [(name(t), v) for t, v in lp.top])
                       for lp in d.logprobs or ()]
            if finish is not None:
                s.finish_reason, s.finished_at = finish, now
                self._finish(s)
            s.queue.put_nowait(Piece(s.index, out, list(d.token_ids), lps, finish))
        if new_tokens:
            m.generation_tokens.inc(new_tokens)
        if to_abort:
            self._abort(to_abort)

    def _in_order(self, engine_id: str, d: Delta, s: RequestState) -> bool:
        """The seq check: a repeat is dropped, a gap fails the request, another engine is ignored."""
        if not isinstance(d.seq, int) or not isinstance(d.token_ids, list):
            self.counters["bad_messages"] += 1
            self._fail(s, GenerationError(502, "malformed token delta from the engine", code="bad_delta"))
            return False
        if s.engine_id is None:
            s.engine_id = engine_id
        elif engine_id and engine_id != s.engine_id:
            # Not the engine that admitted it: engines never run another's claimed entries
            # (failover.py), so this is a stray message; the request's own engine goes on.
            self.counters["foreign_engine"] += 1
            return False
        if d.seq < s.next_seq:
            self.counters["duplicates"] += 1          # a re-sent message: seen already
            return False
        if d.seq > s.next_seq:
            self.counters["gaps"] += 1
            self._fail(s, GenerationError(
                502, f"token stream gap: expected delta {s.next_seq}, got {d.seq}; tokens were lost",
                code="stream_gap"))
            return False
        s.next_seq += 1
        return True

    def _token_strings(self, deltas: list[Delta], streams: dict[str, RequestState]) -> dict[int, str]:
        """The text of every token that a logprob in this batch names: one batched decode."""
        ids: dict[int, None] = {}
        tokenizer = None
        for d in deltas:
            s = streams.get(d.request_id) if isinstance(d.request_id, str) else None
            if s is None or not (s.want_logprobs and d.logprobs or d.prompt_logprobs):
                continue
            tokenizer = s.model.text_tokenizer        # one model's requests: an engine serves one
            for lp in d.logprobs if s.want_logprobs and d.logprobs else ():
                ids[lp.token_id] = None
                for t, _ in lp.top:
                    ids[t] = None
            for t in _prompt_token_ids(d, s):
                ids[t] = None
        if not ids:
            return {}
        keys = list(ids)
        try:
            return dict(zip(keys, tokenizer.token_strings(keys)))
        except ValueError:                    # a logprob's token text is best effort
            return {}


def _prompt_token_ids(d: Delta, s: RequestState) -> list[int]:
    """The tokens a delta's prompt logprobs name: the prompt's and their top alternatives."""
    if not d.prompt_logprobs:
        return []
    ids = list(s.prompt_ids)
    for lp in d.prompt_logprobs:
        if lp is not None:
            ids += [t for t, _ in lp.top]
    return ids


def _token_name(strings: dict[int, str], as_ids: bool) -> Callable[[int], str]:
    if as_ids:
        return lambda t: f"token_id:{t}"
    return lambda t: strings.get(t, "")


def _engine_error(d: Delta, s: RequestState) -> GenerationError:
    if d.finish_reason == "abort":
        return GenerationError(503, d.error or "the engine aborted the request", code="aborted")
    # An invalid request is refused by the engine before it produces anything.
    refused = d.seq == 0 and not s.token_ids
    return GenerationError(400 if refused else 500, d.error or "the engine failed the request",
                           code="engine_rejected" if refused else "engine_error")
