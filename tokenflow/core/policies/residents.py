"""The running streams ordered by buffer: a decision that touches O(changes) of them.

A running stream's utility falls as its buffer grows (`pricing.utility`), and only one with
buffer enough can be paused.  So instead of a candidate per running stream, a decision sorts
the running streams by buffered seconds once (a C-level sort) and:

- finds the pausable ones by bisection at the least pause threshold, with the exact test only
  for the few that may still fail it: a band just above the threshold (the threshold grows with
  a stream's blocks) and the residents that may not be decoding (`SchedulingView.unsettled`);
- counts how many pausable streams the balancer ranks before a paused stream or a newcomer
  (bisection on utility, exact comparison on ties): all it needs of the streams that stay;
- lists the pausable streams it ranks last (the ones a rotation pauses), from the large-buffer
  end, sorting the run of equal utilities at the cut by the balancer's full key;
- sums what admission needs of them from the queues' sums (`started.PausePool`).

Where memory binds, the balancer's walk (`counted.memory_walk`) needs the pausable members'
footprints as prefix sums in rank order (`footprint_sums`) and candidates only from the first
miss on (`candidates`).  The decisions are those of the candidate-per-stream survey
(`survey_started` + `balance`), given that the utility computed in floats never rises with the
buffer: every operation in it is monotone (IEEE rounding is), provided libm's `exp` is.
"""

from __future__ import annotations

import math
from bisect import bisect_left, bisect_right
from itertools import accumulate, filterfalse
from operator import attrgetter

from tokenflow.core.config import TokenFlowConfig
from tokenflow.core.policies.base import SchedulingView
from tokenflow.core.policies.survey import Candidate, Costs, footprint_blocks
from tokenflow.core.request import Request, RequestState

_RUNNING = RequestState.RUNNING
_LAST_CONSUME = attrgetter("last_consume_s")
_ARRIVAL = attrgetter("arrival_s", "arrival_index")
_ARRIVAL_S = attrgetter("arrival_s")
_INDEX = attrgetter("arrival_index")
_NUM_TOKENS = attrgetter("num_tokens")
_END = attrgetter("end_tokens")
_RATE = attrgetter("rate_tps")


def _NEG_LAST_CONSUME(r: Request) -> float:  # noqa: N802 (a key, named as the getters)
    return -r.last_consume_s


class _Utilities(dict):
    """Running members' utilities at `now`, each computed when first asked for (a dict: a
    kept one is read at C speed, as bisection keys)."""

    def __init__(self, now: float, dt: float, config: TokenFlowConfig) -> None:
        super().__init__()
        self._now, self._dt, self._inv_dt = now, dt, 1.0 / dt
        self._inv_horizon, self._stall_dt = 1.0 / config.value_horizon_s, config.stall_penalty * dt

    def __missing__(self, r: Request) -> float:
        buffered = r.last_consume_s - self._now
        value = 1.0 - buffered * self._inv_horizon
        u = (value if value > 0.0 else 0.0) * self._dt + self._stall_dt * math.exp(
            -buffered * self._inv_dt
        )
        self[r] = u
        return u


