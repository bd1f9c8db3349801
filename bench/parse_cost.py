"""Per-request cost of parsing a typical chat request in the gateway (validation, chat template,
tokenization): `gateway.openai_api.parse_chat` on the tiny test model's tokenizer, median of many.

    python bench/parse_cost.py [--runs 20000]

Prints the median and minimum in microseconds, for the whole parse and for the parse of a request
whose template result is cached (validation alone dominates), and the CPU's name.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.machine import cpu_name  # noqa: E402
from bench.timing import median_ms  # noqa: E402
from gateway.openai_api import ModelContext, parse_chat  # noqa: E402
from tests.tiny_model import build_tiny_model  # noqa: E402
from tokenizer_service import ChatTokenizer  # noqa: E402
from tokenizer_service.client import make_tokenizer  # noqa: E402

TYPICAL_CHAT = {
    "model": "tiny", "stream": True, "stream_options": {"include_usage": True},
    "messages": [{"role": "system", "content": "You are a helpful assistant."},
                 {"role": "user", "content": "What is the capital of France? Answer in one word."}],
    "temperature": 0.7, "top_p": 0.9, "max_tokens": 64, "stop": ["\n\n"], "seed": 7,
}


class FixedIds:
    """A tokenizer that answers at once: the parse without the template's cost."""
    async def apply_chat_template(self, messages, add_generation_prompt=True, options=None):
        return [5, 6, 7, 8]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=20000)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        model = build_tiny_model(Path(d) / "tiny")
        tok = make_tokenizer(str(model), "", ChatTokenizer.from_pretrained(str(model)))
        loop = asyncio.new_event_loop()
        out = {"cpu": cpu_name(), "runs": args.runs}
        for label, t in (("parse_chat", tok), ("parse_chat_fixed_ids", FixedIds())):
            ctx = ModelContext(names=["tiny"], max_model_len=2048, vocab_size=384, max_n=8, tokenizer=t)
            body = json.dumps(TYPICAL_CHAT)
            run = lambda: loop.run_until_complete(parse_chat(json.loads(body), ctx))  # noqa: E731
            med, best = median_ms(run, args.runs, warmup=200)
            out[label] = {"median_us": round(med * 1e3, 2), "min_us": round(best * 1e3, 2)}
        print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
