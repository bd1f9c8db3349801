"""Progress of long start-up work (converting, loading weights). On a terminal: a bar on stderr,
redrawn at most every `bar_interval` seconds. Elsewhere (a log file, a container): a log line at
each tenth of the work, at most one every `min_interval` seconds. Either way a line at the start and
one at the end."""
from __future__ import annotations

import logging
import sys
import time
from dataclasses import dataclass, field
from typing import TextIO

BAR_WIDTH = 30


def _terminal() -> TextIO | None:
    return sys.stderr if sys.stderr.isatty() else None


@dataclass(slots=True)
class Progress:
    log: logging.Logger
    what: str                          # "loading weights from /models/x"
    total: int
    min_interval: float = 1.0
    bar_interval: float = 0.1
    stream: TextIO | None = field(default_factory=_terminal)   # where the bar goes; None: log lines
    done: int = 0
    _started: float = field(default_factory=time.monotonic)
    _last_tenth: int = 0
    _last_log: float = 0.0
    _last_bar: float = 0.0

    def __post_init__(self) -> None:
        self.log.info("%s: 0/%d", self.what, self.total)

    def advance(self, n: int = 1) -> None:
        self.done += n
        now = time.monotonic()
        if self.stream is not None:
            if now - self._last_bar >= self.bar_interval or self.done >= self.total:
                self._last_bar = now
                self._draw()
            return
        tenth = self.done * 10 // max(1, self.total)
        if self.done < self.total and tenth > self._last_tenth and now - self._last_log >= self.min_interval:
            self._last_tenth, self._last_log = tenth, now
            self.log.info("%s: %d/%d (%d%%)", self.what, self.done, self.total, 100 * self.done // max(1, self.total))

    def _draw(self) -> None:
        frac = min(1.0, self.done / max(1, self.total))
        filled = int(frac * BAR_WIDTH)
        self.stream.write(f"\r{self.what} [{'#' * filled}{'.' * (BAR_WIDTH - filled)}] "
                          f"{100 * frac:3.0f}% {self.done}/{self.total}")
        self.stream.flush()

    def finish(self) -> None:
        if self.stream is not None:
            self._draw()
            self.stream.write("\n")
            self.stream.flush()
        self.log.info("%s: done, %d/%d in %.1f s", self.what, self.done, self.total, time.monotonic() - self._started)
