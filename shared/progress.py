"""Progress lines for long start-up work (converting, loading weights): a log line at each tenth
of the work, at most one every `min_interval` seconds, and one at the end."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field


@dataclass(slots=True)
class Progress:
    log: logging.Logger
    what: str                          # "loading weights from /models/x"
    total: int
    min_interval: float = 1.0
    done: int = 0
    _started: float = field(default_factory=time.monotonic)
    _last_tenth: int = 0
    _last_log: float = 0.0

    def __post_init__(self) -> None:
        self.log.info("%s: 0/%d", self.what, self.total)

    def advance(self, n: int = 1) -> None:
        self.done += n
        tenth = self.done * 10 // max(1, self.total)
        now = time.monotonic()
        if self.done < self.total and tenth > self._last_tenth and now - self._last_log >= self.min_interval:
            self._last_tenth, self._last_log = tenth, now
            self.log.info("%s: %d/%d (%d%%)", self.what, self.done, self.total, 100 * self.done // max(1, self.total))

    def finish(self) -> None:
        self.log.info("%s: done, %d/%d in %.1f s", self.what, self.done, self.total, time.monotonic() - self._started)
