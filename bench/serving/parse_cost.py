"""The gateway's API layer on its hot paths, against an older revision's in the same run:

- parse: a typical chat request from its body's bytes to the ParsedRequest, as gateway/api/openai_routes.py
  does it per request (JSON depth check, decoding, validation, chat template, tokenization); and
  parse_fixed_ids, the same with a tokenizer that answers at once (the template's cost left out).
- chunk: one streamed chat chunk (a token's text) through ``chat_sse``, per chunk of a 64-token
  stream.

    python bench/serving/parse_cost.py [--old cf688c7] [--rounds 20] [--runs 500] [--out bench/results/parse_cost/parse_cost.md]

The old revision's code is ``git archive``d into a temporary directory. Each revision runs in a
worker process of its own (both import ``gateway``); the rounds alternate which goes first, and
the report gives the medians over all rounds' samples, in microseconds, with the CPU's name.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TYPICAL_CHAT = {
    "model": "tiny", "stream": True, "stream_options": {"include_usage": True},
    "messages": [{"role": "system", "content": "You are a helpful assistant."},
                 {"role": "user", "content": "What is the capital of France? Answer in one word."}],
    "temperature": 0.7, "top_p": 0.9, "max_tokens": 64, "stop": ["\n\n"], "seed": 7,
}
MAX_JSON_DEPTH = 64
STREAM_TOKENS = 64
CASES = ("parse", "parse_fixed_ids", "chunk")


# ---------------------------------------------------------------------- the worker (one revision)
class FixedIds:
    """A tokenizer that answers at once: the parse without the template's cost."""
    async def apply_chat_template(self, messages, add_generation_prompt=True, options=None):
        return [5, 6, 7, 8]


class FakeSub:
    index = 0


class FakeGeneration:
    """One choice whose pieces are ready: chat_sse's own cost per chunk."""
    sub, stop_reason, completion_tokens, num_cached_tokens = FakeSub(), None, STREAM_TOKENS, 0

    def __init__(self, piece_type):
        self.items = [piece_type(0, " word", [7], None) for _ in range(STREAM_TOKENS - 1)]
        self.items.append(piece_type(0, ".", [8], None, "length"))

    async def pieces(self):
        for p in self.items:
            yield p


class FakeGateway:
    class metrics:
        @staticmethod
        def error(code): pass

    @staticmethod
    def record(gens, error=None): pass


def _worker(model_dir: str) -> None:
    """Reads a number of runs per line, answers each line with {case: [µs per run, ...]}."""
    from gateway import json_body
    from gateway.api.openai_api import ModelContext, parse_chat
    from gateway.backend.output import Piece
    from gateway.api.responses import chat_sse
    from tokenizer_service import ChatTokenizer
    from tokenizer_service.client import make_tokenizer

    # What the revision hands parse_chat: the checked bytes, or (before check_json) the decoded body.
    body_of = getattr(json_body, "check_json", json_body.parse_json)
    tok = make_tokenizer(model_dir, "", ChatTokenizer.from_pretrained(model_dir))
    loop = asyncio.new_event_loop()
    raw = json.dumps(TYPICAL_CHAT).encode()
    # Before the models registry (issue 24) parse_chat took the context; since, a resolver of "model".
    single = "names" in ModelContext.__dataclass_fields__

    def context(t):
        if single:
            return ModelContext(names=["tiny"], max_model_len=2048, vocab_size=384, max_n=8, tokenizer=t)
        ctx = ModelContext(name="tiny", max_model_len=2048, vocab_size=384, max_n=8, tokenizer=t)
        return lambda model, c=ctx: c
    ctxs = {case: context(t) for case, t in (("parse", tok), ("parse_fixed_ids", FixedIds()))}
    parsed = loop.run_until_complete(parse_chat(body_of(raw, MAX_JSON_DEPTH), ctxs["parse"]))

    async def stream() -> int:
        frames = 0
        async for _ in chat_sse(FakeGateway, parsed, [FakeGeneration(Piece)], "chatcmpl-" + "0" * 32, 1700000000):
            frames += 1
        return frames

    chunks = loop.run_until_complete(stream())
    # case: (one run, what it makes, runs per STREAM_TOKENS parses)
    runs = {case: (lambda c=ctxs[case]: loop.run_until_complete(parse_chat(body_of(raw, MAX_JSON_DEPTH), c)), 1, 1)
            for case in ctxs}
    runs["chunk"] = (lambda: loop.run_until_complete(stream()), chunks, STREAM_TOKENS)
    for line in sys.stdin:
        out = {}
        for case, (fn, made, fewer) in runs.items():
            times = []
            for _ in range(max(1, int(line) // fewer)):
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) / made * 1e6)
            out[case] = times
        print(json.dumps(out), flush=True)


# ---------------------------------------------------------------------- the driver
def _start_worker(root: Path, model_dir: Path) -> subprocess.Popen:
    code = (f"import sys; sys.path.insert(0, {str(root)!r}); sys.path.insert(1, {str(ROOT)!r}); "
            f"from bench.serving.parse_cost import _worker; _worker({str(model_dir)!r})")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True, cwd=root, env=env)


def _ask(worker: subprocess.Popen, runs: int) -> dict[str, list[float]]:
    worker.stdin.write(f"{runs}\n")
    worker.stdin.flush()
    return json.loads(worker.stdout.readline())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--old", default="cf688c7", help="the revision to compare with")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--runs", type=int, default=500, help="parses per case and round")
    ap.add_argument("--out", type=Path, help="write the report (markdown) here too")
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    from bench.common.machine import cpu_name, load_avg
    from tests.support.tiny_model import build_tiny_model

    with tempfile.TemporaryDirectory() as d:
        old_root = Path(d) / "old"
        old_root.mkdir()
        archive = subprocess.run(["git", "archive", args.old, "gateway", "shared", "tokenizer_service"],
                                 cwd=ROOT, capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", str(old_root)], input=archive, check=True)
        model_dir = build_tiny_model(Path(d) / "tiny")
        workers = {"old": _start_worker(old_root, model_dir), "new": _start_worker(ROOT, model_dir)}
        samples = {rev: {case: [] for case in CASES} for rev in workers}
        load_before = load_avg()
        try:
            for r in range(args.rounds + 1):
                order = ("old", "new") if r % 2 else ("new", "old")
                for rev in order:
                    got = _ask(workers[rev], args.runs)
                    if r:                     # round 0 warms both up
                        for case in CASES:
                            samples[rev][case] += got[case]
        finally:
            for w in workers.values():
                w.stdin.close()
                w.wait()
    medians = {rev: {case: statistics.median(v) for case, v in cases.items()} for rev, cases in samples.items()}
    report = _report(args, cpu_name(), medians, (load_before, load_avg()))
    print(report)
    if args.out:
        args.out.write_text(report)


def _report(args, cpu: str, medians: dict, loads: tuple) -> str:
    lines = [f"# API layer cost: {args.old} (before) against the working tree (after)", "",
             f"CPU: {cpu}; load average {loads[0]} before, {loads[1]} after; {args.rounds} interleaved rounds "
             f"of {args.runs} parses each (chunks: {max(1, args.runs // STREAM_TOKENS)} streams of {STREAM_TOKENS} "
             "tokens each).",
             f"Command: `python bench/serving/parse_cost.py --old {args.old} --rounds {args.rounds} --runs {args.runs}`", "",
             "| case | before (µs, median) | after (µs, median) | after/before |", "|---|---|---|---|"]
    for case in CASES:
        old, new = medians["old"][case], medians["new"][case]
        lines.append(f"| {case} | {old:.1f} | {new:.1f} | {new / old:.3f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
