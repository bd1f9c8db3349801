"""The CPU server's compiled forward, built while the engine serves eagerly (issue 61: ready in
seconds, and no compile on a request's path).

Two phases for each kind of step (steps without adapter tokens, then, once the engine has
adapters, steps with them):

1. A child process (engine_worker/model/compile_child.py, at a low CPU priority) builds the model as
   the engine does and compiles its layers into Inductor's caches on disk, then leaves a marker
   (``compiled_marker``) naming what it compiled. Compiling in this process instead is unsafe:
   AOTAutograd's tracing (make_fx) patches ``torch.nn.Module.__call__`` for every thread, and the
   serving thread's eager forward then failed in the tracer ("module is not installed as a
   submodule"); and its Python would hold the serving thread's GIL for the whole compile.
2. A thread of this process loads the compiled graphs from those caches (Dynamo traces the region
   again, AOTAutograd and Inductor find their artifacts: no make_fx, no C++ compiler), with an
   attention backend instance of its own (a backend plans a step in its own attributes). The
   runner takes the result at a step boundary (``take``): the whole forward switches at once.

At start-up, a marker for this model's graphs means the caches are warm: the runner loads before
it says it is ready (seconds), compiled from its first step. A failure in either phase is one line
in the log; the engine keeps serving eagerly."""
from __future__ import annotations

import ctypes
import dataclasses
import hashlib
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import IO

import torch

from engine_worker.model.compiled_forward import CompiledForward, inductor_cache_dir, ops_schema_tag
from shared.config import EngineConfig
from shared.startup_stages import StartupStages

log = logging.getLogger(__name__)

CHILD_NICE = 10                 # below the serving process: its steps come first on a busy CPU
MARKERS_DIR = "kaiten-compiled"
LOADER_THREAD = "kaiten-compile-load"
PR_SET_PDEATHSIG = 1


def _child_setup() -> None:
    """In the child before it runs: a low priority, and killed with the engine (PR_SET_PDEATHSIG),
    not left compiling for nobody."""
    os.nice(CHILD_NICE)
    ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


class TracingInLoader(RuntimeError):
    """The loader missed Inductor's caches and would trace (make_fx) in the serving process."""


def refuse_tracing_in_loaders() -> None:
    """FX's tracer patches ``torch.nn.Module.__call__`` for every thread while it traces, which
    breaks the serving thread's eager forward. A load from warm caches never traces; where the
    caches miss after all (cleared meanwhile, a key that differs), the loader thread fails at the
    tracer's first patch instead, before anything is patched, and the engine stays eager."""
    patcher = torch.fx._symbolic_trace._Patcher
    patch = patcher.patch_method
    if getattr(patch, "_kaiten_guard", False):
        return

    def guarded(self, *args, **kwargs):
        if threading.current_thread().name == LOADER_THREAD:
            raise TracingInLoader("the compiled graphs were not in Inductor's caches")
        return patch(self, *args, **kwargs)
    guarded._kaiten_guard = True
    patcher.patch_method = guarded


def compiled_marker(compiled: CompiledForward, lora: bool) -> Path:
    """The file that says Inductor's caches hold this forward's graphs (for steps with adapter
    tokens where `lora`): named by the regions' graph signatures, torch's version and the ops'
    schemas, as the caches' own keys depend on them."""
    what = repr((compiled.signatures(lora), torch.__version__, ops_schema_tag(), os.cpu_count()))
    return inductor_cache_dir() / MARKERS_DIR / f"{hashlib.sha1(what.encode()).hexdigest()[:20]}{'-lora' * lora}"


@dataclasses.dataclass(slots=True)
class Job:
    """One kind of step's graphs on their way: the child, then the loading thread."""
    lora: bool
    started: float
    child: subprocess.Popen | None = None
    errors: IO[str] | None = None           # the child's stderr
    loader: threading.Thread | None = None
    loaded: CompiledForward | None = None
    failed: str = ""


class BackgroundCompile:
    """The compiled forward of `model`, built in the background; ``take()`` at a step boundary."""

    def __init__(self, config: EngineConfig, model: torch.nn.Module, kv_caches, backend_factory,
                 dtype: torch.dtype, max_loras: int, stages: StartupStages | None = None):
        self.config, self.model, self.kv_caches, self.stages = config, model, kv_caches, stages
        self.backend_factory, self.dtype, self.max_loras = backend_factory, dtype, max_loras
        self.jobs: dict[bool, Job] = {}
        self.finished: list[tuple[bool, float, str]] = []   # (lora, seconds, error or "") of the jobs done

    def forward(self) -> CompiledForward:
        """A compiled forward over the engine's model and KV caches with a backend of its own."""
        return CompiledForward(self.model, self.kv_caches, self.backend_factory(), self.dtype, self.max_loras)

    def is_warm(self, lora: bool = False) -> bool:
        return compiled_marker(self.forward(), lora).is_file()

    def start(self, lora: bool = False) -> None:
        """Compile the graphs for one kind of step in a child, then load them here (once)."""
        if lora in self.jobs or any(done == lora for done, _, _ in self.finished):
            return
        job = self.jobs[lora] = Job(lora, time.perf_counter())
        spec = json.dumps({"config": dataclasses.asdict(self.config), "lora": lora})
        try:
            job.errors = tempfile.TemporaryFile("w+")      # a pipe would fill with Inductor's warnings
            job.child = subprocess.Popen([sys.executable, "-m", "engine_worker.model.compile_child"],
                                         stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=job.errors,
                                         text=True, preexec_fn=_child_setup)
            job.child.stdin.write(spec)
            job.child.stdin.close()
        except OSError as e:
            job.failed = f"could not start the compile process: {e}"
        log.info("serving the eager model; compiling the model's layers%s in the background",
                 " for adapters" if lora else "")
        if self.stages is not None:
            self.stages.begin_background("compilation")

    def pending(self) -> bool:
        return bool(self.jobs)

    def take(self, lora: bool) -> CompiledForward | None:
        """The compiled forward for this kind of step once its graphs are loaded (then None:
        taken once); advances the jobs. Cheap: called at every step boundary."""
        job = self.jobs.get(lora)
        if job is None:
            return None
        if job.child is not None and job.loader is None and not job.failed and job.child.poll() is not None:
            self._child_done(job)
        if job.failed:
            self._finish(job, job.failed)
            return None
        if job.loaded is not None:
            self._finish(job, "")
        return job.loaded

    def _child_done(self, job: Job) -> None:
        job.errors.seek(0)
        err = job.errors.read().strip().splitlines()
        job.errors.close()
        if job.child.returncode != 0:
            job.failed = f"the compile process exited with status {job.child.returncode}" + \
                (f": {err[-1]}" if err else "")
            return
        job.loader = threading.Thread(target=self._load, args=(job,), daemon=True, name=LOADER_THREAD)
        job.loader.start()

    def _load(self, job: Job) -> None:
        try:
            refuse_tracing_in_loaders()
            compiled = self.forward()
            compiled.warm_up(lora=job.lora)
            job.loaded = compiled
        except Exception as e:      # the caches were cleared meanwhile, a loader error: stay eager
            job.failed = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"

    def _finish(self, job: Job, error: str) -> None:
        del self.jobs[job.lora]
        seconds = time.perf_counter() - job.started
        self.finished.append((job.lora, seconds, error))
        if self.stages is not None:
            self.stages.end_background("compilation", seconds)
        if error:
            log.warning("compiling in the background failed after %.1f s; serving the eager model: %s", seconds, error)
        else:
            log.info("compiled in the background in %.1f s: %s steps run compiled from now", seconds,
                     "adapters'" if job.lora else "the model's")
