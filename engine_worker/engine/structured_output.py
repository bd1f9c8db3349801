"""Structured output: decoding constrained by a grammar (xgrammar).

A request asks for it with ``SamplingParams.structured_output``, a map ``{"kind": K, "value": V}``:

    json         V: a JSON schema, as JSON text (compact output: no free whitespace; an object
                 without "additionalProperties" allows none, as in OpenAI's strict mode)
    json_object  V: ignored (any JSON object)
    regex        V: a regular expression
    choice       V: a list of strings; the output is exactly one of them
    grammar      V: an EBNF grammar (xgrammar's dialect, GBNF-like, with a ``root`` rule)

(The spec's shape and size are checked by shared/structured_spec.py, at admission.)

The life of a constrained request in the engine:

1. ``submit``: its grammar is compiled on the compiler thread (never in the step loop); compiled
   grammars are kept in ``compiled_cache`` by (kind, value). Until its grammar is ready the
   request waits here, outside the scheduler; a grammar that does not compile fails the request.
2. ``take_ready``: each step, the requests whose grammar is ready get a matcher and go on to the
   scheduler; failures come back with their error text.
3. ``grammar_prefix``: a constrained request's drafts (speculative decoding) are cut at the first
   the grammar rejects, or after the one that completes it, before they are scheduled.
4. ``apply_bitmasks``: once per step, one bitmask for the constrained rows, applied in place to
   the logits before sampling: a sequence with k drafts has k + 1 rows, each masked by the state
   its matcher reaches over the drafts before it (accepted, then rolled back). Free rows are not
   touched; a batch without constrained rows costs one Python check.
5. ``accept``: the matchers advance on the verified tokens (accepted drafts and the token after
   them); a matcher that terminates (its grammar is complete and a stop token was taken) ends its
   request at that token.
"""
from __future__ import annotations

import concurrent.futures
import json
import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch

from engine_worker.engine.sequence import Sequence
from shared.structured_spec import validate_spec

log = logging.getLogger(__name__)

COMPILED_CACHE_SIZE = 128
COMPILER_THREADS = 2


def cache_key(spec: dict) -> tuple[str, str]:
    value = spec.get("value")
    return spec["kind"], value if isinstance(value, str) else json.dumps(value)


