"""Decode speed and perplexity of the default model served quantized (--quantization auto: the
GGUF's Q4_1/Q8_0 matrices as stored, with its fp16 KV cache and with an fp32 one) against the
same file dequantized (none, bf16 and fp32).

All engines live in one process. For each batch size, every engine gets the same B random prompts
of --context tokens and prefills them; then rounds of --steps decode steps alternate between the
engines, and the median step time gives tok/s (B tokens a step). Perplexity: the prompt logprobs
of a fixed text. Resident weight bytes: parameters and buffers of the model.

    .venv/bin/python bench/weights/quant_decode.py [--batch 1,32] [--rounds 7] [--steps 8] [--quantized-only]

Writes bench/results/quant_decode/quant_decode.md (--quantized-only: the two quantized engines alone, the fp32
KV cache the baseline, into quant_decode_kv.md).
"""
from __future__ import annotations

import argparse
import math
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.common.machine import cpu_flags, cpu_name, load_avg  # noqa: E402
from bench.common.results_files import results_dir  # noqa: E402
from bench.engine.engine_throughput import step_until_decoding  # noqa: E402
from engine_worker import LLM, SamplingParams  # noqa: E402
from kernels.cpu_ops_build import cpu_capability  # noqa: E402

RESULTS = results_dir(__file__)
ENGINES = {"quantized (auto), dtype auto": {"quantization": "auto"},
           "quantized (auto), fp32 KV cache": {"quantization": "auto", "kv_cache_dtype": "float32"},
           "dequantized (none), dtype auto": {"quantization": "none"},
           "dequantized (none), fp32": {"quantization": "none", "dtype": "float32"}}
TEXT = ("The history of the bicycle begins in the early nineteenth century, when inventors in Europe "
        "built two-wheeled machines that riders pushed along with their feet. Pedals attached to the front "
        "wheel came decades later, and the chain drive that turns the rear wheel made the modern safety "
        "bicycle possible. Cheap steel tubes and pneumatic tyres turned it into everyday transport for "
        "millions of people, who used it to reach factories, schools and markets. Today cities build "
        "protected lanes so that commuters can ride safely, and electric motors help riders climb hills.")


def weight_bytes(llm: LLM) -> int:
    model = llm.engine.runner.model
    seen = {id(t): t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()]}
    rope = model.rope.cos.numel() * model.rope.cos.element_size() * 2
    return sum(seen.values()) - rope


def perplexity(llm: LLM) -> float:
    out = llm.generate([TEXT], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0))[0]
    lps = [lp.logprob for lp in out.prompt_logprobs[1:]]
    return math.exp(-sum(lps) / len(lps))


def decode_ms(engines: dict[str, LLM], batch: int, context: int, rounds: int, steps: int) -> dict[str, float]:
    rng = random.Random(batch)
    prompts = [[rng.randrange(3, 49152) for _ in range(context)] for _ in range(batch)]
    params = SamplingParams(temperature=0, max_tokens=rounds * steps + 8, ignore_eos=True)
    ids = {}
    for name, llm in engines.items():
        ids[name] = [llm.submit(p, params) for p in prompts]
        step_until_decoding(llm)
        llm.step()
    times = {name: [] for name in engines}
    for _ in range(rounds):
        for name, llm in engines.items():
            for _ in range(steps):
                t0 = time.perf_counter()
                llm.step()
                times[name].append(time.perf_counter() - t0)
    for name, llm in engines.items():
        for rid in ids[name]:
            llm.engine.abort_request(rid)
        llm.step()
    return {name: statistics.median(t) * 1e3 for name, t in times.items()}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", default="1,32")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--quantized-only", action="store_true", help="only the engines on the quantized weights")
    args = ap.parse_args()
    from shared.gguf_convert import ensure_default_model
    model = str(ensure_default_model())
    load0 = load_avg()
    chosen = {name: kw for name, kw in ENGINES.items() if not args.quantized_only or kw["quantization"] == "auto"}
    engines = {name: LLM(model, max_num_seqs=64, kv_cache_memory="512MiB", **kw) for name, kw in chosen.items()}
    ppl = {name: perplexity(llm) for name, llm in engines.items()}
    base = "dequantized (none), fp32" if not args.quantized_only else "quantized (auto), fp32 KV cache"
    lines = ["# Decode: quantized vs dequantized weights (SmolLM2-135M-Instruct, Q4_1 GGUF)\n",
             f"CPU: {cpu_name()} ({' '.join(cpu_flags())}), {torch.get_num_threads()} threads, extension ISA {cpu_capability()[0]}, "
             f"torch {torch.__version__}; load {load0} before, {{load1}} after. Context {args.context}, "
             f"median of {args.rounds} alternating rounds x {args.steps} steps.\n",
             "| engine | dtype | KV cache | weights MB | perplexity | " + " | ".join(
                 f"B={b} step ms | B={b} tok/s | vs {base}" for b in args.batch.split(",")) + " |",
             "|---|---|---|---:|---:|" + "---:|---:|---:|" * len(args.batch.split(","))]
    cells = {name: [] for name in engines}
    for b in (int(x) for x in args.batch.split(",")):
        ms = decode_ms(engines, b, args.context, args.rounds, args.steps)
        for name in engines:
            cells[name] += [f"{ms[name]:.2f}", f"{b * 1e3 / ms[name]:.1f}", f"{ms[base] / ms[name]:.2f}x"]
        print(b, ms, flush=True)
    for name, llm in engines.items():
        dtype, kv = (str(d).removeprefix("torch.") for d in (llm.engine.runner.dtype, llm.engine.runner.kv_dtype))
        lines.append(f"| {name} | {dtype} | {kv} | {weight_bytes(llm) / 1e6:.0f} | {ppl[name]:.3f} | " + " | ".join(cells[name]) + " |")
    text = "\n".join(lines).replace("{load1}", str(load_avg())) + "\n"
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / ("quant_decode_kv.md" if args.quantized_only else "quant_decode.md")).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
