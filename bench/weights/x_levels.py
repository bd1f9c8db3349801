"""Which projections' activations cost perplexity when rounded to 7 bits (levels +-63, what int8
weights meet on a CPU without AVX512-VNNI) rather than 8 (+-127): the GGUF's exact dequantized
weights in fp32, each projection family's x rounded as quant_linear rounds it (per row and block of
32, scale amax / levels, nearest even) at the levels a configuration gives it, perplexity scored as
bench/weights/perplexity.py scores it (the same text, chunks and tokens).

An emulation on the exact weights, so that every split can be scored on any CPU; the kernel's
own results at 63 and 127 everywhere are perplexity.py's (the AVX2 and VNNI builds).

Rounded x makes perplexity chaotic: an ulp's change in x moves a value across a rounding boundary
now and then, and the change spreads. So with --seeds N each configuration is scored N times,
from the second on with x times (1 + 2^-22 z) before rounding (z standard normal, seeded): the
spread of those runs is the noise a kernel's summation order alone puts on its perplexity.

    .venv/bin/python bench/weights/x_levels.py --gguf FILE [--configs "exact;all=127;all=63;all=63,down=127"]
        [--seeds 5] [--ctx 512] [--chunks 14] [--out bench/results/x_levels/NAME]

A configuration: `exact`, or comma-separated family=levels with `all` first, the families qkv, o,
gate_up, down and lm_head (the tied output layer, a Q8_0 matrix in the default model's files).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.common.machine import cpu_flags, cpu_name, load_avg  # noqa: E402
from bench.common.results_files import results_dir, write_results  # noqa: E402
from bench.weights.perplexity import (TEXT, default_gguf, dequantize_exactly, diffs_from, perplexity,  # noqa: E402
                                     scored_logprobs, text_chunks)
from engine_worker import LLM  # noqa: E402

RESULTS = results_dir(__file__)
FAMILIES = ("qkv", "o", "gate_up", "down", "lm_head")
DEFAULT_CONFIGS = ("exact;all=127;all=63;all=63,qkv=127;all=63,o=127;all=63,gate_up=127;"
                   "all=63,down=127;all=63,lm_head=127;all=127,down=63")


def rounded(x: torch.Tensor, levels: int) -> torch.Tensor:
    """x as quant_linear's int8 method sees it: per row and block of 32, x * (levels / amax) in
    fp32 rounded to nearest even, times amax / levels. (levels / amax as one fp32 division, as the
    kernel: torch computes a number over a tensor as its reciprocal times the number, an ulp off,
    which rounds other ties: the first layer's x, an embedding row of int8 times scales, has many.)"""
    xb = x.float().reshape(-1, x.shape[-1] // 32, 32)
    amax = xb.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, torch.full_like(amax, levels) / amax, torch.zeros_like(amax))
    q = torch.round(xb * inv).clamp(-levels, levels)
    return (q * (amax / levels)).reshape(x.shape).to(x.dtype)


class RoundedX(nn.Module):
    """A linear layer whose input is rounded to `levels` first (0: left exact), jittered by a
    relative 2^-22 z first where `jitter` is set."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner, self.levels, self.jitter = inner, 0, False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.levels:
            return self.inner(x)
        if self.jitter:
            x = x * (1 + 2.0 ** -22 * torch.randn_like(x))
        return self.inner(rounded(x, self.levels))


def wrap(model: nn.Module) -> dict[str, list[RoundedX]]:
    """Every projection of the model and its output layer wrapped in RoundedX, by family."""
    families: dict[str, list[RoundedX]] = {f: [] for f in FAMILIES}
    for layer in model.layers:
        for owner, name, family in ((layer.self_attn, "qkv_proj", "qkv"), (layer.self_attn, "o_proj", "o"),
                                    (layer.mlp, "gate_up_proj", "gate_up"), (layer.mlp, "down_proj", "down")):
            w = RoundedX(getattr(owner, name))
            setattr(owner, name, w)
            families[family].append(w)
    model.lm_head = RoundedX(model.lm_head)
    families["lm_head"].append(model.lm_head)
    return families


def levels_of(config: str) -> dict[str, int]:
    """`exact` or "all=63,down=127" as levels by family (0: exact)."""
    levels = dict.fromkeys(FAMILIES, 0)
    if config == "exact":
        return levels
    for part in config.split(","):
        family, value = part.split("=")
        for f in (FAMILIES if family == "all" else (family,)):
            if f not in levels:
                raise SystemExit(f"unknown family {f!r}: one of all, {', '.join(FAMILIES)}")
            levels[f] = int(value)
    return levels


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gguf", type=Path)
    ap.add_argument("--configs", default=DEFAULT_CONFIGS, help="';'-separated configurations")
    ap.add_argument("--seeds", type=int, default=1, help="runs a configuration, jittered from the second")
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--chunks", type=int, default=14)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=RESULTS / "x_levels")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    gguf = args.gguf or default_gguf()
    meta = {"cpu": cpu_name(), "flags": cpu_flags(), "threads": args.threads, "torch": torch.__version__,
            "load_before": load_avg(), "gguf": gguf.name, "text": str(TEXT), "ctx": args.ctx, "seeds": args.seeds}
    with tempfile.TemporaryDirectory() as models:
        os.environ["KAITEN_MODELS_DIR"] = models
        llm = LLM(str(gguf), quantization="auto", dtype="float32", enforce_eager=True, kv_cache_memory="256MiB")
        dequantize_exactly(llm)
        families = wrap(llm.engine.runner.model)
        _, chunks = text_chunks(llm.tokenizer, args.ctx, args.chunks)
        lps = {}
        for config in args.configs.split(";"):
            levels = levels_of(config)
            runs = 1 if not any(levels.values()) else args.seeds
            for seed in range(runs):
                torch.manual_seed(seed)
                for family, value in levels.items():
                    for w in families[family]:
                        w.levels, w.jitter = value, seed > 0
                lps.setdefault(config, []).append(scored_logprobs(llm, chunks))
    ref = lps.get("exact", [None])[0]
    rows = {config: summary(runs, ref) for config, runs in lps.items()}
    meta["load_after"], meta["chunks"] = load_avg(), len(chunks)
    write_results(args.out, {"meta": meta, "rows": rows}, render(meta, rows))
    return 0


def summary(runs: list[list[float]], ref: list[float] | None) -> dict:
    """A configuration's runs: each run's perplexity and their median, and the medians over the
    runs of the largest and the mean logprob difference from the exact run's, token by token."""
    row = {"ppl_runs": [perplexity(v) for v in runs], "scored": len(runs[0])}
    row["ppl"] = statistics.median(row["ppl_runs"])
    if ref:
        diffs = [diffs_from(v, ref) for v in runs]
        row |= {key: statistics.median(d[key] for d in diffs) for key in diffs[0]}
    return row


def render(meta: dict, rows: dict) -> str:
    lines = [f"# Perplexity by the int8 levels of each projection's x ({meta['gguf']}, exact weights, fp32)\n",
             f"CPU: {meta['cpu']} ({', '.join(meta['flags'])}), {meta['threads']} threads, torch {meta['torch']}, "
             f"load average {meta['load_before']} before, {meta['load_after']} after.\n",
             f"Text: {meta['text']}; {meta['chunks']} chunks of {meta['ctx']} tokens, the second half of each "
             "scored, as bench/weights/perplexity.py. Levels: 127 is 8-bit x, 63 7-bit; a family not named "
             f"takes `all`'s. Each rounded configuration {meta['seeds']} run(s), the first unjittered: medians, "
             "and the runs' perplexities from least to most.\n",
             "| configuration | perplexity (median) | vs exact | runs | max abs logprob diff vs exact | mean abs diff |",
             "|---|---:|---:|---|---:|---:|"]
    base = rows.get("exact", {}).get("ppl")
    for config, r in rows.items():
        rel = f"{100 * (r['ppl'] / base - 1):+.2f}%" if base else ""
        diff = (f"{r['max_abs_logprob_diff_vs_exact']:.3f} | {r['mean_abs_logprob_diff_vs_exact']:.4f}"
                if "max_abs_logprob_diff_vs_exact" in r else " | ")
        spread = ", ".join(f"{p:.3f}" for p in sorted(r["ppl_runs"]))
        lines.append(f"| {config} | {r['ppl']:.4f} | {rel} | {spread} | {diff} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
