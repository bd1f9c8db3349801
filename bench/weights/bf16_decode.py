"""Decode of the default model computing in fp32 on a CPU: its bf16 weights kept in bf16 and widened
in the kernel (Bf16Linear, this change) against the same values stored in fp32 (oneDNN-packed fp32
weights, what a bf16 model was widened to at load before). --quantization none, both engines in
one process; steps alternate between them round by round (bench/weights/quant_decode.py's decode_ms), and
the greedy tokens of both are compared.

    .venv/bin/python bench/weights/bf16_decode.py [--batch 1,8,32] [--rounds 7] [--steps 8]

Writes bench/results/bf16_decode/bf16_decode.md and .json.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.common.machine import cpu_flags, cpu_name, load_avg  # noqa: E402
from bench.common.results_files import results_dir  # noqa: E402
from bench.weights.quant_decode import TEXT, decode_ms, weight_bytes  # noqa: E402
from engine_worker import LLM, SamplingParams  # noqa: E402
from kernels.cpu_ops_build import cpu_capability  # noqa: E402

RESULTS = results_dir(__file__)
BF16, FP32 = "bf16 weights kept, widened in the kernel", "fp32 copy of the same weights (before)"


def fp32_copy(model_dir: Path, out: Path) -> Path:
    """The model directory with model.safetensors widened to fp32 (and no quantized file)."""
    shutil.copytree(model_dir, out, ignore=shutil.ignore_patterns("*.safetensors"))
    save_file({k: v.float() for k, v in load_file(model_dir / "model.safetensors").items()},
              out / "model.safetensors")
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", default="1,8,32")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--steps", type=int, default=8)
    args = ap.parse_args()
    from shared.gguf_convert import ensure_default_model
    model = ensure_default_model()
    meta = {"cpu": cpu_name(), "flags": cpu_flags(), "threads": torch.get_num_threads(), "isa": cpu_capability()[0],
            "torch": torch.__version__, "load_before": load_avg(), "context": args.context, "rounds": args.rounds,
            "steps": args.steps}
    with tempfile.TemporaryDirectory() as tmp:
        kw = dict(quantization="none", dtype="float32", max_num_seqs=64, kv_cache_memory="512MiB")
        engines = {BF16: LLM(str(model), **kw), FP32: LLM(str(fp32_copy(model, Path(tmp) / "fp32")), **kw)}
        greedy = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
        tokens = {name: llm.generate([TEXT], greedy)[0].token_ids for name, llm in engines.items()}
        rows = {name: {"weights_bytes": weight_bytes(llm)} for name, llm in engines.items()}
        for b in (int(x) for x in args.batch.split(",")):
            ms = decode_ms(engines, b, args.context, args.rounds, args.steps)
            for name in engines:
                rows[name][f"B={b} step ms"] = ms[name]
            print(b, ms, flush=True)
    meta["load_after"] = load_avg()
    meta["greedy_tokens_equal"] = tokens[BF16] == tokens[FP32]
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "bf16_decode.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    (RESULTS / "bf16_decode.md").write_text(render(meta, rows, args.batch.split(",")))
    print(render(meta, rows, args.batch.split(",")))
    return 0


def render(meta: dict, rows: dict, batches: list[str]) -> str:
    lines = ["# Decode in fp32: bf16-stored weights kept in bf16 vs widened to fp32 (SmolLM2-135M-Instruct)\n",
             f"CPU: {meta['cpu']} ({', '.join(meta['flags'])}), {meta['threads']} threads, extension ISA {meta['isa']}, "
             f"torch {meta['torch']}; load average {meta['load_before']} before, {meta['load_after']} after. "
             f"Context {meta['context']}, median of {meta['rounds']} alternating rounds x {meta['steps']} steps. "
             f"Greedy tokens of 64 steps equal: {meta['greedy_tokens_equal']}.\n",
             "| weights | resident MB | " + " | ".join(f"B={b} step ms | vs fp32 copy" for b in batches) + " |",
             "|---|---:|" + "---:|---:|" * len(batches)]
    for name, r in rows.items():
        cells = [f"{r[f'B={b} step ms']:.2f} | {rows[FP32][f'B={b} step ms'] / r[f'B={b} step ms']:.2f}x" for b in batches]
        lines.append(f"| {name} | {r['weights_bytes'] / 1e6:.0f} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
