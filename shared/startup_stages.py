"""An engine's start-up stages (conversion, kernels, weights, KV cache, compilation) with their
times: what the engine is doing before it serves, for its log, the launcher and the gateways.

The engine records them (``StartupStages.stage``); its start-up reporter
(engine_worker/startup_report.py) publishes ``snapshot()`` under ``names.starting_key`` until the
engine serves (then SERVING, briefly; while it serves eagerly and compiles in the background,
SERVING with ``background``, until that ends); ``kaiten serve`` prints them as they pass and a
gateway answers 503 ``engines_starting`` while a model has starting engines and no live one."""
from __future__ import annotations

import contextlib
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Iterator

log = logging.getLogger("kaiten.startup")

SERVING = "serving"         # the last state: the engine serves (or stopped starting)
STAGE_TITLES = {"conversion": "model conversion", "kernels": "kernel build", "weights": "weights",
                "kv_cache": "KV cache", "compilation": "compilation"}


@dataclass(slots=True)
class StartupState:
    """What a starting engine publishes: its model's served name, the stage it is in ("" between
    stages), when that stage began and the seconds each finished stage took, in order."""
    model: str
    stage: str                                 # "" between stages, SERVING at the end
    stage_started: float                       # time.time()
    started: float                             # time.time() when the engine process began
    done: list[tuple[str, float]] = field(default_factory=list)
    background: str = ""                       # a stage that goes on while the engine serves ("compilation")
    background_started: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return {"model": self.model, "stage": self.stage, "stage_started": self.stage_started,
                "started": self.started, "done": [list(d) for d in self.done], "background": self.background,
                "background_started": self.background_started}

    @property
    def starting(self) -> bool:
        return self.stage != SERVING

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> StartupState:
        return cls(str(d.get("model", "")), str(d.get("stage", "")), float(d.get("stage_started", 0.0)),
                   float(d.get("started", 0.0)), [(str(n), float(s)) for n, s in d.get("done", [])],
                   str(d.get("background", "")), float(d.get("background_started", 0.0)))

    @property
    def compiling(self) -> bool:
        """Serving eagerly while a stage (the compilation) goes on in the background."""
        return self.stage == SERVING and bool(self.background)

    def describe(self, now: float | None = None) -> str:
        """'compilation, 12 s so far', 'compilation (serving eagerly), 12 s so far' (or
        'initialising' between stages)."""
        now = time.time() if now is None else now
        if self.compiling:
            title = f"{STAGE_TITLES.get(self.background, self.background)} (serving eagerly)"
            return f"{title}, {max(0.0, now - self.background_started):.0f} s so far"
        if not self.stage:
            return "initialising"
        return f"{STAGE_TITLES.get(self.stage, self.stage)}, {max(0.0, now - self.stage_started):.0f} s so far"


class StartupStages:
    """The stages one engine has passed, thread-safe: the engine's thread records, a reporter
    thread reads ``snapshot()``."""

    def __init__(self, model: str = ""):
        self._lock = threading.Lock()
        self._state = StartupState(model, "", time.time(), time.time())

    def set_model(self, model: str) -> None:
        with self._lock:
            self._state.model = model

    @contextlib.contextmanager
    def stage(self, name: str) -> Iterator[None]:
        """Times the block as stage `name`. Logged at debug level: `kaiten serve` logs the stages
        it reads, and the stages log their own progress."""
        start = time.perf_counter()
        with self._lock:
            self._state.stage, self._state.stage_started = name, time.time()
        try:
            yield
        finally:
            seconds = time.perf_counter() - start
            with self._lock:
                self._state.stage = ""
                self._state.done.append((name, seconds))
            log.debug("start-up: %s took %.1f s", STAGE_TITLES.get(name, name), seconds)

    def serving(self) -> None:
        with self._lock:
            self._state.stage, self._state.stage_started = SERVING, time.time()

    def begin_background(self, name: str) -> None:
        """Stage `name` goes on in the background (the engine serves meanwhile) until end_background."""
        with self._lock:
            self._state.background, self._state.background_started = name, time.time()

    def end_background(self, name: str, seconds: float) -> None:
        with self._lock:
            self._state.background = ""
            self._state.done.append((name, seconds))
        log.debug("start-up: %s took %.1f s in the background", STAGE_TITLES.get(name, name), seconds)

    def snapshot(self) -> StartupState:
        with self._lock:
            s = self._state
            return StartupState(s.model, s.stage, s.stage_started, s.started, list(s.done), s.background,
                                s.background_started)


def stage(stages: StartupStages | None, name: str) -> contextlib.AbstractContextManager:
    """`stages.stage(name)`, or nothing where no stages are recorded (an offline LLM, a test)."""
    return contextlib.nullcontext() if stages is None else stages.stage(name)
