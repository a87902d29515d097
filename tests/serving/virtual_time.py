"""An asyncio event loop on virtual time, for tests that time what the server does.

Its clock (`loop.time()`, what `asyncio.sleep` and every timer count) stands still while any
task can run and jumps to the next timer when none can: `asyncio.sleep(60)` takes no real time,
and every time a test reads off the loop is the same on any machine, however busy.  Real I/O
(the loop's own wake-up pipe) is still watched; with no timer at all the loop blocks on it as
usual.  Work in another thread does not hold the clock back, so a test timed here should not
run any (a prompt of token ids is not tokenized in a worker thread).
"""

from __future__ import annotations

import asyncio
import selectors
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

_T = TypeVar("_T")


class _JumpingSelector(selectors.DefaultSelector):
    """Polls the real file descriptors; where the loop would block until its next timer,
    moves the clock there instead."""

    def __init__(self, advance: Callable[[float], None]) -> None:
        super().__init__()
        self._advance = advance

    def select(self, timeout: float | None = None) -> list[Any]:
        ready = super().select(0)
        if ready or timeout == 0:
            return ready
        if timeout is None:  # no timer: only real I/O can wake the loop
            return super().select(None)
        self._advance(timeout)
        return []


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    """An event loop whose clock starts at 0 and moves only when every task waits."""

    def __init__(self) -> None:
        self._now_s = 0.0
        super().__init__(_JumpingSelector(self._advance))

    def time(self) -> float:
        """Virtual seconds since the loop was made."""
        return self._now_s

    def _advance(self, by_s: float) -> None:
        self._now_s += by_s


def run_in_virtual_time(main: Coroutine[Any, Any, _T]) -> _T:
    """Run `main` to its end on a fresh `VirtualTimeLoop`."""
    with asyncio.Runner(loop_factory=VirtualTimeLoop) as runner:
        return runner.run(main)
