"""CPU paged-attention benchmark: TorchAttention and the fused C++ kernel (CppAttention, backend
"cpu") against a naive per-sequence loop.

SmolLM2-135M attention shapes (9 query heads, 3 KV heads, head_dim 64), bf16 (the serving dtype)
and fp32, block size 16,
blocks of every sequence scattered in random order through the pool.

Cases:
  decode64  64 decodes, contexts uniform in 32..768
  mixed     60 decodes (32..768) + a 256-token chunk behind a 512-token cached prefix
            + a fresh 256-token prefill
Per case: median over --runs calls of one layer's attention (the step's plan is built on the
first layer and reused by the others, as in the engine; its cost is reported separately), the
same for the naive loop in the same run, for the batched path with no length grouping, and for
the C++ kernel (skipped when it cannot be built here).

    .venv/bin/python bench/kernels/attention_cpu.py [--runs 30] [--threads N] [--out bench/results/attention_cpu]
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.common.machine import cpu_name, load_avg  # noqa: E402
from bench.common.results_files import results_dir  # noqa: E402
from bench.common.timing import median_ms  # noqa: E402
from kernels.cpu_attention import CppAttention, cpp_attention_available  # noqa: E402
from kernels.interface import AttentionMetadata  # noqa: E402
from kernels.torch_attention import TorchAttention  # noqa: E402

HQ, HKV, D, BS = 9, 3, 64, 16
SCALE = D ** -0.5
LAYERS = 30


def build(specs, dtype, seed):
    """specs: [(q_len, ctx)] -> q, k_cache, v_cache, meta, with a shuffled block pool."""
    g = torch.Generator().manual_seed(seed)
    nblk = [math.ceil(ctx / BS) for _, ctx in specs]
    total = sum(nblk) + 8
    pool = torch.randperm(total, generator=g).tolist()
    tables, p = [], 0
    for n in nblk:
        tables.append(pool[p:p + n])
        p += n
    width = max(nblk)
    k_cache = torch.randn(total, BS, HKV, D, generator=g).to(dtype)
    v_cache = torch.randn(total, BS, HKV, D, generator=g).to(dtype)
    qlens = [ql for ql, _ in specs]
    klens = [ctx for _, ctx in specs]
    cu = [0]
    slots = []
    for (ql, ctx), t in zip(specs, tables):
        cu.append(cu[-1] + ql)
        slots.extend(t[pos // BS] * BS + pos % BS for pos in range(ctx - ql, ctx))
    meta = AttentionMetadata(
        cu_seqlens_q=torch.tensor(cu, dtype=torch.int32),
        seqlens_k=torch.tensor(klens, dtype=torch.int32),
        block_tables=torch.tensor([t + [-1] * (width - len(t)) for t in tables], dtype=torch.int32),
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        max_seqlen_q=max(qlens), max_seqlen_k=max(klens),
        seqlens_q_list=qlens, seqlens_k_list=klens)
    q = torch.randn(cu[-1], HQ, D, generator=g).to(dtype)
    return q, k_cache, v_cache, meta


def naive_attention(q, k_cache, v_cache, meta, scale):
    """The straightforward version: one gather and one SDPA call per sequence."""
    out = torch.empty_like(q)
    bt = meta.block_tables
    start = 0
    for i, (ql, ctx) in enumerate(zip(meta.seqlens_q_list, meta.seqlens_k_list)):
        nb = -(-ctx // BS)
        blocks = bt[i, :nb].long()
        k = k_cache[blocks].view(-1, HKV, D)[:ctx].transpose(0, 1)
        v = v_cache[blocks].view(-1, HKV, D)[:ctx].transpose(0, 1)
        qi = q[start:start + ql].transpose(0, 1)
        mask = None if ql == 1 else torch.ones(ql, ctx, dtype=torch.bool).tril_(ctx - ql)
        o = F.scaled_dot_product_attention(qi, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
        out[start:start + ql] = o.transpose(0, 1)
        start += ql
    return out


def _time_contenders(fns, runs, clock):
    """Interleave the contenders run by run so a noisy neighbour hurts them alike."""
    for fn in fns.values():
        for _ in range(3):
            fn()
    res = {k: [] for k in fns}
    for _ in range(runs):
        for key, fn in fns.items():
            t0 = clock()
            fn()
            res[key].append((clock() - t0) * 1e3)
    return ({k: statistics.median(v) for k, v in res.items()}, {k: min(v) for k, v in res.items()})


def bench_case(name, specs, dtype, runs, seed):
    q, kc, vc, meta = build(specs, dtype, seed)
    fast = TorchAttention()
    flat = TorchAttention(group_max_seqs=1 << 30, group_min_fill=0.0, group_max_tokens=1 << 40)

    def first_call():
        fast._plans.clear()
        fast.attention(q, kc, vc, meta, SCALE)

    fns = {"fast": lambda: fast.attention(q, kc, vc, meta, SCALE),
           "flat": lambda: flat.attention(q, kc, vc, meta, SCALE),
           "naive": lambda: naive_attention(q, kc, vc, meta, SCALE),
           "first_call": first_call}
    cpp = CppAttention() if cpp_attention_available() else None
    if cpp is not None:
        fns["cpp"] = lambda: cpp.attention(q, kc, vc, meta, SCALE)
    # 1) wall clock with the configured torch threads
    med, mn = _time_contenders(fns, runs, time.perf_counter)
    # 2) CPU time of the calling thread with torch on 1 thread: insensitive to time the process
    #    spends descheduled, so the ratios stay meaningful on a busy shared machine
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        med1, mn1 = _time_contenders(fns, runs, time.thread_time)
    finally:
        torch.set_num_threads(threads)

    ref = naive_attention(q, kc, vc, meta, SCALE).float()
    err = (fast.attention(q, kc, vc, meta, SCALE).float() - ref).abs().max().item()
    err_flat = (flat.attention(q, kc, vc, meta, SCALE).float() - ref).abs().max().item()
    err_cpp = None if cpp is None else (cpp.attention(q, kc, vc, meta, SCALE).float() - ref).abs().max().item()
    plan = fast._plans[0]
    padded = sum(g.n * g.nblk * BS for g in plan.decode_groups)
    dec_ctx = sum(ctx for ql, ctx in specs if ql == 1)
    r = lambda x: round(x, 3)  # noqa: E731
    return {
        "case": name,
        "num_seqs": len(specs),
        "num_tokens": q.shape[0],
        "decode_seqs": sum(1 for ql, _ in specs if ql == 1),
        "prefill_chunks": [(ql, ctx) for ql, ctx in specs if ql > 1],
        "decode_context_tokens": dec_ctx,
        "decode_groups": len(plan.decode_groups),
        "decode_padded_tokens": padded,
        "torch_ms": r(med["fast"]),
        "torch_min_ms": r(mn["fast"]),
        "torch_first_call_ms": r(med["first_call"]),
        "torch_ungrouped_ms": r(med["flat"]),
        "naive_ms": r(med["naive"]),
        "naive_min_ms": r(mn["naive"]),
        "speedup_vs_naive": round(med["naive"] / med["fast"], 2),
        "speedup_vs_ungrouped": round(med["flat"] / med["fast"], 2),
        "per_step_30_layers_ms": round(med["first_call"] + (LAYERS - 1) * med["fast"], 1),
        "naive_per_step_30_layers_ms": round(LAYERS * med["naive"], 1),
        "cpu1_torch_ms": r(med1["fast"]),
        "cpu1_torch_first_call_ms": r(med1["first_call"]),
        "cpu1_torch_ungrouped_ms": r(med1["flat"]),
        "cpu1_naive_ms": r(med1["naive"]),
        "cpu1_speedup_vs_naive": round(med1["naive"] / med1["fast"], 2),
        "cpu1_speedup_vs_ungrouped": round(med1["flat"] / med1["fast"], 2),
        "cpu1_min": {k: r(v) for k, v in mn1.items()},
        "max_abs_diff_vs_naive": err,
        "max_abs_diff_ungrouped_vs_naive": err_flat,
        "cpp_ms": None if cpp is None else r(med["cpp"]),
        "cpp_min_ms": None if cpp is None else r(mn["cpp"]),
        "cpu1_cpp_ms": None if cpp is None else r(med1["cpp"]),
        "cpp_speedup_vs_torch": None if cpp is None else round(med["fast"] / med["cpp"], 2),
        "cpu1_cpp_speedup_vs_torch": None if cpp is None else round(med1["fast"] / med1["cpp"], 2),
        "max_abs_diff_cpp_vs_naive": err_cpp,
    }


def bench_write_kv(dtype, runs, seed):
    g = torch.Generator().manual_seed(seed)
    nblocks = 4096
    kc = torch.zeros(nblocks, BS, HKV, D, dtype=dtype)
    vc = torch.zeros_like(kc)
    out = {}
    for n in (64, 512):
        key = torch.randn(n, HKV, D, generator=g).to(dtype)
        val = torch.randn(n, HKV, D, generator=g).to(dtype)
        slots = torch.randperm(nblocks * BS, generator=g)[:n]
        be = TorchAttention()
        med, _ = median_ms(lambda: be.write_kv(key, val, kc, vc, slots), runs)
        out[f"write_kv_{n}_tokens_ms"] = round(med, 4)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=30)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: leave the default)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtypes", default="bf16,fp32",
                    help="comma list of bf16, fp32 (bf16 is the serving dtype)")
    ap.add_argument("--out", default=str(results_dir(__file__)))
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    dtypes = {"bf16": torch.bfloat16, "fp32": torch.float32}
    rng = random.Random(args.seed)
    decode64 = [(1, rng.randint(32, 768)) for _ in range(64)]
    mixed = [(1, rng.randint(32, 768)) for _ in range(60)] + [(256, 768), (256, 256)]
    rng.shuffle(mixed)

    load_before = load_avg()
    with torch.inference_mode():
        cases = []
        for dname in args.dtypes.split(","):
            cases.append(bench_case(f"decode64 {dname}", decode64, dtypes[dname], args.runs, args.seed + 1))
            cases.append(bench_case(f"mixed {dname}", mixed, dtypes[dname], args.runs, args.seed + 2))
        wkv = bench_write_kv(torch.bfloat16, args.runs, args.seed + 3)

    env = {
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "cpu": cpu_name(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "dtypes": args.dtypes,
        "heads": f"{HQ} q / {HKV} kv, head_dim {D}, block_size {BS}",
        "runs": args.runs,
        "loadavg_1m_before_after": [load_before, load_avg()],
    }
    result = {"env": env, "cases": cases, **wkv}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "attention_cpu.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / "attention_cpu.md").write_text(_markdown(result))
    print(_markdown(result))


def _markdown(r) -> str:
    e = r["env"]
    lines = [
        "# CPU paged attention (TorchAttention, the C++ kernel) vs a naive per-sequence loop",
        "",
        f"{e['heads']}, torch {e['torch']}, {e['threads']} threads on "
        f"{e['cpu']} ({e['cpu_count']} CPUs). One layer's attention call; median of "
        f"{e['runs']} runs (min in brackets), the contenders interleaved in the same process. "
        f"1-minute load average before/after: {e['loadavg_1m_before_after']}: on a shared, busy "
        "machine the wall-clock columns swing widely, the CPU-time table below is the stable one.",
        "",
        "| case | seqs | tokens | torch ms | naive ms | speedup | ungrouped batched ms "
        "| first call (plan) ms | 30 layers ms (naive) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for c in r["cases"]:
        lines.append(
            f"| {c['case']} | {c['num_seqs']} | {c['num_tokens']} | {c['torch_ms']:.2f} "
            f"({c['torch_min_ms']:.2f}) | {c['naive_ms']:.2f} ({c['naive_min_ms']:.2f}) | "
            f"**{c['speedup_vs_naive']:.2f}x** | {c['torch_ungrouped_ms']:.2f} | "
            f"{c['torch_first_call_ms']:.2f} | {c['per_step_30_layers_ms']:.0f} "
            f"({c['naive_per_step_30_layers_ms']:.0f}) |")
    lines += [
        "",
        "Same calls timed by the calling thread's CPU time with torch on 1 thread (median ms; "
        "robust to a busy machine, since descheduled time does not count):",
        "",
        "| case | torch | naive | speedup | ungrouped batched | first call (plan) |",
        "|---|---|---|---|---|---|",
    ]
    for c in r["cases"]:
        lines.append(
            f"| {c['case']} | {c['cpu1_torch_ms']:.2f} | {c['cpu1_naive_ms']:.2f} | "
            f"**{c['cpu1_speedup_vs_naive']:.2f}x** | {c['cpu1_torch_ungrouped_ms']:.2f} | "
            f"{c['cpu1_torch_first_call_ms']:.2f} |")
    if any(c["cpp_ms"] is not None for c in r["cases"]):
        lines += [
            "",
            "The fused C++ kernel (backend \"cpu\") in the same runs (median ms; speedup over torch):",
            "",
            "| case | C++ ms | torch ms | speedup | C++ CPU-time 1 thread | torch | speedup |",
            "|---|---|---|---|---|---|---|",
        ]
        for c in r["cases"]:
            if c["cpp_ms"] is not None:
                lines.append(
                    f"| {c['case']} | {c['cpp_ms']:.2f} ({c['cpp_min_ms']:.2f}) | {c['torch_ms']:.2f} | "
                    f"**{c['cpp_speedup_vs_torch']:.2f}x** | {c['cpu1_cpp_ms']:.2f} | {c['cpu1_torch_ms']:.2f} | "
                    f"**{c['cpu1_cpp_speedup_vs_torch']:.2f}x** |")
    lines += [""]
    for c in r["cases"]:
        lines.append(
            f"- {c['case']}: {c['decode_seqs']} decodes in {c['decode_groups']} length groups, "
            f"{c['decode_padded_tokens']} gathered positions for {c['decode_context_tokens']} "
            "context tokens; "
            f"prefill chunks (q_len, ctx) {c['prefill_chunks']}; max |torch - naive| "
            f"{c['max_abs_diff_vs_naive']:.3g}"
            + ("" if c["max_abs_diff_cpp_vs_naive"] is None
               else f", max |C++ - naive| {c['max_abs_diff_cpp_vs_naive']:.3g}") + ".")
    lines += [
        f"- write_kv (bf16): {r['write_kv_64_tokens_ms']} ms for 64 tokens, "
        f"{r['write_kv_512_tokens_ms']} ms for 512 tokens (random slots).",
        "",
        "\"ungrouped batched\" is the same backend with one padded group for all decodes (pad to the "
        "longest context). \"first call\" includes building the step's plan, which the other "
        "layers of the step reuse.",
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
