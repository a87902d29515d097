"""How many CPU threads a step computes on: one for a tiny step, all of them otherwise.

On a CPU every torch op of a step is an OpenMP parallel region.  `tokenflow serve` lets
OpenMP's idle workers sleep (passive waits) so that the HTTP thread keeps a core; the price is
a worker wake-up per region.  A decode step of a few streams is a few hundred small regions,
and there waking the workers costs more than they add: on the project's 2-core machine
(passive waits, steps alternated) one thread decoded 1 / 2 / 4 streams at 42 / 70 / 112 tok/s
against 28 / 52 / 80 on two, 6 and 8 streams were even, and two threads won from 12 streams on
and in prefill (docs/design.md).
"""

from __future__ import annotations

import torch


class StepThreads:
    """Sets torch's intra-op threads before each step: one for steps of fewer than
    `serial_below_tokens` tokens, otherwise the count in force when it was made."""

    def __init__(self, serial_below_tokens: int) -> None:
        self.serial_below_tokens = serial_below_tokens
        self.parallel = torch.get_num_threads()
        self.current = self.parallel

    def for_step(self, num_tokens: int) -> int:
        """Set (if it changes) and return the threads a step of `num_tokens` tokens runs on."""
        wanted = 1 if num_tokens < self.serial_below_tokens else self.parallel
        if wanted != self.current:
            torch.set_num_threads(wanted)
            self.current = wanted
        return wanted
