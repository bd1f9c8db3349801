"""Decode steps with the weights on huge pages (as the engine keeps them: host_memory.onto_huge_pages)
against the same weights on 4 KiB pages, in one process: after the engine is built, the weights are
moved again (host_memory.into_one_mapping) into a mapping advised MADV_NOHUGEPAGE, and the rounds
swap the model's tensors between the two sets (same shapes, strides and bytes, so the compiled
forward runs both), timing --steps decode steps of --batch requests each, the order reversed every
round.

    .venv/bin/python bench/weights/weight_pages.py [--model GGUF] [--batch 1,32] [--rounds 20] [--steps 5]
        [--dtype auto] [--threads 0] [--out NAME]

Writes bench/results/weight_pages/<NAME>.md (default weight_pages).
"""
from __future__ import annotations

import argparse
import mmap
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.common.machine import cpu_flags, cpu_name, load_avg  # noqa: E402
from bench.common.results_files import results_dir  # noqa: E402
from bench.common.timing import interleaved, step_ms  # noqa: E402
from bench.engine.engine_throughput import start_decoding  # noqa: E402
from engine_worker import LLM  # noqa: E402
from engine_worker.model.host_memory import into_one_mapping, movable_weights  # noqa: E402
from kernels.cpu_ops_build import cpu_capability  # noqa: E402

RESULTS = results_dir(__file__)


def weight_set(model: torch.nn.Module) -> list[tuple[dict, str, torch.Tensor]]:
    """(the dict that holds it, its name, the tensor) for each of the model's movable weights."""
    return [(tensors, name, tensors[name]) for refs in movable_weights(model).values() for tensors, name in refs]


def use(weights) -> None:
    for tensors, name, t in weights:
        tensors[name] = t


def measure(llm: LLM, sets: dict, batch: int, rounds: int, steps: int) -> dict[str, list[float]]:
    ids = start_decoding(llm, batch, rounds * 2 * (steps + 1) + 20)
    for weights in sets.values():       # warm-up
        use(weights)
        for _ in range(3):
            llm.step()
    def timed(name: str) -> float:
        use(sets[name])
        return step_ms(llm, steps)
    times = interleaved(sets, rounds, timed)
    for request_id in ids:
        llm.engine.abort_request(request_id)
    while llm.engine.has_unfinished():
        llm.step()
    return times


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="", help="a GGUF file or a model folder (default: the default model)")
    ap.add_argument("--batch", default="1,32")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--out", default="weight_pages")
    args = ap.parse_args()
    from shared.gguf_convert import ensure_converted_gguf, ensure_default_model
    load0 = load_avg()
    model = ensure_converted_gguf(args.model) if args.model.endswith(".gguf") else args.model or ensure_default_model()
    llm = LLM(str(model), max_num_seqs=64, kv_cache_memory="512MiB", dtype=args.dtype, num_threads=args.threads)
    huge = weight_set(llm.engine.runner.model)
    if min(t.data_ptr() for *_, t in huge) % (2 << 20):
        raise SystemExit("the engine's weights are not on a 2 MiB-aligned mapping: nothing to compare")
    into_one_mapping(llm.engine.runner.model, mmap.MADV_NOHUGEPAGE)    # the huge set stays alive in `huge`
    sets = {"huge pages": huge, "4 KiB pages": weight_set(llm.engine.runner.model)}
    lines = [f"# Decode steps, weights on huge pages against 4 KiB pages, {Path(str(model)).name}, "
             f"{llm.engine.runner.dtype}\n",
             f"CPU: {cpu_name()} ({' '.join(cpu_flags())}), {torch.get_num_threads()} threads, extension ISA "
             f"{cpu_capability()[0]}, torch {torch.__version__}; load {load0} before. {len(huge)} tensors, "
             f"{sum(t.nbytes for *_, t in huge) / 2**20:.1f} MiB. Context 256; ms a step, the median over "
             f"{args.rounds} rounds of {args.steps} steps each, the two alternating in one process.\n",
             "| batch | huge pages | 4 KiB pages | ratio (median of the rounds') | rounds faster on huge pages |",
             "|---:|---:|---:|---:|---:|"]
    for batch in (int(b) for b in args.batch.split(",")):
        t = measure(llm, sets, batch, args.rounds, args.steps)
        ratios = [h / s for h, s in zip(t["huge pages"], t["4 KiB pages"])]
        lines.append(f"| {batch} | {statistics.median(t['huge pages']):.2f} | {statistics.median(t['4 KiB pages']):.2f} "
                     f"| {statistics.median(ratios):.3f} | {sum(r < 1 for r in ratios)} of {len(ratios)} |")
        print(lines[-1], flush=True)
    use(huge)
    text = "\n".join(lines) + "\n"
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{args.out}.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
