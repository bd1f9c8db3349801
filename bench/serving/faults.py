"""Fault scenarios across hosts (issue 21): writes bench/results/faults/faults.{md,json}.

    sudo .venv/bin/python bench/serving/faults.py                      # the tiny random model (tests' model), fp32
    sudo .venv/bin/python bench/serving/faults.py --model DIR          # any model directory (fp32 greedy)

Network namespaces as hosts (tests/support/netns_hosts.py): r0..r2 (a Redis and a sentinel each; r0 the
first primary), e0 and e1 (an engine each, steps slowed to --step-s so a stream lasts long enough
to be cut), g0 and g1 (a gateway each), c (the clients). The scenarios (tests/support/fault_scenarios.py,
the same harness as tests/cluster/test_faults_netns.py), in order on one deployment, 8 concurrent greedy
streams each (4 per gateway):
1. SIGKILL the Redis primary mid-stream;
2. cut e0 off the Redis hosts for 10 s mid-stream, then heal it (then a round on both engines);
3. cut g0 off the Redis hosts mid-stream (its clients keep their link to it);
4. 50 ms delay and 1% loss between the gateways and Redis for a whole round, against the same
   round without them (tc netem where the kernel has it; else the loss alone, by iptables).
Every stream's text is compared with an uninterrupted offline run of the same prompt (greedy
fp32), so a repeated or missing token shows as a difference.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.common.machine import cpu_name  # noqa: E402
from bench.common.results_files import results_dir  # noqa: E402
from tests.support import netns_hosts  # noqa: E402
from tests.support.fault_scenarios import (PROMPTS, Deployment, Settings, impaired_gateways, kill_primary,  # noqa: E402
                                           outcome, partition_engine, partition_gateway)


def reference(model_dir: str, max_tokens: int) -> list[str]:
    from engine_worker import LLM, SamplingParams
    llm = LLM(model_dir, dtype="float32", kv_cache_memory="64MiB")
    return [c.text for c in llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))]


def row(name: str, o: dict, fault: str) -> str:
    return (f"| {name} | {o['completed']}/{o['streams']} | {o['errors']} ({', '.join(o['error_codes']) or '-'}) | "
            f"{o['unequal']} | {o['max_stall_s']:.2f} | {fault} | {o['lost']} | {o['throughput']:.1f} |")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, help="model directory (default: the tests' tiny random Llama)")
    ap.add_argument("--max-tokens", type=int, default=200)
    ap.add_argument("--step-s", type=float, default=0.02)
    ap.add_argument("--out", default=str(results_dir(__file__) / "faults"))
    args = ap.parse_args()
    why = netns_hosts.available()
    if why:
        print(f"cannot run: {why}", file=sys.stderr)
        return 2
    model = args.model
    if model is None:
        from tests.support.tiny_model import build_tiny_model
        model = str(build_tiny_model(Path(tempfile.mkdtemp(prefix="kaiten-tiny-"))))
    ref = reference(model, args.max_tokens)
    d = Deployment.start(Settings(model, max_tokens=args.max_tokens, step_s=args.step_s))
    results = {}
    try:
        results["1"] = r1 = kill_primary(d)
        results["2"] = r2 = partition_engine(d, 10.0)
        results["3"] = r3 = partition_gateway(d)
        results["4"] = r4 = impaired_gateways(d)
    finally:
        d.stop()
    g0 = {i for i in range(len(PROMPTS)) if i % 2 == 0}
    o1, o2, o2h = outcome(r1, ref), outcome(r2, ref), outcome(r2["after_heal"], ref)
    o3, o4, o4b = outcome(r3, ref, affected=g0), outcome(r4, ref), outcome(r4["baseline"], ref)
    imp = r4["impairment"]
    lines = [
        "# Faults across hosts", "",
        f"`bench/serving/faults.py`, {time.strftime('%Y-%m-%d')}, CPU: {cpu_name()}. Hosts are network namespaces; "
        f"model `{Path(model).name if args.model else 'tiny random Llama (tests/support/tiny_model.py)'}`, fp32, greedy, "
        f"{len(PROMPTS)} streams of {args.max_tokens} tokens per round, engine steps slowed to >= {args.step_s * 1000:.0f} ms, "
        "sentinel `down-after-milliseconds` 1000, gateway `failover_timeout` 2 s, `redis_grace` 10 s.", "",
        "| scenario | streams completed | client errors | texts unequal to an uninterrupted run (repeated or missing tokens) "
        "| longest pause after the fault, s (unaffected streams) | fault facts | requests lost | tok/s |",
        "|---|---:|---:|---:|---:|---|---:|---:|",
        row("1. SIGKILL the primary", o1, f"{r1['killed']} -> {r1['promoted']} promoted in {r1['promoted_after_s']} s; "
            f"a new request answered {r1['new_request_answered_after_s']} s after the kill"),
        row("2. engine host cut off 10 s", o2, "streams moved to the other engine"),
        row("2. after the heal (both engines)", o2h, "-"),
        row("3. gateway host g0 cut off", o3, "g0's 4 streams ended with an error, as they should"),
        row("4. baseline round", o4b, "-"),
        row(f"4. {imp['delay_ms']} ms + {imp['loss_pct']}% loss ({imp['by']})", o4,
            f"throughput {o4['throughput'] / max(o4b['throughput'], 1e-9):.2f}x the baseline"),
        "",
    ]
    if imp["by"] != "netem":
        lines += ["This kernel has no `sch_netem`: scenario 4 applied the 1% loss (iptables statistic DROP, both "
                  "ways) but no delay.", ""]
    lines += [f"Engines after the heal (scenario 2): `{json.dumps(r2['engines_after_heal'])}`", "",
              f"Engines' counters after scenario 3: `{json.dumps(r3['engines'])}`", ""]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out + ".md").write_text("\n".join(lines))
    Path(args.out + ".json").write_text(json.dumps({k: {kk: vv for kk, vv in v.items()} for k, v in results.items()},
                                                   indent=1, default=str))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
