"""When speculation pays: how many drafts to verify, from measured step times and acceptance.

A step that scores n tokens takes t(n), measured online (``StepTimes``). Verifying m more drafts
costs t(n + m) - t(n) for the whole batch and is worth, per draft, the chance that it and the
drafts before it are accepted: rate ** j for a sequence's j-th draft, `rate` its measured share
of drafts accepted. The plan keeps the m most likely drafts that maximise expected tokens per
second, (decodes + their accepted drafts) / t(n + m): none at all where the batch is large enough
that the step grows faster than its output, or where acceptance is poor.
"""
from __future__ import annotations

import bisect
import math
from collections.abc import Callable
from dataclasses import dataclass, field

GRID_STEPS_PER_DOUBLING = 4     # step times are kept at token counts 2 ** (i / 4), rounded


def grid_point(num_tokens: int) -> int:
    """The token count, on a geometric grid (ratio ~1.19), whose average a step of num_tokens joins."""
    return round(2 ** (round(GRID_STEPS_PER_DOUBLING * math.log2(num_tokens)) / GRID_STEPS_PER_DOUBLING))


@dataclass(slots=True)
class StepTimes:
    """Moving averages of a decode step's wall time by the number of tokens it scored."""
    weight: float = 0.1                                        # of the latest step at a grid point
    seconds: dict[int, float] = field(default_factory=dict)    # grid point -> average seconds
    points: list[int] = field(default_factory=list)            # measured grid points, sorted

    def observe(self, num_tokens: int, seconds: float) -> None:
        point = grid_point(num_tokens)
        old = self.seconds.get(point)
        if old is None:
            bisect.insort(self.points, point)
            self.seconds[point] = seconds
        else:
            self.seconds[point] = old + self.weight * (seconds - old)

    def predict(self, num_tokens: int) -> float:
        """Linear between the nearest measured points, flat beyond them (so an unmeasured larger
        step looks free, is tried, and measured); 1.0 when nothing is measured yet."""
        if not self.points:
            return 1.0
        i = bisect.bisect_left(self.points, num_tokens)
        if i == 0:
            return self.seconds[self.points[0]]
        if i == len(self.points):
            return self.seconds[self.points[-1]]
        lo, hi = self.points[i - 1], self.points[i]
        t_lo, t_hi = self.seconds[lo], self.seconds[hi]
        return t_lo + (t_hi - t_lo) * (num_tokens - lo) / (hi - lo)


def plan_drafts(rates: list[float], max_drafts: list[int], num_decodes: int, num_tokens: int,
                step_time: Callable[[int], float]) -> list[int]:
    """How many drafts (at most max_drafts[i]) to verify for each sequence whose acceptance rate
    is rates[i], in a step of num_decodes decoding sequences that scores num_tokens tokens
    without drafts; step_time(n) predicts the seconds of a step of n tokens."""
    values = sorted(((rate ** j, i) for i, (rate, k) in enumerate(zip(rates, max_drafts))
                     for j in range(1, k + 1)), reverse=True)
    best_m, best = 0, num_decodes / step_time(num_tokens)
    expected = float(num_decodes)
    for m, (value, _) in enumerate(values, 1):
        expected += value
        rate = expected / step_time(num_tokens + m)
        if rate > best:
            best_m, best = m, rate
    counts = [0] * len(rates)
    for _, i in values[:best_m]:
        counts[i] += 1
    return counts