def choice_grammar(choices: list[str]) -> str:
    """An EBNF grammar whose language is exactly `choices` (JSON string escapes are valid EBNF)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def json_schema_ebnf(schema: str, strict_mode: bool = True) -> str:
    """xgrammar's grammar for `schema`, as EBNF, with two fixes to the characters of its strings:
    a length-bounded string's (maxLength) include raw control characters, which JSON forbids (a
    strict parser such as Python's ``json.loads`` rejects them), as xgrammar's other strings do
    not; and every string's include the surrogate code points U+D800..U+DFFF, whose UTF-8 form is
    no valid UTF-8 (a random model wrote one: three U+FFFD once decoded, past a maxLength)."""
    import xgrammar
    ebnf = str(xgrammar.Grammar.from_json_schema(schema, any_whitespace=False, strict_mode=strict_mode))
    ebnf = ebnf.replace(r'[^\"\\\r\n]', r'[^\0-\x1f\"\\\r\n]')
    return ebnf.replace(r'[^\0-\x1f\"\\\r\n]', r'[^\0-\x1f\"\\\r\n\ud800-\udfff]')


@dataclass(slots=True)
class _Pending:
    seq: Sequence
    future: concurrent.futures.Future


class StructuredOutput:
    """The engine's grammar state: the compiler, its cache, pending requests and the matchers."""

    def __init__(self, model_dir: str, vocab_size: int, eos_token_ids: list[int]):
        self.model_dir = model_dir
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self.pending: dict[str, _Pending] = {}
        self.compiled_cache: OrderedDict[tuple[str, str], Any] = OrderedDict()
        self._cache_lock = threading.Lock()
        self._compiler = None                  # xgrammar.GrammarCompiler, built on first use
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._bitmask: torch.Tensor | None = None

    # ---- admission -------------------------------------------------------------------------
    def submit(self, seq: Sequence) -> None:
        """Start compiling `seq`'s grammar; it waits here until ``take_ready`` hands it on."""
        spec = seq.params.structured_output
        validate_spec(spec)
        if self._executor is None:
            self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kaiten-grammar")
        self.pending[seq.request_id] = _Pending(seq, self._executor.submit(self._compiled, spec))

    def take_ready(self) -> tuple[list[Sequence], list[tuple[Sequence, str]]]:
        """(requests whose matcher is ready, [(request, error text)] whose grammar failed)."""
        ready, failed = [], []
        for rid, p in list(self.pending.items()):
            if not p.future.done():
                continue
            del self.pending[rid]
            try:
                compiled = p.future.result()
            except Exception as e:          # xgrammar reports bad grammars as RuntimeError
                failed.append((p.seq, _compile_error(p.seq.params.structured_output, e)))
                continue
            import xgrammar
            matcher = xgrammar.GrammarMatcher(compiled)
            # A continuation (failover) carries its earlier output in the prompt: the grammar goes on from it.
            if not all(matcher.accept_token(t) for t in p.seq.output_token_ids):
                failed.append((p.seq, "the grammar rejects the output this continuation carries"))
                continue
            p.seq.grammar = matcher
            ready.append(p.seq)
        return ready, failed

    def wait(self, timeout: float) -> None:
        """Block until some pending grammar is compiled, or `timeout` (the engine has nothing else to do)."""
        if self.pending:
            concurrent.futures.wait([p.future for p in self.pending.values()], timeout,
                                    return_when=concurrent.futures.FIRST_COMPLETED)

    def drop(self, request_id: str) -> Sequence | None:
        p = self.pending.pop(request_id, None)
        return p.seq if p is not None else None

    def find(self, request_id: str) -> Sequence | None:
        p = self.pending.get(request_id)
        return p.seq if p is not None else None

    # ---- compiling (on the compiler thread) ----------------------------------------------------
    def _compiled(self, spec: dict):
        key = cache_key(spec)
        with self._cache_lock:
            hit = self.compiled_cache.get(key)
            if hit is not None:
                self.compiled_cache.move_to_end(key)
                return hit
        compiled = self._compile(spec)
        with self._cache_lock:
            self.compiled_cache[key] = compiled
            while len(self.compiled_cache) > COMPILED_CACHE_SIZE:
                self.compiled_cache.popitem(last=False)
        return compiled

    def _compile(self, spec: dict):
        compiler = self._get_compiler()
        kind, value = spec["kind"], spec.get("value")
        if kind == "json":
            return compiler.compile_grammar(json_schema_ebnf(value))
        if kind == "json_object":          # any object (OpenAI's JSON mode), not any JSON value
            return compiler.compile_grammar(json_schema_ebnf('{"type": "object"}', strict_mode=False))
        if kind == "regex":
            return compiler.compile_regex(value)
        if kind == "choice":
            return compiler.compile_grammar(choice_grammar(value))
        return compiler.compile_grammar(value)

    def _get_compiler(self):
        if self._compiler is None:
            import xgrammar
            from transformers import AutoTokenizer
            tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
            info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=self.vocab_size,
                                                           stop_token_ids=self.eos_token_ids)
            self._compiler = xgrammar.GrammarCompiler(info, max_threads=COMPILER_THREADS, cache_enabled=False)
        return self._compiler

    # ---- the step ------------------------------------------------------------------------------
    def apply_bitmasks(self, logits: torch.Tensor, seqs: list[Sequence]) -> None:
        """Mask, in place, every token the grammar of a constrained sequence does not allow next,
        at each of its scored positions: a sequence has 1 + len(drafts) rows in a row, row j the
        position after drafts[:j] (free rows are not touched)."""
        if all(s.grammar is None for s in seqs):
            return
        import xgrammar
        bitmask = self._bitmask_for(len(logits))
        rows, row = [], 0
        for seq in seqs:
            if seq.grammar is not None:
                rows += _fill_bitmasks(seq.grammar, seq.spec_token_ids, bitmask, row)
            row += 1 + len(seq.spec_token_ids)
        xgrammar.apply_token_bitmask_inplace(logits, bitmask[:len(logits)].to(logits.device, non_blocking=True),
                                             vocab_size=self.vocab_size, indices=rows)

    def accept(self, seqs: list[Sequence], tokens: list[list[int]]) -> list[tuple[int, str | None]]:
        """Advance each constrained sequence's matcher on its verified tokens. Per sequence: (n,
        state), state None (free, or the grammar goes on: all n tokens taken), "terminated" (the
        n-th token completes the grammar) or an error text (the grammar rejects the n-th token)."""
        return [(len(t), None) if s.grammar is None else _advance(s.grammar, t) for s, t in zip(seqs, tokens)]

    def _bitmask_for(self, rows: int) -> torch.Tensor:
        if self._bitmask is None or self._bitmask.shape[0] < rows:
            import xgrammar
            self._bitmask = xgrammar.allocate_token_bitmask(max(rows, 8), self.vocab_size)
        return self._bitmask

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)


def grammar_prefix(matcher, drafts: list[int]) -> list[int]:
    """`drafts` up to the first the grammar rejects, or through the one that completes it; the
    matcher is left as it was."""
    n = 0
    for token in drafts:
        if not matcher.accept_token(token):
            break
        n += 1
        if matcher.is_terminated():
            break
    matcher.rollback(n)
    return drafts[:n]


def _fill_bitmasks(matcher, drafts: list[int], bitmask: torch.Tensor, row: int) -> list[int]:
    """Fill the rows `row`.. of the positions after each prefix of `drafts` (a grammar_prefix) and
    return them: all but the row after a draft that completes the grammar, whose token is never kept."""
    matcher.fill_next_token_bitmask(bitmask, row)
    rows = [row]
    for j, token in enumerate(drafts, 1):
        matcher.accept_token(token)
        if matcher.is_terminated():
            break
        matcher.fill_next_token_bitmask(bitmask, row + j)
        rows.append(row + j)
    matcher.rollback(len(drafts))
    return rows


def _advance(matcher, tokens: list[int]) -> tuple[int, str | None]:
    for n, token in enumerate(tokens, 1):
        if not matcher.accept_token(token):
            return n, f"the grammar rejected token {token} (no allowed token was left)"
        if matcher.is_terminated():
            return n, "terminated"
    return len(tokens), None


def _compile_error(spec: dict, e: Exception) -> str:
    """xgrammar's message without its C++ source location prefix."""
    text = str(e).strip()
    if "] " in text and text.startswith("["):
        text = text.split("] ", 1)[1]
    text = text.split(": ", 1)[1] if text.startswith("/") and ": " in text else text
    return f"invalid structured output {spec['kind']}: {text}"
