"""KV blocks a sequence holds where every layer slides (Mistral): a Mistral-shaped tiny random model
(2 layers, window --window) runs one 4k-token sequence (a --prompt-token prompt, --output tokens),
its prefill --chunk tokens a step, in a cache too small for the whole sequence; the same model
without a window needs the whole sequence's blocks. Reports the most blocks the sequence held at
once, the bound (the window's and a chunk's blocks), and the step time of each model.

    .venv/bin/python bench/engine/window_blocks.py [--window 512] [--prompt 3968] [--output 128] [--chunk 256]
"""
from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.common.machine import cpu_flags, cpu_name, load_avg  # noqa: E402
from bench.common.results_files import results_dir, write_results  # noqa: E402

RESULTS = results_dir(__file__)


def tiny_mistral(path: Path, window: int | None) -> Path:
    import torch
    import transformers

    from tests.support.tiny_model import build_tokenizer
    config = transformers.MistralConfig(
        vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=4096, sliding_window=window, initializer_range=0.2,
        bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    transformers.MistralForCausalLM(config).save_pretrained(path)
    build_tokenizer().save_pretrained(path)
    return path


def run(model_dir: Path, prompt: list[int], output: int, chunk: int, blocks: int | None) -> dict:
    from engine_worker import LLM, SamplingParams
    from engine_worker.engine.block_manager import NO_BLOCK

    per_block = 2 * 2 * 16 * 2 * 16 * 4          # K+V, layers, block, kv heads, head_dim, fp32
    memory = (blocks or -(-(len(prompt) + output) // 16)) * per_block
    llm = LLM(str(model_dir), dtype="float32", enforce_eager=True, kv_cache_memory=memory,
              max_num_batched_tokens=chunk)
    params = SamplingParams(temperature=0, max_tokens=output, ignore_eos=True)
    rid, most, steps = llm.submit(prompt, params), 0, []
    while llm.engine.has_unfinished():
        t0 = time.perf_counter()
        llm.step()
        steps.append(time.perf_counter() - t0)
        seq = llm.engine.scheduler.find(rid)
        if seq is not None:
            most = max(most, sum(b != NO_BLOCK for b in seq.block_table))
    bm = llm.engine.block_manager
    return {"cache_blocks": bm.num_blocks, "most_blocks_held": most,
            "bound": bm.most_blocks_held(len(prompt) + output, chunk),
            "decode_step_ms_median": 1000 * statistics.median(steps[-output:])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--prompt", type=int, default=3968)
    ap.add_argument("--output", type=int, default=128)
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--out", default=str(RESULTS / "window_blocks"))
    args = ap.parse_args()
    rng = random.Random(1)
    prompt = [rng.randrange(3, 384) for _ in range(args.prompt)]
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        windowed = tiny_mistral(Path(tmp) / "window", args.window)
        full = tiny_mistral(Path(tmp) / "full", None)
        bound_blocks = -(-(args.window - 1 + args.chunk) // 16) + 1
        rows[f"window {args.window}, a cache of {bound_blocks} blocks"] = run(windowed, prompt, args.output, args.chunk,
                                                                             bound_blocks)
        rows["no window, a cache for the whole sequence"] = run(full, prompt, args.output, args.chunk, None)
    report = {"cpu": cpu_name(), "flags": " ".join(cpu_flags()), "load_avg": load_avg(), **vars(args), "rows": rows}
    lines = [f"# KV blocks held where every layer slides (window {args.window})\n",
             f"CPU: {report['cpu']} ({report['flags']}), load average {report['load_avg']}. One sequence of "
             f"{args.prompt} + {args.output} tokens, prefill {args.chunk} tokens a step, 16-token blocks.\n",
             "| model | cache blocks | most blocks the sequence held | bound | decode step ms (median) |",
             "|---|---:|---:|---:|---:|"]
    lines += [f"| {name} | {r['cache_blocks']} | {r['most_blocks_held']} | {r['bound']} | "
              f"{r['decode_step_ms_median']:.2f} |" for name, r in rows.items()]
    write_results(args.out, report, "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
