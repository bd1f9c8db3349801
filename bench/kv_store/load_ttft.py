"""TTFT of a prompt already in the shared KV store, on an engine that never saw it, against computing
it: three engines in this process on one local redis-server. Each round takes a new random prompt
of --prompt tokens; the writer engine computes it (and writes its chunks), the reader engine loads
it, and an engine without a store computes it. TTFT: from add_request to the step that returns the
first token (max_tokens 1). Medians over --rounds, after one warm-up round.

    .venv/bin/python bench/kv_store/load_ttft.py [--model DIR] [--prompt 2048] [--rounds 5] [--eager]
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.common.machine import cpu_flags, cpu_id, cpu_name, load_avg  # noqa: E402
from bench.common.results_files import results_dir, write_results  # noqa: E402

RESULTS = results_dir("kv_store")


def make_engine(model: str, url: str, eager: bool):
    from engine_worker.engine.llm_engine import LLMEngine
    from engine_worker.kv_store.redis_store import attach_kv_store
    from shared.config import EngineConfig
    engine = LLMEngine(EngineConfig(model=model, kv_cache_memory="512MiB", enforce_eager=eager, kv_store_url=url))
    attach_kv_store(engine)
    return engine


def ttft(engine, prompt: list[int], rid: str) -> tuple[float, int]:
    """Seconds to the first token, and the prompt tokens the engine did not compute."""
    from engine_worker.engine.sampling_params import SamplingParams
    t0 = time.perf_counter()
    engine.add_request(rid, prompt, SamplingParams(temperature=0.0, max_tokens=1))
    while True:
        for out in engine.step():
            if out.new_token_ids:
                dt = time.perf_counter() - t0
                while engine.has_unfinished():
                    engine.step()
                return dt, out.num_cached_tokens


def wait_written(engine, timeout: float = 30.0) -> None:
    """Until the writer's queued chunks are in the store."""
    store = engine.kv.connector
    deadline = time.monotonic() + timeout
    while not store._saves.empty() and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="", help="a model directory (default: the default SmolLM2)")
    ap.add_argument("--prompt", type=int, default=2048)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--eager", action="store_true", help="the eager forward (no torch.compile)")
    ap.add_argument("--out", default=str(RESULTS / "load_ttft"))
    args = ap.parse_args()
    os.environ.setdefault("KAITEN_TEST_REDIS", "process")
    from shared.model_source import resolve_model
    from tests.support.redis_server import RedisServer
    model = str(resolve_model(args.model))
    server = RedisServer().start()
    try:
        writer, reader = make_engine(model, server.url, args.eager), make_engine(model, server.url, args.eager)
        alone = make_engine(model, "", args.eager)
        rng = random.Random(0)
        rows = []
        load_before = load_avg()
        for r in range(args.rounds + 1):
            prompt = [rng.randrange(100, writer.vocab_size - 100) for _ in range(args.prompt)]
            written, _ = ttft(writer, prompt, f"w{r}")
            wait_written(writer)
            loaded, cached = ttft(reader, prompt, f"r{r}")
            computed, _ = ttft(alone, prompt, f"a{r}")
            if r:
                rows.append({"computed_s": computed, "computed_with_store_miss_s": written, "loaded_s": loaded,
                             "loaded_tokens": cached})
        st = reader.stats()
        meta = {"cpu": cpu_name(), "cpu_id": cpu_id(), "flags": cpu_flags(), "load_before": load_before,
                "load_after": load_avg(), "model": Path(model).name, "prompt": args.prompt, "rounds": args.rounds,
                "eager": args.eager, "chunk_blocks": reader.kv.layout.chunk_blocks,
                "chunk_kib": reader.kv.layout.chunk_blocks * reader.kv.layout.block_bytes // 1024,
                "kv_dtype": reader.kv.layout.kv_dtype, "reader_bytes_loaded": st.kv_store_bytes_loaded}
    finally:
        server.stop()
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    report = {"meta": meta, "rows": rows, "median": med}
    md = [f"CPU: {meta['cpu']} ({meta['cpu_id']}; {', '.join(meta['flags'])}), load {meta['load_before']} -> "
          f"{meta['load_after']}. {meta['model']}, KV {meta['kv_dtype']}, a {args.prompt}-token prompt, chunks of "
          f"{meta['chunk_blocks']} block(s) ({meta['chunk_kib']} KiB), {'eager' if args.eager else 'compiled'} "
          f"forward; median of {args.rounds} rounds.", "",
          "| TTFT | seconds | vs computed |", "|---|---:|---:|",
          f"| computed (no store) | {med['computed_s']:.3f} | 1.00 |",
          f"| computed, store missed (the writer) | {med['computed_with_store_miss_s']:.3f} | "
          f"{med['computed_with_store_miss_s'] / med['computed_s']:.2f} |",
          f"| loaded from the store ({int(med['loaded_tokens'])} tokens) | {med['loaded_s']:.3f} | "
          f"{med['loaded_s'] / med['computed_s']:.2f} |"]
    write_results(args.out, report, "\n".join(md))


if __name__ == "__main__":
    main()
