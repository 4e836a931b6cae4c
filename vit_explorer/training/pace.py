"""How long is left of a run or a job, from the share of it done: the rate since the first
report, so that what comes before the first step (loading the model, a first capture) does not
count as the steps' pace; and the time left in words."""
from __future__ import annotations

import math
import time
from collections.abc import Callable


class Pace:
    """Feed it the share done (0 to 1) as it grows; ``seconds_left`` extrapolates the rate since
    the first share reported. ``clock``: seconds (a test gives its own)."""

    def __init__(self, clock: Callable[[], float] | None = None):
        self._clock = clock or time.monotonic
        self._first: tuple[float, float] | None = None  # (time, share) of the first report
        self._last: tuple[float, float] | None = None

    def update(self, share: float) -> None:
        now = (self._clock(), share)
        if self._first is None:
            self._first = now
        self._last = now

    @property
    def seconds_left(self) -> float | None:
        """At the pace since the first report; None until the share has grown since then."""
        if self._first is None or self._last is None:
            return None
        (started, first), (now, share) = self._first, self._last
        if share >= 1:
            return 0.0
        if share <= first or now <= started:
            return None
        return (1 - share) * (now - started) / (share - first)


def time_left(seconds: float | None) -> str:
    """", about 40 s left", ", about 3 min left"; "" when not known yet."""
    if seconds is None or not math.isfinite(seconds):
        return ""
    if seconds < 90:
        return f", about {max(1, round(seconds))} s left"
    if seconds < 90 * 60:
        return f", about {round(seconds / 60)} min left"
    return f", about {seconds / 3600:.1f} h left"
