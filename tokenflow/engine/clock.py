"""The real engine's clock: monotonic wall time."""

from __future__ import annotations

import time


class WallClock:
    """Monotonic wall time in seconds since this clock was created (the real engine's clock)."""

    def __init__(self) -> None:
        self._origin_s = time.monotonic()

    def now(self) -> float:
        """Seconds elapsed since construction."""
        return time.monotonic() - self._origin_s
