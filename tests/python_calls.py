"""Work counted in Python function calls: a cost that is the same on every machine and load."""

from __future__ import annotations

import sys
from collections.abc import Callable
from types import FrameType


def count_python_calls(fn: Callable[[], object]) -> int:
    """How many Python frames (functions, generator resumptions) `fn()` enters in this thread.

    A hot path kept vectorized or inlined makes a fixed number of calls, or one per item; a
    Python loop slipped in per token or per chunk shows up as calls growing with the input,
    which wall-clock thresholds would only catch on the machine they were fitted to.
    """
    num_calls = 0

    def profile(frame: FrameType, event: str, arg: object) -> None:
        nonlocal num_calls
        if event == "call":
            num_calls += 1

    previous = sys.getprofile()
    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(previous)
    return num_calls - 1  # the call of `fn` itself
