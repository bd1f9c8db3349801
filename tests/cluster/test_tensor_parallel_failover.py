"""A tensor-parallel engine (--tensor-parallel-size 2: the engine and a second rank process) whose
second rank is SIGKILLed mid-stream: the engine stops at once (its heartbeat with it, no rank left
behind), and every stream it held completes on the other engine with the text of an uninterrupted
run."""
from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from engine_worker.model.tp_ranks import EXIT_RANK_DIED
from kernels.cpu_ops_build import cpu_ops_available
from tests.support.engine_cluster import (N_TOKENS, PROMPTS, check_sequences, check_streams, streams_under_way,
                                          two_engines_and_a_gateway, wait_engines)

pytestmark = [pytest.mark.timeout(900),
              pytest.mark.skipif(not cpu_ops_available(), reason="the C++ CPU extension does not build here")]

TP_ARGS = ("--tensor-parallel-size", "2", "--cpu-binding", "none", "--enforce-eager")


@pytest.fixture(scope="module")
def tp_reference(tiny_model_dir):
    """The uninterrupted greedy texts of a 2-rank engine."""
    from engine_worker import LLM, SamplingParams
    llm = LLM(str(tiny_model_dir), dtype="float32", kv_cache_memory="8MiB", enforce_eager=True,
              tensor_parallel_size=2, cpu_binding="none")
    texts = [c.text for c in llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=N_TOKENS,
                                                                  ignore_eos=True))]
    llm.engine.runner.close()
    return texts


def children(pid: int) -> list[int]:
    return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def test_sigkill_of_a_rank_fails_its_streams_over(tiny_model_dir, tmp_path, tp_reference):
    with two_engines_and_a_gateway(tiny_model_dir, tmp_path, engine_args=TP_ARGS) as st:
        wait_engines(st, ["eng-a", "eng-b"], timeout=240)
        clients, out, placed = streams_under_way(st, PROMPTS, 600)
        victim = placed.most_common(1)[0][0]
        engine = st.procs[victim]
        (rank1,) = children(engine.pid)
        os.kill(rank1, signal.SIGKILL)
        t_kill = time.monotonic()
        assert engine.wait(30) == EXIT_RANK_DIED
        print(f"\nrank 1 SIGKILLed -> engine exited in {time.monotonic() - t_kill:.2f} s")
        assert "tensor-parallel rank 1" in st.log(victim)
        clients.join(180)
        assert not clients.is_alive()
        check_streams(st, out["results"], tp_reference)
        moved = check_sequences(st, N_TOKENS)
        assert moved == {rid for rid, e in st.tap.engine_of().items() if e == victim}
        assert len(moved) == placed[victim] > 0