class Residents:
    """The running members, pausable ones found by bisection (see the module docstring)."""

    def __init__(
        self, config: TokenFlowConfig, view: SchedulingView, costs: Costs, growth: int
    ) -> None:
        self.view, self.costs, self.growth = view, costs, growth
        self.now = now = view.now_s
        dt = config.schedule_interval_s
        self._dt, self._inv_dt, self._inv_horizon = dt, 1.0 / dt, 1.0 / config.value_horizon_s
        self._stall_dt = config.stall_penalty * dt
        self._mu, self._critical = config.buffer_conservativeness, config.critical_slack_s
        order = sorted(view.running, key=_LAST_CONSUME, reverse=True)
        least = costs.min_threshold_s
        cut = bisect_left(order, True, key=lambda r: r.last_consume_s - now < least)
        # Buffer >= the least pause threshold, largest first (so utility rises along it); every
        # other resident is pinned without a look.
        self.suspects = order[:cut]
        self._rest = order[cut:]  # pinned without a look
        self.failing = self._failing()  # suspects pinned after all
        self.num_pausable = cut - len(self.failing)
        self.num_pinned = len(order) - self.num_pausable
        self._by_arrival: list[Request] | None = None
        self._pausable: list[Request] | None = None
        self._utilities = _Utilities(now, dt, config)

    # -- who is pausable ----------------------------------------------------------------------
    def _threshold_s(self, num_blocks: int) -> float:
        """`pause_threshold_s` for (unsynced + blocks) == num_blocks: same float operations."""
        costs = self.costs
        round_trip = num_blocks * costs.seconds_per_block + costs.queue_s + self._dt
        return self._mu * round_trip + self._critical

    def _failing(self) -> set[Request]:
        suspects, view, now = self.suspects, self.view, self.now
        if not suspects:
            return set()
        # Above the threshold of the longest suspect (unsynced <= blocks), a decoding stream
        # passes; the host has room for any tail (the caller checks free host >= device tier).
        most_blocks = 2 * -(-max(map(_NUM_TOKENS, suspects)) // view.kv.block_size)
        sure = self._threshold_s(most_blocks)
        band = bisect_left(suspects, True, key=lambda r: r.last_consume_s - now < sure)
        check = suspects[band:]
        unsettled = view.unsettled
        if unsettled is None:
            check = suspects
        else:
            least = self.costs.min_threshold_s
            check = check + [r for r in unsettled if r.last_consume_s - now >= least]
        return self._not_pausable(check)

    def _not_pausable(self, check: list[Request]) -> set[Request]:
        """Those of `check` failing the exact pause test of `survey._pausable_candidates`
        (same float operations; one loop with the decision's figures in locals)."""
        kv, costs, now = self.view.kv, self.costs, self.now
        bs, synced_of, free_host = kv.block_size, kv.synced_tokens_of, kv.num_free_host_blocks
        per_block_s, queue_s, dt = costs.seconds_per_block, costs.queue_s, self._dt
        mu, critical = self._mu, self._critical
        failing = set()
        for r in check:
            computed = r.num_computed_tokens
            if not (r.state is _RUNNING and r.output_token_ids and computed >= r.num_tokens - 1):
                failing.add(r)
                continue
            blocks = -(-computed // bs)
            unsynced = blocks - synced_of(r.request_id, 0) // bs
            round_trip = (unsynced + blocks) * per_block_s + queue_s + dt
            if unsynced > free_host or r.last_consume_s - now < mu * round_trip + critical:
                failing.add(r)
        return failing

    def pausable(self) -> list[Request]:
        """The pausable members, largest buffer first (ties in running order; computed once)."""
        if self._pausable is None:
            failing = self.failing
            suspects = self.suspects
            self._pausable = (
                list(filterfalse(failing.__contains__, suspects)) if failing else suspects
            )
        return self._pausable

    # -- rank -------------------------------------------------------------------------------
    def utility(self, r: Request) -> float:
        """A running suspect's utility (as `survey._pausable_candidates` computes it; once
        per decision: bisections probe the same streams)."""
        return self._utilities[r]

    @staticmethod
    def _tie_before(r: Request, other: Candidate) -> bool:
        """On equal utility, the balancer ranks pausable `r` before `other` (`_utility_order`)."""
        o = other.request
        if not o.output_token_ids:
            return True  # started streams before newcomers
        return (-r.rate_tps, r.arrival_s, r.arrival_index) < (-o.rate_tps, *o.sort_key)

    def num_before(self, other: Candidate) -> int:
        """Pausable members the balancer ranks before `other` (paused or newcomer) by utility."""
        if other.is_overdue:
            return 0
        members, u, key = self.pausable(), other.utility, self._utilities.__getitem__
        hi = bisect_right(members, u, key=key)
        count = len(members) - hi
        while hi > 0 and key(members[hi - 1]) == u:  # the run of equal utility before hi
            hi -= 1
            count += self._tie_before(members[hi], other)
        return count

    def has_before(self, other: Candidate, count: int) -> bool:
        """`num_before(other) >= count`, from the utility of the member ranked `count`-th
        (the members before `other` lead the rank order), counted only on a tie."""
        if count <= 0:
            return True
        if count > self.num_pausable or other.is_overdue:
            return False
        pausable = self.pausable()  # (utility rising)
        u, mine = other.utility, self._utilities[pausable[len(pausable) - count]]
        if mine != u:
            return mine > u
        return self.num_before(other) >= count

    def arrival_order(self) -> list[Request]:
        """The pausable members by arrival (computed once)."""
        if self._by_arrival is None:
            self._by_arrival = self._pausable_by_arrival()
        return self._by_arrival

    def _pausable_by_arrival(self) -> list[Request]:
        """The pausable members by arrival: the queues' residents by arrival less the others,
        or (unknown) sorted in two stable C-level sorts (no tuple keys)."""
        by_arrival = self.view.running_by_arrival
        if by_arrival is None:
            by_index = sorted(self.pausable(), key=_INDEX)
            by_index.sort(key=_ARRIVAL_S)
            return by_index
        if not self.failing and not self._rest:
            return list(by_arrival)
        pinned = self.failing.union(self._rest)
        return list(filterfalse(pinned.__contains__, by_arrival))

    def num_before_by_arrival(self, other: Candidate) -> int:
        """Pausable members the balancer ranks before `other` in arrival order (degraded):
        a pausable stream is never urgent or overdue."""
        if other.is_overdue or other.is_urgent:
            return 0
        return bisect_left(self.arrival_order(), other.request.sort_key, key=_ARRIVAL)

    def last(self, count: int, by_arrival: bool) -> list[Request]:
        """The `count` pausable members the balancer ranks last (in no particular order)."""
        if count <= 0:
            return []
        if by_arrival:
            return self.arrival_order()[-count:]
        pausable = self.pausable()  # lowest utility first
        utility, edge = self.utility, self.utility(pausable[count - 1])
        # The run of utilities equal to the cut's, on both sides of it: equal buffers first
        # (bisections: the list is by buffer), then any distinct buffer of equal utility.
        lo, hi = self._equal_buffers(pausable, pausable[count - 1].last_consume_s)
        while hi < len(pausable) and utility(pausable[hi]) == edge:
            hi += 1
        if hi == count:
            return pausable[:count]
        while lo > 0 and utility(pausable[lo - 1]) == edge:
            lo -= 1
        # Rank that run by the balancer's ties (the faster reader, then arrival, first; stable
        # C-level sorts, arrival indices unique) and keep its last ones.
        run = sorted(pausable[lo:hi], key=_INDEX)
        run.sort(key=_ARRIVAL_S)
        run.sort(key=_RATE, reverse=True)
        return pausable[:lo] + run[len(run) - (count - lo) :]

    @staticmethod
    def _equal_buffers(members: list[Request], last_consume_s: float) -> tuple[int, int]:
        """The slice of `members` (by last_consume_s, falling) holding `last_consume_s`."""
        key = _NEG_LAST_CONSUME
        lo = bisect_left(members, -last_consume_s, key=key)
        return lo, bisect_right(members, -last_consume_s, lo, key=key)

    def candidates(self, members: list[Request] | None = None) -> list[Candidate]:
        """A candidate per pausable member (of `members` if given; as `survey.
        _pausable_candidates` makes them, with `utility` and `footprint_blocks` written out),
        for the balancer where memory binds."""
        kv, now, growth = self.view.kv, self.now, self.growth
        tables, synced_of, bs = kv.device_tables, kv.synced_tokens_of, kv.block_size
        dt, inv_dt, inv_horizon = self._dt, self._inv_dt, self._inv_horizon
        stall_dt = self._stall_dt
        new, exp, out = tuple.__new__, math.exp, []  # (new: Candidate._make, C-level)
        for r in self.pausable() if members is None else members:
            rid, num_out = r.request_id, len(r.output_token_ids)
            blocks = -(-r.num_computed_tokens // bs)
            unsynced = blocks - synced_of(rid, 0) // bs
            buffered = r.last_consume_s - now
            value = 1.0 - buffered * inv_horizon
            score = (value if value > 0.0 else 0.0) * dt + stall_dt * exp(-buffered * inv_dt)
            remaining = r.sampling_params.max_tokens - num_out
            extra = growth if growth < remaining else remaining
            footprint = -(-(r.num_tokens + (extra if extra > 1 else 1)) // bs)
            reclaim = len(tables[rid])
            out.append(
                new(
                    Candidate,
                    (r, score, footprint, True, False, True, False, False, reclaim, unsynced, 0.0),
                )
            )
        return out

    def pinned_footprint_blocks(self) -> int:
        """The device blocks of the pinned residents through the next interval (C-level)."""
        pinned = self._rest + list(self.failing)
        return footprint_blocks(pinned, self.growth, self.view.kv.block_size)

    # -- memory -----------------------------------------------------------------------------
    def footprint_blocks(self, r: Request) -> int:
        """A pausable member's device blocks through the next interval (as its candidate's)."""
        remaining = r.sampling_params.max_tokens - len(r.output_token_ids)
        extra = self.growth if self.growth < remaining else remaining
        return -(-(r.num_tokens + (extra if extra > 1 else 1)) // self.view.kv.block_size)

    def footprint_sums(self, members: list[Request]) -> list[int]:
        """Prefix sums of `footprint_blocks` along `members` (from 0): with growth >= 1, the
        blocks of min(tokens + growth, prompt + max_tokens) (a resident has a token to go)."""
        growth, bs = self.growth, self.view.kv.block_size
        if growth < 1:
            return list(accumulate(map(self.footprint_blocks, members), initial=0))
        up, total = bs - 1, 0
        sums = [0]
        for r in members:
            t, end = r.num_tokens + growth, r.end_tokens
            total += ((t if t < end else end) + up) // bs
            sums.append(total)
        return sums

    def footprint_total(self, members: list[Request]) -> int:
        """`footprint_blocks` summed over `members` (`footprint_sums`' last, without the list)."""
        return footprint_blocks(members, self.growth, self.view.kv.block_size)

    def footprint_floor(self, members: list[Request]) -> int:
        """At most `footprint_total(members)`: a footprint holds at least one token more than
        the member has, so it is at least ceil((tokens + 1) / block size) blocks."""
        bs = self.view.kv.block_size
        return (sum(map(_NUM_TOKENS, members)) + len(members) + bs - 1) // bs

    def footprint_bound_blocks(self) -> int:
        """At least the device blocks of every resident through the next interval: the sum of
        ceil((tokens + max(growth, 1)) / block size), bounded by one division."""
        running, bs = self.view.running, self.view.kv.block_size
        ahead = max(self.growth, 1) + bs - 1
        return (self._resident_tokens() + len(running) * ahead) // bs

    def _resident_tokens(self) -> int:
        tokens = self.view.resident_tokens
        return sum(map(_NUM_TOKENS, self.view.running)) if tokens is None else tokens

    def suspect_sums(self) -> tuple[int, int]:
        """(tokens, remaining output tokens) summed over the suspects: from the residents'
        sums less the other residents' where those are fewer, else directly (C-level)."""
        rest, view = self._rest, self.view
        if view.resident_tokens is None or len(rest) >= len(self.suspects):
            tokens = sum(map(_NUM_TOKENS, self.suspects))
            return tokens, sum(map(_END, self.suspects)) - tokens
        rest_tokens = sum(map(_NUM_TOKENS, rest))
        rest_remaining = sum(map(_END, rest)) - rest_tokens
        tokens = view.resident_tokens - rest_tokens
        return tokens, view.remaining_output_tokens - rest_remaining
