"""Speculative decoding (n-gram prompt lookup) on and off: TPOT, tok/s and acceptance length.

Two prompt sets: input-grounded (rewrite a passage, edit a code file: the answer quotes its
input) and open-ended (stories, explanations). Each runs at concurrency 1 (one request at a time)
and 32 (32 requests at once), greedy, with speculation off and on, on the offline engine in one
process (two engines, the same weights), alternating off/on per round. TPOT per request is
(finish - first token) / (output tokens - 1), from the engine's clock; tok/s is output tokens
over the wall time of the whole set; acceptance length is 1 + accepted drafts / verifications.
Greedy outputs must be identical on and off.

    .venv/bin/python bench/speculative.py [--model DIR] [--max-tokens 128] [--rounds 2]

Writes bench/results/speculative.md and .json.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.machine import cpu_name  # noqa: E402
from engine_worker import LLM, SamplingParams  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
NGRAM = {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4}

PASSAGE = ("The Great Barrier Reef is the world's largest coral reef system, composed of over 2,900 "
           "individual reefs and 900 islands stretching for over 2,300 kilometres over an area of "
           "approximately 344,400 square kilometres. The reef is located in the Coral Sea, off the coast "
           "of Queensland, Australia. It can be seen from outer space and is the world's biggest single "
           "structure made by living organisms. This reef structure is composed of and built by billions "
           "of tiny organisms, known as coral polyps.")
CODE = '''def mean(values):
    total = 0
    for v in values:
        total += v
    return total / len(values)


def median(values):
    ordered = sorted(values)
    middle = len(ordered) // 2
    if len(ordered) % 2:
        return ordered[middle]
    return (ordered[middle - 1] + ordered[middle]) / 2
'''
GROUNDED = [
    f"Rewrite the following passage, keeping every fact, word for word where you can:\n\n{PASSAGE}",
    f"Repeat this passage exactly, then say how many reefs it mentions:\n\n{PASSAGE}",
    f"Here is a Python file:\n\n{CODE}\nAdd a docstring to mean and return the whole file.",
    f"Here is a Python file:\n\n{CODE}\nRename `values` to `xs` everywhere and return the whole file.",
]
OPEN = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain why the sky is blue to a ten-year-old.",
    "Give me five ideas for a weekend trip in the mountains, with a sentence on each.",
    "What are the pros and cons of working from home?",
]


def run_set(llm: LLM, prompts: list[list[int]], concurrency: int, max_tokens: int) -> dict:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    spec = llm.engine.speculator
    before = (spec.stats.num_drafts, spec.stats.num_accepted_tokens) if spec else (0, 0)
    start = time.perf_counter()
    outs = []
    if concurrency == 1:
        for p in prompts:
            outs += llm.generate([p], params)
    else:
        outs = llm.generate([prompts[i % len(prompts)] for i in range(concurrency)], params)
    wall = time.perf_counter() - start
    tpot = [(c.metrics["finished"] - c.metrics["first_token"]) / (len(c.token_ids) - 1)
            for c in outs if len(c.token_ids) > 1]
    drafts, accepted = ((spec.stats.num_drafts - before[0], spec.stats.num_accepted_tokens - before[1])
                        if spec else (0, 0))
    return {"tpot_ms": 1000 * statistics.median(tpot), "tok_s": sum(len(c.token_ids) for c in outs) / wall,
            "acceptance_length": 1 + accepted / drafts if drafts else 1.0,
            "outputs": [c.token_ids for c in outs]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default=str(RESULTS / "speculative"))
    args = ap.parse_args()
    engines = {"off": LLM(args.model), "on": LLM(args.model, speculative_config=json.dumps(NGRAM))}
    tok = engines["off"].tokenizer
    chat = lambda text: list(tok.apply_chat_template([{"role": "user", "content": text}],  # noqa: E731
                                                     add_generation_prompt=True, tokenize=True, return_dict=False))
    sets = {"grounded": [chat(t) for t in GROUNDED], "open-ended": [chat(t) for t in OPEN]}
    rows = []
    for name, prompts in sets.items():
        for c in (1, 32):
            runs = {"off": [], "on": []}
            for _ in range(args.rounds):
                for mode in ("off", "on"):
                    runs[mode].append(run_set(engines[mode], prompts, c, args.max_tokens))
            med = {m: {k: statistics.median(r[k] for r in rs) for k in ("tpot_ms", "tok_s", "acceptance_length")}
                   for m, rs in runs.items()}
            same = all(a["outputs"] == b["outputs"] for a, b in zip(runs["off"], runs["on"]))
            rows.append({"set": name, "concurrency": c, "off": med["off"], "on": med["on"], "identical": same,
                         "tpot_ratio": med["off"]["tpot_ms"] / med["on"]["tpot_ms"],
                         "tok_s_ratio": med["on"]["tok_s"] / med["off"]["tok_s"]})
            print(json.dumps(rows[-1]), flush=True)
    write(rows, args, Path(args.out))


def write(rows: list[dict], args, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"cpu": cpu_name(), "config": NGRAM, "max_tokens": args.max_tokens, "rounds": args.rounds,
            "model": args.model or "SmolLM2-135M-Instruct (default)"}
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    lines = [f"# Speculative decoding (n-gram), {meta['model']}", "",
             f"CPU: {meta['cpu']}. Config `{json.dumps(NGRAM)}`, greedy, max_tokens {args.max_tokens}, "
             f"medians of {args.rounds} rounds (off and on alternating), the offline engine. "
             "TPOT: median per request; speedup: TPOT off / on.", "",
             "| set | c | TPOT off (ms) | TPOT on (ms) | TPOT speedup | tok/s off | tok/s on | acceptance length "
             "| greedy identical |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['set']} | {r['concurrency']} | {r['off']['tpot_ms']:.1f} | {r['on']['tpot_ms']:.1f} | "
                     f"{r['tpot_ratio']:.2f}x | {r['off']['tok_s']:.1f} | {r['on']['tok_s']:.1f} | "
                     f"{r['on']['acceptance_length']:.2f} | {'yes' if r['identical'] else 'NO'} |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
