"""Two models served at once (issue 24): each model's served throughput together against alone.

Goal: each model's served output tok/s with both models loaded >= 0.9x what it gets alone on half
the cores. One private Redis, one gateway serving two models (A and B: two served names; by default
both the default SmolLM2, the only real model on this machine, see --model-b) and one engine per
model, started once: engine A pinned to core 0 and engine B to core 1 (`taskset -c`, one torch
thread each: `--num-threads 1`); Redis, the gateway and this client are not pinned. Phases: A alone
(only A's clients send; B's engine idles on its own core), B alone, both at once. Each model's load
is the same closed loop through the streaming /v1/completions API: --concurrency streams, each
sending --requests requests one after another, --prompt-len random token ids, --max-tokens output
tokens, ignore_eos, greedy. A model's throughput is its output tokens / (its last completion - the
phase's start). Rounds rotate the order of the three phases; the report gives per-round numbers,
medians and the together/alone ratios, the CPU's name and flags and the load average before and
after every phase (the machine is shared: the load of other jobs is in those numbers).

    .venv/bin/python bench/serving/two_models.py                        # SmolLM2 twice: bench/results/two_models/two_models.{md,json}
    .venv/bin/python bench/serving/two_models.py --quick                # the tiny random model: checks the bench
    .venv/bin/python bench/serving/two_models.py --model-b DIR          # a second real model
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.common.machine import cpu_flags, cpu_name, load_avg  # noqa: E402
from bench.common.results_files import results_dir  # noqa: E402
from bench.common.workload import workload  # noqa: E402
from bench.serving.failover import Stack  # noqa: E402
from bench.serving.serve import model_facts, send_one  # noqa: E402

RESULTS = results_dir(__file__)
NAMES = ("model-a", "model-b")
PHASES = {"A alone": (NAMES[0],), "B alone": (NAMES[1],), "together": NAMES}
ENGINES = {NAMES[0]: "eng-a", NAMES[1]: "eng-b"}


async def closed_loop(client, model: str, prompts: list[list[int]], args, start: float) -> tuple[int, float, list[str]]:
    """--concurrency streams, each sending its share of `prompts` one after another:
    (output tokens, seconds from `start` to the last completion, errors)."""
    tokens, errors, last = 0, [], start

    async def stream(mine: list[list[int]]) -> None:
        nonlocal tokens, last
        for p in mine:
            r = await send_one(client, model, 0, p, args.max_tokens, 0.0)
            if r.error:
                errors.append(r.error)
                continue
            tokens += r.output_tokens
            last = max(last, time.perf_counter())
    c = args.concurrency
    await asyncio.gather(*(stream(prompts[i::c]) for i in range(c)))
    return tokens, last - start, errors


async def phase(url: str, models: tuple[str, ...], prompts: dict[str, list[list[int]]], args) -> dict[str, dict]:
    import httpx
    async with httpx.AsyncClient(base_url=url, trust_env=False, timeout=httpx.Timeout(args.timeout, connect=10),
                                 limits=httpx.Limits(max_connections=None, max_keepalive_connections=None)) as c:
        start = time.perf_counter()
        outs = await asyncio.gather(*(closed_loop(c, m, prompts[m], args, start) for m in models))
    return {m: {"tokens": t, "wall_s": round(w, 3), "tok_per_s": round(t / w, 2) if w > 0 else 0.0,
                "errors": len(e), "error_example": e[0] if e else ""} for m, (t, w, e) in zip(models, outs)}


def prompt_sets(vocab: int, args, seed: int) -> dict[str, list[list[int]]]:
    """Each model its own random prompts of one length (no prefix-cache hit across requests)."""
    n = args.concurrency * args.requests
    lens = (args.prompt_len, args.prompt_len)
    return {m: [p for p, _ in workload(n, vocab, seed * 10 + k, prompt_lens=lens)] for k, m in enumerate(NAMES)}


def make_stack(args, workdir: Path) -> Stack:
    """Engines of one torch thread; the gateway serves model A (--model) and B (a models file)."""
    workdir.mkdir()
    models_file = workdir / "models.json"
    models_file.write_text(json.dumps({"models": [{"model": args.model_b, "served_model_name": NAMES[1]}]}))
    return Stack(args.model_a, 1, 0.0, args.dtype, workdir=workdir,
                 engine_flags=["--max-num-seqs", str(args.max_num_seqs), "--kv-cache-memory", args.kv_cache_memory,
                               "--metrics-port", "0"],
                 gateway_flags=["--served-model-name", NAMES[0], "--models-file", str(models_file)])


def start(stack: Stack, args) -> None:
    """Redis, engine A on its core, engine B on its core, the gateway; until both engines serve."""
    import redis
    from bench.serving.failover import wait_heartbeat
    stack.start_redis()
    stack.start_engine("eng-a", ("--served-model-name", NAMES[0]), cpus=args.cores[0])
    stack.start_engine("eng-b", ("--model", args.model_b, "--served-model-name", NAMES[1]), cpus=args.cores[1])
    stack.start_gateway()
    r = redis.Redis.from_url(stack.redis_url)
    for e in ("eng-a", "eng-b"):
        wait_heartbeat(stack, r, e, args.start_timeout)
    stack.wait_ready(2, args.start_timeout)


def affinity(stack: Stack) -> dict[str, list[int]]:
    """The cores each engine process may run on, as the kernel has it (the pinning took)."""
    return {e: sorted(os.sched_getaffinity(p.pid)) for e, p in stack.engines.items()}


def cpu_seconds(stack: Stack) -> dict[str, float]:
    """CPU seconds (user + system) each engine, the gateway and this client have used so far."""
    def of(pid: int) -> float:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    t = os.times()
    return {**{e: of(p.pid) for e, p in stack.engines.items()}, "gateway": of(stack.gateway.pid),
            "client": t.user + t.system}


def hold_core(core: str) -> subprocess.Popen:
    """A busy loop pinned to `core`: stands in for the other model's busy engine, so that other jobs on
    the machine find both cores taken in an alone phase too (--hold-other-core)."""
    return subprocess.Popen(["taskset", "-c", core, sys.executable, "-c", "while True: pass"])


def measure(stack: Stack, models: tuple[str, ...], prompts: dict[str, list[list[int]]], args) -> dict:
    """One phase: each model's throughput, and the CPU time every process used meanwhile (an engine's
    tokens per CPU second tells a smaller share of the core from more work per token)."""
    idle = [args.cores[NAMES.index(m)] for m in NAMES if m not in models]
    holders = [hold_core(c) for c in idle] if args.hold_other_core else []
    load, cpu, t0 = load_avg(), cpu_seconds(stack), time.perf_counter()
    try:
        out = asyncio.run(phase(stack.url, models, prompts, args))
    finally:
        for h in holders:
            h.kill()
            h.wait()
    wall, used = time.perf_counter() - t0, cpu_seconds(stack)
    cpu = {k: round(used[k] - cpu[k], 2) for k in used}
    for m in models:
        e = ENGINES[m]
        out[m] |= {"engine_cpu_s": cpu[e], "engine_cpu_share": round(cpu[e] / out[m]["wall_s"], 3),
                   "tok_per_engine_cpu_s": round(out[m]["tokens"] / cpu[e], 1) if cpu[e] else None}
    return {"models": out, "cpu_s": cpu, "wall_s": round(wall, 2), "load": (load, load_avg())}


def summarize(rounds: list[dict]) -> dict:
    med = {}
    for ph, models in PHASES.items():
        for m in models:
            med[f"{ph}:{m}"] = statistics.median(r["phases"][ph][m]["tok_per_s"] for r in rounds)
    ratios = {m: med[f"together:{m}"] / med[f"{ph}:{m}"] for ph, m in (("A alone", NAMES[0]), ("B alone", NAMES[1]))}
    per_round = {m: [r["phases"]["together"][m]["tok_per_s"] / r["phases"][ph][m]["tok_per_s"] for r in rounds]
                 for ph, m in (("A alone", NAMES[0]), ("B alone", NAMES[1]))}
    eff = {f"{ph}:{m}:{k}": statistics.median(r["phases"][ph][m][k] for r in rounds)
           for ph, models in PHASES.items() for m in models for k in ("engine_cpu_share", "tok_per_engine_cpu_s")}
    return {"median_tok_per_s": med, "ratio_of_medians": ratios, "median_engine_cpu": eff,
            "median_of_round_ratios": {m: statistics.median(v) for m, v in per_round.items()},
            "round_ratios": per_round, "goal_met": all(v >= 0.9 for v in ratios.values())}


def core_share(rep: dict, ph: str, proc: str) -> float:
    """Median over rounds of `proc`'s CPU seconds in phase `ph` / the phase's (mean per model) wall seconds."""
    return statistics.median(r["cpu_s"][ph][proc] / statistics.mean(x["wall_s"] for x in r["phases"][ph].values())
                             for r in rep["rounds"])


def render(rep: dict) -> str:
    a = rep["args"]
    s = rep["summary"]
    loads = [x for r in rep["rounds"] for ph in r["load"].values() for x in ph]
    lines = ["# Two models served at once: each model's throughput together vs alone", "",
             f"`{rep['command']}`, {rep['date']}. CPU: {rep['cpu']} ({rep['cores']} cores; {rep['flags']}).", "",
             f"Models: {NAMES[0]} = {rep['model_a']}, {NAMES[1]} = {rep['model_b']}"
             + (" (the same weights under a second served name: no second real model on this machine)"
                if rep["same_model"] else "") + f"; dtype {a['dtype']}. One Redis, one gateway serving both, one "
             f"engine per model, `--num-threads 1`, pinned with `taskset -c` (affinity as the kernel reports it: "
             f"{rep['affinity']}); Redis, gateway and client unpinned. Load per model: closed loop, "
             f"{a['concurrency']} streams x {a['requests']} requests, {a['prompt_len']} prompt tokens (random ids), "
             f"{a['max_tokens']} output tokens (ignore_eos, greedy), streaming /v1/completions. "
             f"{len(rep['rounds'])} rounds, the phase order rotating."
             + (" Alone phases with `--hold-other-core`: a busy loop pinned to the idle engine's core (so the "
                "machine's other jobs find both cores taken, as when both models run)." if a.get("hold_other_core")
                else ""), "",
             f"Load average (1 min) before the run {rep['load_avg_before']}, after {rep['load_avg_after']}; over the "
             f"phases {min(loads):.1f} to {max(loads):.1f} (2 cores).", ""]
    if max(loads) > 4:
        lines += [f"**The machine was heavily loaded by other jobs** (load average up to {max(loads):.1f} on 2 "
                  "cores): every number below is a share of contended cores, and the together/alone ratio "
                  "compares phases that ran under whatever load the other jobs had at that moment.", ""]
    lines += ["| round | order | A alone tok/s | B alone tok/s | together A | together B | A ratio | B ratio | "
              "load avg per phase |", "|---:|---|---:|---:|---:|---:|---:|---:|---|"]
    for i, r in enumerate(rep["rounds"]):
        p = r["phases"]
        aa, bb = p["A alone"][NAMES[0]]["tok_per_s"], p["B alone"][NAMES[1]]["tok_per_s"]
        ta, tb = p["together"][NAMES[0]]["tok_per_s"], p["together"][NAMES[1]]["tok_per_s"]
        lines.append(f"| {i + 1} | {' / '.join(r['order'])} | {aa:.1f} | {bb:.1f} | {ta:.1f} | {tb:.1f} | "
                     f"{ta / aa:.2f} | {tb / bb:.2f} | "
                     + ", ".join(f"{ph}: {v[0]}->{v[1]}" for ph, v in r["load"].items()) + " |")
    m = s["median_tok_per_s"]
    lines += ["", "| model | alone (median tok/s) | together (median tok/s) | together / alone | median of round ratios |",
              "|---|---:|---:|---:|---:|"]
    for ph, name in (("A alone", NAMES[0]), ("B alone", NAMES[1])):
        lines.append(f"| {name} | {m[f'{ph}:{name}']:.1f} | {m[f'together:{name}']:.1f} | "
                     f"**{s['ratio_of_medians'][name]:.2f}** | {s['median_of_round_ratios'][name]:.2f} |")
    e = s["median_engine_cpu"]
    lines += ["", "Where the difference goes: each engine's CPU time (user + system, /proc) over the phase, medians "
              "over rounds. Share: CPU seconds / the model's wall seconds (1.0 = a whole core); tokens per CPU "
              "second: the engine's work per token (equal alone and together: the engine did the same work and "
              "got less of its core).", "",
              "| model | core share alone | together | tok per engine CPU s alone | together |",
              "|---|---:|---:|---:|---:|"]
    for ph, name in (("A alone", NAMES[0]), ("B alone", NAMES[1])):
        lines.append(f"| {name} | {e[f'{ph}:{name}:engine_cpu_share']:.2f} | {e[f'together:{name}:engine_cpu_share']:.2f} "
                     f"| {e[f'{ph}:{name}:tok_per_engine_cpu_s']:.1f} | {e[f'together:{name}:tok_per_engine_cpu_s']:.1f} |")
    lines += ["", "Gateway / client core share per phase (median): " + ", ".join(
        f"{ph} {core_share(rep, ph, 'gateway'):.2f} / {core_share(rep, ph, 'client'):.2f}" for ph in PHASES) + "."]
    errors = sum(x["errors"] for r in rep["rounds"] for ph in r["phases"].values() for x in ph.values())
    lines += ["", f"Goal (each >= 0.9x alone): **{'met' if s['goal_met'] else 'not met'}**. Errors: {errors}."]
    return "\n".join(lines) + "\n"


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-a", default="", help="model A's directory (default: the default SmolLM2)")
    ap.add_argument("--model-b", default="", help="model B's directory (default: model A's)")
    ap.add_argument("--quick", action="store_true", help="the tiny random model, short phases: checks the bench")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--concurrency", type=int, default=8, help="streams per model")
    ap.add_argument("--requests", type=int, default=3, help="requests per stream per phase")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--cores", default="0,1", help="engine A's and engine B's core (taskset -c)")
    ap.add_argument("--hold-other-core", action="store_true",
                    help="in an alone phase, a busy loop holds the idle engine's core (other jobs then find both "
                         "cores taken, as in the together phase)")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--kv-cache-memory", default="512MiB")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    ap.add_argument("--start-timeout", type=float, default=600.0)
    ap.add_argument("--out", default="", help="results path without suffix (default bench/results/two_models/two_models)")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.cores = args.cores.split(",")
    if len(args.cores) != 2:
        raise SystemExit("--cores takes two cores, e.g. 0,1")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    tmp = Path(tempfile.mkdtemp(prefix="kaiten-bench-two-models-"))
    if args.quick and not args.model_a:
        from tests.support.tiny_model import build_tiny_model
        args.model_a = str(build_tiny_model(tmp / "tiny"))
        args.requests, args.max_tokens, args.prompt_len = min(args.requests, 2), min(args.max_tokens, 16), 16
    elif not args.model_a:
        from shared.model_source import resolve_model
        args.model_a = str(resolve_model(""))
    args.model_b = args.model_b or args.model_a
    vocab = min(model_facts(args.model_a)[0], model_facts(args.model_b)[0])
    out = Path(args.out or RESULTS / ("two_models.quick" if args.quick else "two_models"))
    cmd = "python bench/serving/two_models.py " + " ".join(sys.argv[1:] if argv is None else argv)
    rep = {"command": cmd.strip(), "date": time.strftime("%Y-%m-%d %H:%M"), "cpu": cpu_name(),
           "flags": " ".join(cpu_flags()), "cores": os.cpu_count(), "model_a": Path(args.model_a).name,
           "model_b": Path(args.model_b).name, "same_model": Path(args.model_a).resolve() == Path(args.model_b).resolve(),
           "load_avg_before": load_avg(), "args": vars(args), "rounds": []}
    stack = make_stack(args, tmp / "stack")
    print(f"logs in {stack.workdir}", flush=True)
    try:
        start(stack, args)
        rep["affinity"] = affinity(stack)
        asyncio.run(phase(stack.url, NAMES, prompt_sets(vocab, args, 999), args))      # warm-up, both models
        order = list(PHASES)
        for i in range(args.rounds):
            rnd = {"order": order[i % 3:] + order[:i % 3], "phases": {}, "load": {}, "cpu_s": {}}
            for ph in rnd["order"]:
                m = measure(stack, PHASES[ph], prompt_sets(vocab, args, i * 3 + len(rnd["phases"])), args)
                rnd["phases"][ph], rnd["load"][ph], rnd["cpu_s"][ph] = m["models"], m["load"], m["cpu_s"]
                print(f"round {i + 1} {ph}: {m}", flush=True)
            rep["rounds"].append(rnd)
    finally:
        stack.stop()
        rep["load_avg_after"] = load_avg()
        if rep["rounds"]:
            rep["summary"] = summarize(rep["rounds"])
            out.parent.mkdir(parents=True, exist_ok=True)
            Path(f"{out}.json").write_text(json.dumps(rep, indent=1, default=str))
            Path(f"{out}.md").write_text(render(rep))
            print(render(rep))
        shutil.rmtree(tmp / "tiny", ignore_errors=True)
    return 0 if rep["rounds"] and not any(x["errors"] for r in rep["rounds"] for p in r["phases"].values()
                                          for x in p.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
