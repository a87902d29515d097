"""The step loop's clock: what it needs of one (`Clock`), and the simulator's (`SimClock`).

Every clock reports seconds since its own start, so metrics code never needs to know which it
has.  The real engine's wall clock is `tokenflow.engine.clock.WallClock` (the core never reads
the wall clock).
"""

from __future__ import annotations

import math
from typing import Protocol


class Clock(Protocol):
    def now(self) -> float:
        """Seconds on this run's time line."""
        ...


class SimClock:
    """Simulated time that moves only when told to, and never backwards."""

    def __init__(self, start_s: float = 0.0) -> None:
        if not math.isfinite(start_s):
            raise ValueError(f"start_s must be finite, got {start_s!r}")
        self._now_s = float(start_s)

    def now(self) -> float:
        """Current simulated time in seconds."""
        return self._now_s

    def advance_to(self, t_s: float) -> None:
        """Jump to `t_s`; moving to the present is a no-op, moving backwards is an error."""
        if not t_s >= self._now_s or math.isinf(t_s):
            raise ValueError(
                f"the clock cannot go backwards or to a non-finite time: now={self._now_s!r}, "
                f"asked {t_s!r}"
            )
        self._now_s = float(t_s)

    def advance(self, dt_s: float) -> None:
        """Move forward by `dt_s` >= 0 seconds."""
        if not (dt_s >= 0 and math.isfinite(dt_s)):
            raise ValueError(f"the clock advances by a finite dt >= 0, got {dt_s!r}")
        self._now_s += dt_s
