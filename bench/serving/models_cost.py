"""The gateway's per-request cost serving 1 model against serving 10 (issue 24: nothing per request
may grow with the number of models). One process, the same tiny tokenizer for every model; each
model has two live engines (heartbeats with block lists) in the gateway's engine monitor, as a poll
leaves them. A request is timed from its body's bytes through what the gateway does before the
XADD: the "model" resolved to its ServedModel, the completion parsed (validation, tokenization),
admission (the model's load and queue limits) and placement (prefix hashes against the model's
engines). Requests name the first model, the last, or an adapter of the last model.

    python bench/serving/models_cost.py [--rounds 7] [--runs 2000] [--out bench/results/models_cost/models_cost.md]

Rounds alternate which gateway goes first; the report gives medians over all samples (µs per
request), the 10-model/1-model ratio, the CPU's name and flags and the load average before and after.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.common.machine import cpu_flags, cpu_name, load_avg  # noqa: E402

ENGINES_PER_MODEL = 2
BLOCK = 16
PROMPT = "The quick brown fox jumps over the lazy dog. " * 6


def build_models(root: Path, n: int) -> list[str]:
    """n model directories sharing one tiny tokenizer (the gateway reads no weights)."""
    from tests.support.tiny_model import build_tokenizer
    tok = build_tokenizer()
    dirs = []
    for i in range(n):
        d = root / f"model-{i}"
        d.mkdir()
        tok.save_pretrained(d)
        (d / "config.json").write_text(json.dumps({"max_position_embeddings": 2048, "vocab_size": len(tok)}))
        dirs.append(str(d))
    return dirs


def gateway_for(dirs: list[str]):
    """A Gateway serving `dirs`, its monitor holding ENGINES_PER_MODEL live engines per model."""
    from gateway.backend.engines import EngineInfo, EngineMonitor
    from gateway.backend.placement import Placer
    from gateway.backend.router import ReplyRouter
    from gateway.core import Gateway
    from shared.block_hash import prefix_block_hashes
    from shared.config import GatewayConfig
    gw = Gateway(GatewayConfig(model=dirs[0], extra_models=tuple(dirs[1:])))
    mon = gw.monitor = EngineMonitor(client=None, engine_timeout=10.0)
    now = time.monotonic()
    held = frozenset(prefix_block_hashes(list(range(3, 3 + 64)), BLOCK))
    for model in gw.models.models.values():
        for k in range(ENGINES_PER_MODEL):
            eid = f"{model.name}-{k}"
            hb = {"model": model.name, "block_size": BLOCK, "num_running": k, "num_waiting": 0, "num_waiting_tokens": 0,
                  "accepting": True, "heartbeat_interval": 0.5, "instance": eid, "blocks_version": 1,
                  "max_model_len": 2048, "vocab_size": 384, "adapters": {"ad-" + model.name: "/x"}}
            mon.engines[eid] = EngineInfo(eid, hb, last_alive=now + 3600, blocks=held, blocks_version=(eid, 1),
                                          blocks_seen=now + 3600)
    mon.views = mon._group(now)
    for view in mon.views.values():
        from gateway.backend.engines import load_of
        view.load = load_of(view.live, 0)
    gw.models.refresh(mon)
    gw.placer = Placer(mon, liveness_timeout=7200.0)
    gw.router = ReplyRouter(None, gw.gateway_id, mon, 10.0)
    return gw


def request_fn(gw, model: str):
    from gateway.api.openai_api import parse_completion
    body = json.dumps({"model": model, "prompt": PROMPT, "max_tokens": 16, "temperature": 0}).encode()
    loop = asyncio.new_event_loop()

    async def one():
        parsed = await parse_completion(body, gw.resolve)
        gw.admit(parsed)
        m = parsed.ctx.served
        d = gw.placer.place(parsed.prompts[0], m.view.engines, m.stream, parsed.ctx.lora_name)
        assert d.stream
        gw.placer._sent.clear()           # no optimistic load piles up across runs
    return lambda: loop.run_until_complete(one())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--runs", type=int, default=2000)
    ap.add_argument("--out", default=str(ROOT / "bench/results/models_cost/models_cost.md"))
    args = ap.parse_args(argv)
    load_before = load_avg()
    with tempfile.TemporaryDirectory() as tmp:
        dirs = build_models(Path(tmp), 10)
        gws = {1: gateway_for(dirs[:1]), 10: gateway_for(dirs)}
        last = {1: "model-0", 10: "model-9"}
        cases = {(n, what): request_fn(gws[n], name) for n in gws
                 for what, name in (("first model", "model-0"), ("last model", last[n]),
                                    ("adapter of the last", "ad-" + last[n]))}
        for fn in cases.values():        # warm up
            for _ in range(50):
                fn()
        samples: dict[tuple, list[float]] = {k: [] for k in cases}
        for r in range(args.rounds):
            order = sorted(cases, key=lambda k: (k[0] if r % 2 == 0 else -k[0], k[1]))
            for key in order:
                fn = cases[key]
                for _ in range(args.runs):
                    t0 = time.perf_counter()
                    fn()
                    samples[key].append((time.perf_counter() - t0) * 1e6)
    load_after = load_avg()
    med = {k: statistics.median(v) for k, v in samples.items()}
    cmd = "python bench/serving/models_cost.py " + " ".join(argv if argv is not None else sys.argv[1:])
    lines = ["# Gateway per-request cost: 1 model vs 10", "",
             f"`{cmd.strip()}`: {args.rounds} interleaved rounds x {args.runs} requests per case, median µs per "
             f"request (resolve + parse + admit + place; {ENGINES_PER_MODEL} live engines per model).", "",
             f"CPU: {cpu_name()}; flags: {' '.join(f for f in cpu_flags() if f.startswith(('avx', 'amx')))}; "
             f"load average {load_before} before, {load_after} after.", "",
             "| request names | 1 model (µs) | 10 models (µs) | 10 / 1 |", "|---|---:|---:|---:|"]
    for what in ("first model", "last model", "adapter of the last"):
        a, b = med[(1, what)], med[(10, what)]
        lines.append(f"| {what} | {a:.1f} | {b:.1f} | {b / a:.3f} |")
    text = "\n".join(lines) + "\n"
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text)
    Path(args.out).with_suffix(".json").write_text(json.dumps(
        {"command": cmd.strip(), "cpu": cpu_name(), "load_before": load_before, "load_after": load_after,
         "median_us": {f"{n}:{what}": v for (n, what), v in med.items()}}, indent=2))
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
