"""The KV cache's dtype on the default model served quantized (--quantization auto, --dtype auto):
prefill time a prompt token and decode step time, one engine per --kv-cache-dtype, in one process.

Prefill: each round, each engine in turn (the order reversed every other round) prefills the same
--prompts random prompts of 256 tokens (max_tokens 1, prefix caching off); decode: rounds of 8
steps alternating between the engines (bench/weights/quant_decode.py's decode_ms) at each batch size and
context. Medians; perplexity on quant_decode's fixed text.

    .venv/bin/python bench/engine/kv_dtype.py [--dtypes float16,bfloat16] [--batch 1,32] [--contexts 320,640]

Writes bench/results/kv_dtype/kv_dtype.{md,json} (--out names another path).
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.common.machine import cpu_flags, cpu_name, load_avg  # noqa: E402
from bench.common.results_files import results_dir, write_results  # noqa: E402
from bench.weights.quant_decode import decode_ms, perplexity  # noqa: E402
from bench.weights.quant_prefill import prefill_rounds  # noqa: E402
from engine_worker import LLM  # noqa: E402

RESULTS = results_dir(__file__)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtypes", default="float16,bfloat16", help="--kv-cache-dtype of each engine; the first is the baseline")
    ap.add_argument("--batch", default="1,32")
    ap.add_argument("--contexts", default="320,640")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default=str(RESULTS / "kv_dtype"))
    args = ap.parse_args()
    from shared.gguf_convert import ensure_default_model
    model = str(ensure_default_model())
    load0 = load_avg()
    engines = {d: LLM(model, quantization="auto", kv_cache_dtype=d, enable_prefix_caching=False, max_num_seqs=64,
                      kv_cache_memory="512MiB") for d in args.dtypes.split(",")}
    base = next(iter(engines))
    ppl = {d: perplexity(llm) for d, llm in engines.items()}
    prefill = prefill_rounds(engines, args.prompts, 256, args.rounds, reverse_every_other=True)
    report = {"cpu": cpu_name(), "flags": cpu_flags(), "threads": torch.get_num_threads(),
              "dtype": str(engines[base].engine.runner.dtype).removeprefix("torch."),
              "perplexity": ppl,
              "prefill_ms_per_token": {d: statistics.median(t) for d, t in prefill.items()}, "decode_ms": {}}
    for b in (int(x) for x in args.batch.split(",")):
        for ctx in (int(x) for x in args.contexts.split(",")):
            report["decode_ms"][f"B={b} context {ctx}"] = decode_ms(engines, b, ctx, args.rounds, 8)
    report["load"] = [load0, load_avg()]
    rows = {"perplexity": report["perplexity"], "prefill ms a prompt token": report["prefill_ms_per_token"],
            **{f"decode step ms, {k}": v for k, v in report["decode_ms"].items()}}
    lines = [f"# KV cache dtype: the default model quantized (auto), {report['dtype']} activations\n",
             f"CPU: {report['cpu']} ({' '.join(report['flags'])}), {report['threads']} threads; load {load0} before, "
             f"{report['load'][1]} after. Medians of {args.rounds} alternating rounds; prefill: {args.prompts} prompts "
             "of 256 tokens.\n",
             "| measure | " + " | ".join(engines) + f" | {' | '.join(f'{d} / {base}' for d in list(engines)[1:])} |",
             "|---|" + "---:|" * (2 * len(engines) - 1)]
    for label, values in rows.items():
        fmt = "{:.4f}" if label.startswith("prefill") else "{:.2f}"
        lines.append(f"| {label} | " + " | ".join(fmt.format(values[d]) for d in engines) + " | "
                     + " | ".join(f"{values[d] / values[base]:.2f}x" for d in list(engines)[1:]) + " |")
    write_results(args.out, report, "\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
