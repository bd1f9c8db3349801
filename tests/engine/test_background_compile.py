"""A server engine on the CPU is ready before its model is compiled: it serves the eager model while
a child process compiles, then switches to the compiled forward at a step boundary, with the same
greedy tokens as Hugging Face's before, across and after the switch; a failed compile keeps it
serving eagerly (engine_worker/model/background_compile.py)."""
from __future__ import annotations

import os
import signal
import statistics
import time

import pytest

from engine_worker.engine.llm_engine import LLMEngine
from engine_worker.model.background_compile import compiled_marker
from tests.support.engine_support import engine_config
from tests.support.llm_support import greedy

COMPILE_TIMEOUT_S = 1500        # a cold compile of the tiny model in a low-priority child, on a loaded 2-core machine
pytestmark = pytest.mark.timeout(2 * COMPILE_TIMEOUT_S)


@pytest.fixture(scope="module")
def module_caches(tmp_path_factory):
    """An Inductor cache empty at the module's start: the first test compiles into it, the warm
    test finds it."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path_factory.mktemp("inductor")))
        yield


@pytest.fixture
def fresh_caches(tmp_path, monkeypatch):
    """An empty Inductor cache of the test's own."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))


def server_engine(model_dir) -> LLMEngine:
    return LLMEngine(engine_config(model_dir, enforce_eager=False, kv_cache_memory="8MiB"))


class Traffic:
    """Keeps the engine busy with the test prompts, one new request whenever one finishes, and
    checks every finished request against its Hugging Face tokens."""

    def __init__(self, engine: LLMEngine, prompts, expected, width: int = 4):
        self.engine, self.prompts, self.expected = engine, prompts, expected
        self.next, self.tokens, self.prompt_of = 0, {}, {}
        self.finished = 0
        self.step_seconds: list[tuple[float, str]] = []    # (seconds, phase: eager, loading, switch, compiled)
        for _ in range(width):
            self._add()

    def _add(self) -> None:
        i = self.next % len(self.prompts)
        rid = f"r{self.next}"
        self.engine.add_request(rid, self.prompts[i], greedy())
        self.tokens[rid], self.prompt_of[rid] = [], i
        self.next += 1

    def step(self) -> None:
        runner = self.engine.runner
        was_compiled = runner.compiled is not None
        loading = any(j.loader is not None for j in runner.background.jobs.values())
        start = time.perf_counter()
        outputs = self.engine.step()
        seconds = time.perf_counter() - start
        phase = "compiled" if was_compiled else "switch" if runner.compiled is not None else \
            "loading" if loading else "eager"
        self.step_seconds.append((seconds, phase))
        for out in outputs:
            self.tokens[out.request_id].extend(out.new_token_ids)
            if out.finished:
                assert out.finish_reason in ("stop", "length"), out.error
                rid = out.request_id
                assert self.tokens.pop(rid) == self.expected[self.prompt_of.pop(rid)], rid
                self.finished += 1
                self._add()

    def until(self, done, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not done():
            assert time.monotonic() < deadline, "timed out"
            self.step()


def test_serves_eagerly_while_compiling_then_switches_without_a_pause(tiny_model_dir, prompts, expected,
                                                                      module_caches):
    """Ready at once with no compiled forward; the child is held (SIGSTOP), so the engine serves a
    full batch of requests before any graph exists; released, the engine switches to the compiled
    forward between two steps while requests run, every request's tokens equal to HF's, and the
    step that switches takes no longer than a bound set by the eager steps (the loader thread's
    steps are printed: it shares the GIL with them)."""
    engine = server_engine(tiny_model_dir)
    runner = engine.runner
    job = runner.background.jobs[False]
    assert runner.compiled is None and job.child is not None
    os.kill(job.child.pid, signal.SIGSTOP)
    try:
        traffic = Traffic(engine, prompts, expected)
        traffic.until(lambda: traffic.finished >= 8, 300)
        assert runner.compiled is None, "served eagerly while the compile was held"
    finally:
        os.kill(job.child.pid, signal.SIGCONT)
    traffic.until(lambda: runner.compiled is not None, COMPILE_TIMEOUT_S)
    running_at_switch = len(engine.scheduler.running)
    finished_at_switch = traffic.finished
    traffic.until(lambda: traffic.finished >= finished_at_switch + 8, 300)
    assert running_at_switch > 0, "the switch happened with requests in the batch"
    assert compiled_marker(runner.compiled, False).is_file()
    assert runner.background.finished == [(False, pytest.approx(runner.background.finished[0][1]), "")]
    phases = {p: [s for s, q in traffic.step_seconds if q == p] for p in ("eager", "loading", "switch", "compiled")}
    print(", ".join(f"{p}: {len(v)} steps, median {1e3 * statistics.median(v):.1f} ms, max {1e3 * max(v):.1f} ms"
                    for p, v in phases.items() if v))
    (switch,) = phases["switch"]
    bound = max(1.0, 20 * statistics.median(phases["eager"]))     # generous: a shared, loaded machine
    assert switch <= bound, f"the switch step took {switch:.3f} s"


def test_warm_caches_load_before_ready(tiny_model_dir, prompts, expected, module_caches):
    """A second engine, where a child compiled the graphs before (the marker; the test above, or the
    first engine here), loads them before it is ready: compiled from its first step, no child started."""
    first = server_engine(tiny_model_dir)
    Traffic(first, prompts, expected).until(lambda: first.runner.compiled is not None, COMPILE_TIMEOUT_S)
    second = server_engine(tiny_model_dir)
    assert second.runner.compiled is not None and not second.runner.background.jobs
    traffic = Traffic(second, prompts, expected)
    traffic.until(lambda: traffic.finished >= 4, 300)


def test_a_failed_background_compile_keeps_serving_eagerly(tiny_model_dir, prompts, expected, fresh_caches,
                                                            monkeypatch, caplog):
    """No C++ compiler for Inductor in the child: one warning line, and the engine serves on, eagerly."""
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    engine = server_engine(tiny_model_dir)
    traffic = Traffic(engine, prompts, expected)
    traffic.until(lambda: not engine.runner.background.pending(), COMPILE_TIMEOUT_S)
    traffic.until(lambda: traffic.finished >= 8, 300)
    assert engine.runner.compiled is None
    (lora, _, error), = engine.runner.background.finished
    assert not lora and "exited with status 1" in error, error
    failed = [r for r in caplog.records if "compiling in the background failed" in r.getMessage()]
    assert len(failed) == 1 and "\n" not in failed[0].getMessage()
