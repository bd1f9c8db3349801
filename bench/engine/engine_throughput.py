"""Offline throughput: HF one-at-a-time (a), HF static batches of 16 (b), and Kaiten (c).

One workload, one run: 64 requests, prompts uniform in 32..512 tokens, outputs uniform in 16..256
tokens with ignore_eos, on SmolLM2-135M-Instruct in bf16 and fp32. Writes
bench/results/engine_throughput/engine_throughput.{md,json} and a torch.profiler table of Kaiten's step.

    .venv/bin/python bench/engine/engine_throughput.py [--dtypes bfloat16,float32] [--num-requests 64]
    .venv/bin/python bench/engine/engine_throughput.py --num-requests float32=64,bfloat16=16

A CPU without native bf16 (no AVX512-BF16/AMX) runs bf16 matmuls several times slower than fp32;
there a per-dtype request count keeps the bf16 rows affordable. The table says how many ran.
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.common.machine import cpu_name, load_avg  # noqa: E402
from bench.common.results_files import results_dir  # noqa: E402
from engine_worker import LLM, SamplingParams  # noqa: E402
from engine_worker.model.model_runner import resolve_dtype  # noqa: E402

RESULTS = results_dir(__file__)


def workload(n: int, vocab: int, seed: int = 0) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [([rng.randrange(3, vocab) for _ in range(rng.randint(32, 512))], rng.randint(16, 256))
            for _ in range(n)]


def hf_model(model_dir: str, dtype: torch.dtype, device: str):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()


@torch.inference_mode()
def run_hf_single(model, reqs) -> dict:
    start = time.perf_counter()
    tokens = 0
    for prompt, out_len in reqs:
        ids = torch.tensor([prompt], device=model.device)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=out_len,
                             min_new_tokens=out_len, do_sample=False, pad_token_id=0)
        tokens += out.shape[1] - len(prompt)
    return {"wall_s": time.perf_counter() - start, "output_tokens": tokens}


@torch.inference_mode()
def run_hf_static(model, reqs, batch_size: int = 16) -> dict:
    start = time.perf_counter()
    tokens = 0
    for i in range(0, len(reqs), batch_size):
        chunk = reqs[i:i + batch_size]
        width = max(len(p) for p, _ in chunk)
        ids = torch.tensor([[0] * (width - len(p)) + p for p, _ in chunk], device=model.device)  # left padding
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in chunk], device=model.device)
        steps = max(n for _, n in chunk)
        model.generate(ids, attention_mask=mask, max_new_tokens=steps, min_new_tokens=steps,
                       do_sample=False, pad_token_id=0)
        tokens += sum(n for _, n in chunk)       # only the tokens each request asked for count
    return {"wall_s": time.perf_counter() - start, "output_tokens": tokens}


def run_kaiten(llm: LLM, reqs) -> dict:
    engine = llm.engine
    bs = engine.block_manager.block_size
    start = time.perf_counter()
    ids = [llm.submit(p, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)) for p, n in reqs]
    remaining, tokens, steps = set(ids), 0, 0
    peak = {"allocated_slots": 0, "used_slots": 0}
    while remaining:
        for out in llm.step():
            tokens += len(out.new_token_ids)
            if out.finished:
                remaining.discard(out.request_id)
        steps += 1
        running = engine.scheduler.running
        allocated = sum(len(s.block_table) for s in running) * bs
        if allocated > peak["allocated_slots"]:
            peak = {"allocated_slots": allocated, "used_slots": sum(s.num_computed_tokens for s in running)}
    wall = time.perf_counter() - start
    waste = (peak["allocated_slots"] - peak["used_slots"]) / max(peak["allocated_slots"], 1)
    return {"wall_s": wall, "output_tokens": tokens, "steps": steps, "kv_waste_at_peak": waste,
            "peak_allocated_slots": peak["allocated_slots"], "preemptions": engine.scheduler.num_preemptions}


def step_until_decoding(llm: LLM) -> None:
    """Step until every submitted request has its whole prompt computed: the steps after this are
    decode-only."""
    engine = llm.engine
    while (engine.scheduler.waiting
           or any(s.num_computed_tokens < s.num_prompt_tokens for s in engine.scheduler.running)):
        llm.step()


def start_decoding(llm: LLM, batch: int, max_tokens: int, context: int = 256, low: int = 3) -> list[str]:
    """Submits `batch` prompts of `context` random token ids (from `low` up, a fixed seed; greedy,
    ignore_eos, `max_tokens` each) and steps until all of them decode; their request ids."""
    rng = random.Random(0)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    ids = [llm.submit([rng.randrange(low, llm.engine.vocab_size) for _ in range(context)], params)
           for _ in range(batch)]
    step_until_decoding(llm)
    return ids


def profile_kaiten(llm: LLM, reqs, top: int = 15) -> str:
    """Profile decode-heavy steps: all requests admitted, then 10 steps under torch.profiler."""
    from torch.profiler import ProfilerActivity, profile
    ids = [llm.submit(p, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)) for p, n in reqs]
    step_until_decoding(llm)
    cuda = llm.engine.runner.device.type == "cuda"
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        for _ in range(10):
            llm.step()
    for rid in ids:
        llm.engine.abort_request(rid)
    llm.step()
    return prof.key_averages().table(sort_by="self_cuda_time_total" if cuda else "self_cpu_time_total", row_limit=top)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="")
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--num-requests", default="64",
                    help="requests per dtype: N for all, or DTYPE=N,... (e.g. float32=64,bfloat16=16)")
    ap.add_argument("--kv-cache-memory", default="2GiB")
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--attention-backend", default="auto", help="auto | torch | triton | flash_attn")
    ap.add_argument("--enforce-eager", action="store_true",
                    help="CUDA: no decode CUDA graphs; CPU: the eager model (no torch.compile)")
    ap.add_argument("--forward-ab", action="store_true",
                    help="Kaiten only, no HF baselines, no files: the eager and the compiled forward on the "
                         "same workload, one after the other, per dtype")
    ap.add_argument("--out", default=str(RESULTS / "engine_throughput"), help="writes OUT.md and OUT.json")
    ap.add_argument("--hf-single-requests", type=int, default=0,
                    help="run (a), the slowest baseline, on only the first N requests (0: all); "
                         "tokens/s is a rate, so it stays comparable")
    args = ap.parse_args()
    if not args.model:
        from shared.gguf_convert import ensure_default_model
        args.model = str(ensure_default_model())
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    device = torch.device(args.device)
    dtypes = args.dtypes.split(",")
    counts = request_counts(args.num_requests, dtypes)
    results = {"model": Path(args.model).name, "threads": torch.get_num_threads(), "cpu": cpu_name(),
               "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
               "attention_backend": args.attention_backend,
               "cuda_graphs": device.type == "cuda" and not args.enforce_eager,
               "torch": torch.__version__, "load_avg_before": load_avg(), "runs": {}}
    if args.forward_ab:
        forward_ab(args, dtypes, counts)
        return
    profile_text = ""
    for dtype_name in dtypes:
        dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[dtype_name]
        llm = LLM(args.model, dtype=dtype_name, kv_cache_memory=args.kv_cache_memory,
                  max_num_batched_tokens=args.max_num_batched_tokens, device=args.device,
                  attention_backend=args.attention_backend, enforce_eager=args.enforce_eager)
        results["attention_backend"] = llm.engine.runner.backend.name
        reqs = workload(counts[dtype_name], llm.engine.vocab_size)
        llm.generate([reqs[0][0][:64]], SamplingParams(temperature=0, max_tokens=4))      # warm-up
        run = {"kaiten": run_kaiten(llm, reqs)}
        print(dtype_name, "kaiten", run["kaiten"], flush=True)
        if llm.engine.runner.dtype == resolve_dtype("auto", device):   # the serving dtype
            profile_text = f"{dtype_name}:\n" + profile_kaiten(llm, reqs)
        del llm
        model = hf_model(args.model, dtype, args.device)
        model.generate(torch.tensor([reqs[0][0][:64]], device=device), max_new_tokens=4, do_sample=False, pad_token_id=0)
        run["hf_static16"] = run_hf_static(model, reqs)
        print(dtype_name, "hf_static16", run["hf_static16"], flush=True)
        n_single = args.hf_single_requests or len(reqs)
        run["hf_single"] = run_hf_single(model, reqs[:n_single]) | {"num_requests": n_single}
        print(dtype_name, "hf_single", run["hf_single"], flush=True)
        for r in run.values():
            r["tokens_per_s"] = r["output_tokens"] / r["wall_s"]
        k = run["kaiten"]["tokens_per_s"]
        run["c_over_b"] = k / run["hf_static16"]["tokens_per_s"]
        run["c_over_a"] = k / run["hf_single"]["tokens_per_s"]
        run["num_requests"] = len(reqs)
        results["runs"][dtype_name] = run
        del model
    results["load_avg_after"] = load_avg()
    Path(f"{out}.json").write_text(json.dumps(results, indent=2))
    Path(f"{out}.md").write_text(render(results, profile_text))
    print(render(results, profile_text))


def forward_ab(args, dtypes: list[str], counts: dict[str, int]) -> None:
    for dtype_name in dtypes:
        for eager in (True, False):
            llm = LLM(args.model, dtype=dtype_name, kv_cache_memory=args.kv_cache_memory,
                      max_num_batched_tokens=args.max_num_batched_tokens, device=args.device,
                      attention_backend=args.attention_backend, enforce_eager=eager)
            reqs = workload(counts[dtype_name], llm.engine.vocab_size)
            llm.generate([reqs[0][0][:64]], SamplingParams(temperature=0, max_tokens=4))      # warm-up
            r = run_kaiten(llm, reqs)
            print(f"{dtype_name} {'eager' if eager else 'compiled'}: {r['output_tokens'] / r['wall_s']:.1f} tok/s, "
                  f"{r['wall_s']:.1f} s, {r['steps']} steps", flush=True)
            del llm


def request_counts(spec: str, dtypes: list[str]) -> dict[str, int]:
    if "=" not in spec:
        return {d: int(spec) for d in dtypes}
    counts = {k.strip(): int(v) for k, v in (item.split("=") for item in spec.split(","))}
    missing = [d for d in dtypes if d not in counts]
    if missing:
        raise SystemExit(f"--num-requests gives no count for {', '.join(missing)}")
    return counts


def render(results: dict, profile_text: str) -> str:
    where = (f"{results['threads']} CPU threads on {results['cpu']}" if results.get("device", "cpu") == "cpu" else
             f"{results['device']}, attention {results['attention_backend']}, "
             f"CUDA graphs {'on' if results['cuda_graphs'] else 'off'}")
    lines = [f"# Engine throughput: {results['model']}, {where}, torch {results['torch']}", "",
             "Prompts uniform in 32..512 tokens, outputs uniform in 16..256 tokens (ignore_eos), greedy. "
             f"1-minute load average before/after: {results['load_avg_before']} / {results['load_avg_after']}.",
             "",
             "| dtype | requests | system | output tok/s | wall s | c/a | c/b | KV waste at peak |",
             "|---|---:|---|---:|---:|---:|---:|---:|"]
    for dtype, run in results["runs"].items():
        names = {"hf_single": "(a) HF generate, one at a time", "hf_static16": "(b) HF static batches of 16",
                 "kaiten": "(c) Kaiten"}
        for key, label in names.items():
            r = run[key]
            if key == "hf_single" and r["num_requests"] != run["num_requests"]:
                label += f" (first {r['num_requests']} requests)"
            ca = f"{run['c_over_a']:.1f}" if key == "kaiten" else ""
            cb = f"{run['c_over_b']:.1f}" if key == "kaiten" else ""
            waste = f"{100 * r['kv_waste_at_peak']:.2f}%" if key == "kaiten" else ""
            lines.append(f"| {dtype} | {run['num_requests']} | {label} | {r['tokens_per_s']:.1f} | {r['wall_s']:.1f} | {ca} | {cb} | {waste} |")
    if profile_text:
        lines += ["", "## Where a Kaiten decode step spends its time (serving dtype, 10 steps, torch.profiler)", "",
                  "```", profile_text, "```"]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
