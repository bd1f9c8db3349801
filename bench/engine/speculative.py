"""Speculative decoding (n-gram, draft model) on and off: TPOT, tok/s and acceptance length.

Two prompt sets: input-grounded (rewrite a passage, edit a code file: the answer quotes its
input) and open-ended (stories, explanations). Each runs at concurrency 1 (one request at a time)
and 32 (32 requests at once), greedy, with speculation off and on, on the offline engine in one
process (an engine per mode, the same weights), the modes alternating in each round. The draft
model is the target's first --draft-layers layers (no training, the same tokenizer). TPOT per
request is (finish - first token) / (output tokens - 1), from the engine's clock; tok/s is output
tokens over the wall time of the whole set; acceptance length is 1 + accepted drafts /
verifications. Greedy outputs must be identical on and off (the table says whether they were).

    .venv/bin/python bench/engine/speculative.py [--model DIR] [--dtype float32] [--max-tokens 128]
        [--rounds 2] [--num-threads N] [--draft-layers 8]

Writes bench/results/speculative/speculative.md and .json.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.common.machine import cpu_flags, cpu_name, load_avg  # noqa: E402
from bench.common.results_files import results_dir  # noqa: E402
import torch  # noqa: E402

from engine_worker import LLM, SamplingParams  # noqa: E402

RESULTS = results_dir(__file__)
NGRAM = {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4}
DRAFT_K = 3

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


def layer_draft(target: Path, num_layers: int) -> Path:
    """A draft for the target from its first num_layers layers, its final norm and its (tied) head:
    the same tokenizer, no training (an early-exit draft). Built once under models/."""
    from safetensors.torch import load_file, save_file
    out = target.parent / f"{target.name}-first{num_layers}layers"
    if (out / "model.safetensors").exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    config = json.loads((target / "config.json").read_text())
    config["num_hidden_layers"] = num_layers
    (out / "config.json").write_text(json.dumps(config, indent=2))
    for f in target.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "generation_config")):
            shutil.copy(f, out / f.name)
    keep = {k: v for k, v in load_file(target / "model.safetensors").items()
            if not k.startswith("model.layers.") or int(k.split(".")[2]) < num_layers}
    save_file(keep, out / "model.safetensors")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--num-threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--draft-layers", type=int, default=8,
                    help="also run a draft model made of the target's first N layers (0: no draft model)")
    ap.add_argument("--out", default=str(RESULTS / "speculative"))
    args = ap.parse_args()
    from shared.model_source import resolve_model
    target = resolve_model(args.model)
    configs = {"off": None, "ngram": NGRAM}
    if args.draft_layers:
        configs["draft"] = {"method": "draft_model", "model": str(layer_draft(target, args.draft_layers)),
                            "num_speculative_tokens": DRAFT_K}
    load_before = load_avg()
    engines = {mode: LLM(str(target), dtype=args.dtype, num_threads=args.num_threads,
                         speculative_config=json.dumps(c) if c else "")
               for mode, c in configs.items()}
    tok = engines["off"].tokenizer
    chat = lambda text: list(tok.apply_chat_template([{"role": "user", "content": text}],  # noqa: E731
                                                     add_generation_prompt=True, tokenize=True, return_dict=False))
    sets = {"grounded": [chat(t) for t in GROUNDED], "open-ended": [chat(t) for t in OPEN]}
    rows = []
    for name, prompts in sets.items():
        for c in (1, 32):
            runs = {mode: [] for mode in engines}
            for _ in range(args.rounds):
                for mode, llm in engines.items():
                    runs[mode].append(run_set(llm, prompts, c, args.max_tokens))
            for mode in configs:
                if mode == "off":
                    continue
                med = {m: {k: statistics.median(r[k] for r in runs[m])
                           for k in ("tpot_ms", "tok_s", "acceptance_length")} for m in ("off", mode)}
                same = all(a["outputs"] == b["outputs"] for a, b in zip(runs["off"], runs[mode]))
                rows.append({"set": name, "concurrency": c, "method": mode, "off": med["off"], "on": med[mode],
                             "identical": same, "tpot_ratio": med["off"]["tpot_ms"] / med[mode]["tpot_ms"],
                             "tok_s_ratio": med[mode]["tok_s"] / med["off"]["tok_s"]})
                print(json.dumps(rows[-1]), flush=True)
    write(rows, args, configs, Path(args.out), (load_before, load_avg()))


def write(rows: list[dict], args, configs: dict, out: Path, load: tuple) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"cpu": cpu_name(), "cpu_flags": cpu_flags(), "cores": os.cpu_count(), "load_avg": load,
            "threads": torch.get_num_threads(),
            "configs": configs, "dtype": args.dtype, "max_tokens": args.max_tokens, "rounds": args.rounds,
            "model": args.model or "SmolLM2-135M-Instruct (default)"}
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    lines = [f"# Speculative decoding, {meta['model']}", "",
             f"CPU: {meta['cpu']} ({meta['cores']} cores; {' '.join(meta['cpu_flags'])}), {meta['threads']} torch "
             f"thread(s), load average "
             f"{load[0]} before, {load[1]} after (other sessions share the machine). {args.dtype}, greedy, "
             f"max_tokens {args.max_tokens}, medians of {args.rounds} rounds (the modes alternating), the offline "
             "engine. TPOT: median per request; speedup: TPOT off / on; acceptance length: 1 + accepted drafts "
             "per verification.", ""]
    lines += [f"- {mode}: `{json.dumps(c)}`" for mode, c in configs.items() if c]
    lines += ["", "| set | c | method | TPOT off (ms) | TPOT on (ms) | TPOT speedup | tok/s off | tok/s on "
              "| acceptance length | greedy identical |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['set']} | {r['concurrency']} | {r['method']} | {r['off']['tpot_ms']:.1f} | "
                     f"{r['on']['tpot_ms']:.1f} | {r['tpot_ratio']:.2f}x | {r['off']['tok_s']:.1f} | "
                     f"{r['on']['tok_s']:.1f} | {r['on']['acceptance_length']:.2f} | "
                     f"{'yes' if r['identical'] else 'NO'} |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
