"""The started members as the fast decision sees them, and what admission can take from them.

`StartedMembers` answers what the decision's phases ask of the started members (count,
lifetime footprint, demand, pauses for admission) with the running ones as `Residents` and the
paused ones as candidates; the slow path's `Survey` answers the same questions.
"""

from __future__ import annotations

import math
from itertools import chain, repeat
from operator import attrgetter

from tokenflow.core.policies.base import SchedulingView
from tokenflow.core.policies.residents import Residents
from tokenflow.core.policies.survey import Candidate

_NUM_TOKENS = attrgetter("num_tokens")
_END = attrgetter("end_tokens")
_RATE = attrgetter("rate_tps")


class PausePool:
    """What pausing the pausable members frees for admission: reclaimed blocks plus their
    reserve.  Admission takes pauses only to compare free blocks with a need, so handing out
    everything at once decides as taking them one by one does, while the host has room for
    every tail (which the caller ensures); a lower bound comes first, the exact sum only if
    the bound is not enough."""

    def __init__(self, residents: Residents) -> None:
        self._residents = residents
        self._given = 0
        self._bounded = self._exact = False

    def take(self, shortfall_blocks: int) -> int:
        """Blocks freed toward `shortfall_blocks`: the lower bound if that covers it, else
        the rest of the exact sum (0 once all is given)."""
        if self._exact:
            return 0
        if not self._bounded:
            self._bounded = True
            bound = self._lower_bound()
            if bound >= shortfall_blocks:
                self._given = bound
                return bound
        exact = self._total()
        self._exact = True
        freed, self._given = exact - self._given, exact
        return freed

    def _lower_bound(self) -> int:
        """Each pausable stream is decoding: its table holds >= (tokens - 1) / bs blocks, and
        its reserve is >= (remaining * ratio - 1) / bs blocks (with a margin for rounding)."""
        res, view = self._residents, self._residents.view
        bs, failing = view.kv.block_size, res.failing
        tokens, remaining = res.suspect_sums()
        failing_tokens = sum(map(_NUM_TOKENS, failing))
        tokens -= failing_tokens
        remaining -= sum(map(_END, failing)) - failing_tokens
        count = res.num_pausable
        reserve = (view.new_token_ratio * remaining * (1.0 - 1e-12) - count) / bs - 1
        return max((tokens - count) // bs, 0) + max(math.floor(reserve), 0)

    def _total(self) -> int:
        view = self._residents.view
        tables, ratio, bs = view.kv.device_tables, view.new_token_ratio, view.kv.block_size
        total = 0
        for r in self._residents.pausable():
            remaining = r.sampling_params.max_tokens - len(r.output_token_ids)
            total += len(tables.get(r.request_id, ())) - (-int(remaining * ratio) // bs)
        return total


class StartedMembers:
    """The started members as the fast decision sees them: the running ones as `Residents`,
    the paused ones priced (`paused.price_paused`); the count, footprint and demand come
    from the view (the slow decision's `Survey` answers the same questions), so they are
    known before the members are priced (`fill`), which depends on them."""

    def __init__(self, view: SchedulingView) -> None:
        self.view = view
        self.residents: Residents | None = None
        self.paused: list[Candidate] = []  # a candidate per paused member, in the view's order

    def fill(self, residents: Residents, paused: list[Candidate]) -> None:
        """The running members counted by buffer and the paused ones priced."""
        self.residents, self.paused = residents, paused

    @property
    def num_members(self) -> int:
        return len(self.view.running) + len(self.view.preempted)

    @property
    def sum_lifetime_blocks(self) -> int:
        return self.view.started_lifetime_blocks

    def demand_tps(self, rate_cap_tps: float) -> float:
        """The members' reading rates, each capped at `rate_cap_tps`, summed in member order."""
        view = self.view
        num_members, counts = self.num_members, view.started_rates
        if counts and sum(counts.values()) == num_members:
            # Each term is the cap, or each an integral rate whose partial sums are exact:
            # the sum in member order is then known without the members.
            if min(counts) >= rate_cap_tps:
                return sum(repeat(rate_cap_tps, num_members))
            if max(counts) <= rate_cap_tps and all(map(float.is_integer, counts)):
                total = sum(int(rate) * n for rate, n in counts.items())
                if total < 2**53:
                    return float(total)
        rates = map(_RATE, chain(view.running, view.preempted))
        return sum(map(min, rates, repeat(rate_cap_tps)))

    def pauses(self, view: SchedulingView) -> PausePool:
        """What pausing the pausable members frees, as admission takes it."""
        return PausePool(self.residents)
