"""Batched LoRA throughput: base-only vs adapters mixed with base requests, offline, c=32.

One in-process engine on the default model (SmolLM2-135M-Instruct as served: compiled, its GGUF
weights quantized as stored) serves 4 random PEFT adapters of rank 16 on every projection
(q, k, v, o, gate, up, down), made with peft. Each round runs the same 32 requests (random
prompts, a fixed number of output tokens, ignore_eos) submitted at once, in three mixes:
base-only, mixed (round-robin over the base model and the 4 adapters) and adapters-only;
rounds interleave the mixes; the table has the medians and the per-round ratio to base-only.
An engine with LoRA disabled (--max-loras 0) runs the base-only mix in the same rounds: the
cost of having slots when no request uses them.

Also times ways to apply the adapters of a decode batch of 32 tokens (4 adapters, 8 tokens each)
to one layer's projections: the C++ kernel kaiten_cpu::lora_add_ (what the engine runs in fp32 on
the CPU), the torch-op kaiten::lora_add_ in its two layouts (the runs padded for batched matmuls,
and matmuls per slot) and a per-token gather of A and B followed by bmm (BGMV-like in torch ops).

    .venv/bin/python bench/engine/lora.py [--rounds 3] [--prompt-len 64] [--output-len 64]

Writes bench/results/lora/lora.{md,json}.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.common.machine import cpu_flags, cpu_name, load_avg  # noqa: E402
from bench.common.results_files import results_dir  # noqa: E402
from bench.common.timing import median_ms  # noqa: E402
from engine_worker.engine.llm_engine import LLMEngine  # noqa: E402
from engine_worker.engine.sampling_params import SamplingParams  # noqa: E402
from engine_worker.model.lora_layers import LoraBatch, lora_add_, projection_shapes  # noqa: E402
from shared.config import EngineConfig  # noqa: E402
from shared.model_source import resolve_model  # noqa: E402
from tests.support.tiny_model import build_lora_adapter  # noqa: E402

RESULTS = results_dir(__file__)
NUM_ADAPTERS, RANK, CONCURRENCY = 4, 16, 32


def make_adapters(model_dir: Path, root: Path) -> dict[str, str]:
    from transformers import AutoModelForCausalLM
    out = {}
    for i in range(NUM_ADAPTERS):
        base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        out[f"a{i}"] = str(build_lora_adapter(model_dir, root / f"a{i}", rank=RANK, seed=i, base_model=base))
    return out


def run_once(engine: LLMEngine, prompts: list[list[int]], names: list[str], output_len: int, tag: str) -> float:
    """Output tokens per second of the whole batch, submitted at once."""
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    for i, (p, name) in enumerate(zip(prompts, names)):
        engine.add_request(f"{tag}-{i}", p, params, lora_name=name)
    tokens, start = 0, time.perf_counter()
    while engine.has_unfinished():
        tokens += sum(len(o.new_token_ids) for o in engine.step())
    rate = tokens / (time.perf_counter() - start)
    print(f"  {tag}: {rate:.1f} tok/s", flush=True)
    return rate


def engine_rounds(args, model_dir: Path, adapters: dict[str, str]) -> dict:
    common = dict(model=str(model_dir), offline=True, kv_cache_memory="512MiB", max_num_seqs=CONCURRENCY,
                  num_threads=args.threads)
    lora = LLMEngine(EngineConfig(**common, lora_modules=[f"{n}={p}" for n, p in adapters.items()],
                                  max_loras=NUM_ADAPTERS, max_lora_rank=RANK))
    plain = LLMEngine(EngineConfig(**common, max_loras=0)) if args.disabled else None
    rng = random.Random(0)
    vocab = lora.vocab_size
    prompts = [[rng.randrange(3, vocab) for _ in range(args.prompt_len)] for _ in range(CONCURRENCY)]
    names = list(adapters)
    mixes = {"base-only": [""] * CONCURRENCY,
             "mixed": [([""] + names)[i % (NUM_ADAPTERS + 1)] for i in range(CONCURRENCY)],
             "adapters-only": [names[i % NUM_ADAPTERS] for i in range(CONCURRENCY)]}
    run_once(lora, prompts[:4], mixes["mixed"][:5], 4, "warm")      # loads every slot, warms the graph
    if plain is not None:
        run_once(plain, prompts[:4], [""] * 4, 4, "warm")
    rows: dict[str, list[float]] = {m: [] for m in mixes}
    if plain is not None:
        rows["base-only, LoRA disabled"] = []
    for r in range(args.rounds):
        for mix, lora_names in mixes.items():
            rows[mix].append(run_once(lora, prompts, lora_names, args.output_len, f"r{r}-{mix}"))
        if plain is not None:
            rows["base-only, LoRA disabled"].append(run_once(plain, prompts, mixes["base-only"], args.output_len,
                                                             f"r{r}-plain"))
        print(f"round {r}: " + ", ".join(f"{m} {v[-1]:.1f}" for m, v in rows.items()), flush=True)
    return {"dtype": str(lora.runner.dtype).removeprefix("torch."), "rows": rows,
            "mixes": {m: {"base": n.count(""), "adapters": len(set(n) - {""})} for m, n in mixes.items()}}


def kernel_times(model_dir: Path, runs: int) -> dict:
    """ms per layer (4 projections) for a decode batch of 32 tokens over 4 adapters."""
    from engine_worker.model.config import ModelConfig
    from kernels.cpu_ops_build import cpu_ops_available
    shapes = projection_shapes(ModelConfig.from_dir(model_dir))
    torch.manual_seed(0)
    slots = torch.arange(CONCURRENCY) % NUM_ADAPTERS
    padded = LoraBatch.build(slots.numpy(), NUM_ADAPTERS, torch.device("cpu"))
    assert padded.pad_index.numel(), "an even decode batch is padded"
    segmented = LoraBatch.build(slots.numpy(), NUM_ADAPTERS, torch.device("cpu"), padded=False)
    layer = []
    for fan_in, outs in shapes.values():
        layer.append((torch.randn(CONCURRENCY, sum(outs)), torch.randn(CONCURRENCY, fan_in),
                      torch.randn(NUM_ADAPTERS, fan_in, len(outs) * RANK), torch.randn(NUM_ADAPTERS, RANK, sum(outs)),
                      outs))

    def gathered():       # B as the block-diagonal [parts * R, out] it was before
        for y, x, a, b, outs in layer:
            block = torch.block_diag(*[b[0, :, :n] for n in outs])[None].expand(NUM_ADAPTERS, -1, -1)
            y + torch.bmm(torch.bmm(x[:, None], a[slots]), block[slots])[:, 0]
    fns = {"padded_ms": lambda: [lora_add_(y, x, a, b, outs, *padded.args()) for y, x, a, b, outs in layer],
           "per_slot_ms": lambda: [lora_add_(y, x, a, b, outs, *segmented.args()) for y, x, a, b, outs in layer],
           "gathered_ms": gathered}
    if cpu_ops_available():
        fns["cpp_ms"] = lambda: [torch.ops.kaiten_cpu.lora_add_(y, x, a, b, outs, segmented.token_index,
                                                                segmented.bounds) for y, x, a, b, outs in layer]
    with torch.inference_mode():
        for y, x, a, b, outs in layer:          # the ops add the same terms
            outputs = [y.clone() for _ in range(3)]
            lora_add_(outputs[0], x, a, b, outs, *padded.args())
            lora_add_(outputs[1], x, a, b, outs, *segmented.args())
            if "cpp_ms" in fns:
                torch.ops.kaiten_cpu.lora_add_(outputs[2], x, a, b, outs, segmented.token_index, segmented.bounds)
            else:
                outputs.pop()
            for out in outputs[1:]:
                assert torch.allclose(out, outputs[0], atol=1e-3)
        return {name: median_ms(fn, runs)[0] for name, fn in fns.items()}


def write(report: dict) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "lora.json").write_text(json.dumps(report, indent=2) + "\n")
    e, k = report["engine"], report["kernel"]
    base = e["rows"]["base-only"]
    lines = [f"# Batched LoRA: SmolLM2-135M-Instruct ({e['dtype']}, GGUF Q4_1/Q8_0 as stored), "
             f"{NUM_ADAPTERS} adapters of rank {RANK}, c={CONCURRENCY}",
             "", f"{report['cpu']} ({', '.join(report['cpu_flags'])}), {report['threads']} torch threads, "
             f"torch {report['torch']}. 1-minute load average before/after: {report['load_before']} / "
             f"{report['load_after']}.",
             "", f"`{report['command']}`: {CONCURRENCY} requests of {report['prompt_len']} prompt tokens and "
             f"{report['output_len']} output tokens (greedy, ignore_eos) submitted at once to the offline "
             f"engine, {report['rounds']} interleaved rounds; output tokens/s of the whole batch (prefill "
             "included). Adapters on q, k, v, o, gate, up and down of every layer.",
             "", "| mix | base requests | adapters | median tok/s | rounds | median ratio to base-only |",
             "|---|---:|---:|---:|---|---:|"]
    for mix, vals in e["rows"].items():
        m = e["mixes"].get(mix, {"base": CONCURRENCY, "adapters": 0})
        ratio = statistics.median(v / b for v, b in zip(vals, base))
        lines.append(f"| {mix} | {m['base']} | {m['adapters']} | {statistics.median(vals):.1f} | "
                     f"{', '.join(f'{v:.1f}' for v in vals)} | {ratio:.2f} |")
    cpp = (f"kaiten_cpu::lora_add_, the C++ kernel the engine runs in fp32 on the CPU, {k['cpp_ms']:.3f} ms; "
           if "cpp_ms" in k else "")
    lines += ["", f"Applying 4 adapters to one layer's 4 projections for a decode batch of {CONCURRENCY} tokens "
              f"(8 per adapter), fp32, in place, median of {report['kernel_runs']} runs: {cpp}kaiten::lora_add_ "
              f"in torch ops (where the kernel is not used) with the runs padded into batched matmuls "
              f"{k['padded_ms']:.3f} ms, with matmuls per slot (its layout for uneven runs) {k['per_slot_ms']:.3f} "
              f"ms; a per-token gather of A and a block-diagonal B then bmm {k['gathered_ms']:.3f} ms."]
    (RESULTS / "lora.md").write_text("\n".join(lines) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--kernel-runs", type=int, default=50)
    parser.add_argument("--threads", type=int, default=0,
                        help="torch threads (0: one per core; 1 where other work shares the cores)")
    parser.add_argument("--no-disabled", dest="disabled", action="store_false",
                        help="skip the engine with LoRA disabled")
    args = parser.parse_args()
    model_dir = resolve_model("")
    if args.threads:
        torch.set_num_threads(args.threads)
    report = {"cpu": cpu_name(), "cpu_flags": cpu_flags(), "threads": torch.get_num_threads(),
              "torch": torch.__version__, "load_before": load_avg(), "rounds": args.rounds,
              "prompt_len": args.prompt_len, "output_len": args.output_len, "kernel_runs": args.kernel_runs,
              "command": "python bench/engine/lora.py " + " ".join(sys.argv[1:])}
    report["kernel"] = kernel_times(model_dir, args.kernel_runs)
    print(report["kernel"], flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        report["engine"] = engine_rounds(args, model_dir, make_adapters(model_dir, Path(tmp)))
    report["load_after"] = load_avg()
    write(report)
    print((RESULTS / "lora.md").read_text())


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
