"""What the fleet reads of a replica and of a request, for routing (routing.py) and for moving
requests between replicas (rebalance.py):

- a replica's load report, sent every period (`load_report`, built from the `SchedulingView`
  its policy decides on): Gamma at growing footprints, the reading demand of its started and
  waiting streams, its tiers, and a sample of the prefixes they cache (prefix_summary.py);
- a request's routing facts (`RouteRequest`): its reader's rate, its footprints, and its
  prompt's block keys or the session its client named;
- a replica's load once requests join it (`project`): reading demand over Gamma at the
  footprint it would then hold, and the blocks its tiers would have left.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from tokenflow.core.policies.base import SchedulingView
from tokenflow.core.policies.capacity import measure_capacity, request_demand_tps
from tokenflow.core.policies.pricing import lifetime_blocks
from tokenflow.core.prefix_summary import MAX_KEYS_PER_TIER, PrefixSummary
from tokenflow.core.request import (
    Consumption,
    Request,
    end_footprint_tokens,
    is_reader_rate,
    lifetime_footprint_tokens,
    reader_rate_error,
)

_LADDER_STEP = 2**0.25  # footprints at which a report samples Gamma, ~19% apart


@dataclass(frozen=True)
class RouteRequest:
    """What a router knows of a new request."""

    request_id: str
    rate_tps: float  # the reader's rate (inf for an eager or batch request)
    lifetime_tokens: int  # prompt + half the output budget: its mean footprint over its life
    end_tokens: int  # prompt + max_tokens: the most it can hold
    # Engine requests it starts (prompts x n), each of the sizes above: it counts this many times.
    num_choices: int = 1
    # The chain keys of the prompt's full blocks of `prefix_block_size` tokens (prefix_cache.py),
    # when the caller has its tokens; () when it has not.
    prefix_block_hashes: tuple[int, ...] = ()
    prefix_block_size: int = 0
    session_key: str | None = None  # the client's session (`prompt_cache_key`), if named

    @classmethod
    def of(cls, request: Request, block_size: int | None = None) -> RouteRequest:
        """The routing facts of a core request; with `block_size` (the replicas' prefix
        caches' block), its prompt's block keys too."""
        hashes = () if block_size is None else tuple(request.prompt_block_hashes(block_size))
        return cls(
            request.request_id,
            request.rate_tps,
            request.lifetime_tokens,
            request.end_tokens,
            prefix_block_hashes=hashes,
            prefix_block_size=block_size or 0,
            session_key=request.session_key,
        )

    @property
    def num_prompt_tokens(self) -> int:
        """Its prompt's tokens (to a token: the sizes halve max_tokens)."""
        return max(2 * self.lifetime_tokens - self.end_tokens, 1)

    @property
    def num_output_tokens(self) -> int:
        """Its output budget (max_tokens)."""
        return self.end_tokens - self.num_prompt_tokens


def route_request(
    request_id: str,
    rate_tps: float,
    num_prompt_tokens: int,
    max_tokens: int,
    consumption: Consumption = Consumption.READER,
    num_choices: int = 1,
    session_key: str | None = None,
) -> RouteRequest:
    """The routing facts of a request known only by its sizes (a router in front of the
    replicas sees the body, not the tokens): what `RouteRequest.of` reads of a core `Request`
    of these sizes, computed from the sizes alone, so a long prompt costs the router nothing
    in proportion to its length; `num_choices` such requests (prompts x n) when it starts
    several; `session_key`, the session its client named.  ValueError for a reader's rate
    `Request` would refuse."""
    num_prompt = max(num_prompt_tokens, 1)
    max_tokens = max(max_tokens, 1)
    if consumption is not Consumption.READER:
        rate_tps = math.inf  # (as `Request` reads an eager or batch request)
    elif not is_reader_rate(rate_tps):
        raise ValueError(f"request {request_id}: {reader_rate_error(rate_tps)}")
    return RouteRequest(
        request_id=request_id,
        rate_tps=rate_tps,
        lifetime_tokens=lifetime_footprint_tokens(num_prompt, max_tokens),
        end_tokens=end_footprint_tokens(num_prompt, max_tokens),
        num_choices=max(num_choices, 1),
        session_key=session_key,
    )


@dataclass(frozen=True)
class CapacityPoint:
    """Gamma at one mean lifetime footprint."""

    beta_blocks: float
    gamma_tps: float
    batch: int  # the feasible batch at that footprint
    solo_tps: float = math.inf  # one stream alone (`Capacity.solo_tps`; inf: no cap)

    @property
    def share_tps(self) -> float:
        """One stream's share of Gamma (`Capacity.share_tps`)."""
        return self.gamma_tps / self.batch

    def demand_tps(self, rate_tps: float) -> float:
        """What a request of `rate_tps` asks at this footprint (`request_demand_tps`)."""
        return request_demand_tps(rate_tps, self.share_tps, self.solo_tps)


@dataclass(frozen=True)
class LoadReport:
    """A replica's load at `now_s`, as the TokenFlow policy measures it."""

    now_s: float
    gamma_tps: float  # capacity at the members' footprint (what its policy admits against)
    working_demand_tps: float  # the started streams' reading demand (running + paused)
    waiting_demand_tps: float  # the waiting requests' reading demand
    num_running: int
    num_preempted: int
    num_waiting: int
    num_free_device_blocks: int
    num_free_host_blocks: int
    num_lifetime_blocks: int  # all unfinished requests' lifetime footprints, summed
    block_size: int
    capacity_points: tuple[CapacityPoint, ...]  # Gamma at growing footprints (ascending)
    num_device_blocks: int  # the tiers' sizes, free or not
    num_host_blocks: int
    prefill_token_s: float = 0.0  # what one more prefill token costs it (a move's recompute)
    waiting_prompt_tokens: int = 0  # prompt tokens its waiting requests have yet to compute
    cached_prefixes: PrefixSummary = PrefixSummary()  # a sample of its tiers' block keys

    @property
    def num_unfinished(self) -> int:
        return self.num_running + self.num_preempted + self.num_waiting

    def idle(self) -> LoadReport:
        """This replica with nothing on it: what a peer of the same deployment that has not
        reported yet is taken to be."""
        return replace(
            self,
            working_demand_tps=0.0,
            waiting_demand_tps=0.0,
            num_running=0,
            num_preempted=0,
            num_waiting=0,
            num_free_device_blocks=self.num_device_blocks,
            num_free_host_blocks=self.num_host_blocks,
            num_lifetime_blocks=0,
            cached_prefixes=PrefixSummary(),
            waiting_prompt_tokens=0,
        )

    def capacity_at(self, beta_blocks: float) -> CapacityPoint:
        """Gamma at `beta_blocks`, between the two sampled footprints around it (linear in
        the footprint's logarithm, so a small change of footprint never jumps a whole rung);
        the end points beyond the samples."""
        points = self.capacity_points
        if beta_blocks <= points[0].beta_blocks:
            return points[0]
        for low, high in zip(points, points[1:], strict=False):
            if high.beta_blocks >= beta_blocks:
                share = math.log(beta_blocks / low.beta_blocks) / math.log(
                    high.beta_blocks / low.beta_blocks
                )
                gamma = low.gamma_tps + share * (high.gamma_tps - low.gamma_tps)
                batch = low.batch + share * (high.batch - low.batch)
                solo = low.solo_tps + share * (high.solo_tps - low.solo_tps)
                return CapacityPoint(beta_blocks, gamma, max(round(batch), 1), solo)
        return points[-1]


def load_report(view: SchedulingView) -> LoadReport:
    """A replica's report, from the view its policy decides on."""
    capacity = measure_capacity(view)
    started = [*view.running, *view.preempted]
    block_size = view.kv.block_size
    everyone = [*started, *view.waiting]
    return LoadReport(
        now_s=view.now_s,
        gamma_tps=capacity.gamma_tps,
        working_demand_tps=capacity.demand_tps(started),
        waiting_demand_tps=capacity.demand_tps(view.waiting),
        num_running=len(view.running),
        num_preempted=len(view.preempted),
        num_waiting=len(view.waiting),
        num_free_device_blocks=view.kv.num_free_device_blocks,
        num_free_host_blocks=view.kv.num_free_host_blocks,
        num_lifetime_blocks=sum(lifetime_blocks(r, block_size) for r in everyone),
        block_size=block_size,
        capacity_points=_capacity_points(view),
        num_device_blocks=view.kv.config.num_device_blocks,
        num_host_blocks=view.kv.config.num_host_blocks,
        prefill_token_s=view.estimator.prefill_token_s,
        waiting_prompt_tokens=sum(r.num_tokens - r.num_computed_tokens for r in view.waiting),
        cached_prefixes=view.kv.prefix_summary(MAX_KEYS_PER_TIER),
    )


def _capacity_points(view: SchedulingView) -> tuple[CapacityPoint, ...]:
    """Gamma from one block per stream up to the whole device tier, ~19% apart."""
    points = []
    beta = 1.0
    while True:
        capacity = measure_capacity(view, beta)
        points.append(CapacityPoint(beta, capacity.gamma_tps, capacity.batch, capacity.solo_tps))
        if beta >= view.kv.config.num_device_blocks:
            return tuple(points)
        beta *= _LADDER_STEP


@dataclass(frozen=True)
class Projection:
    """A replica's load once some requests join it."""

    load: float  # reading demand / Gamma at the footprint it would hold
    num_spare_blocks: int  # device + host blocks left once the requests hold their longest


def project(report: LoadReport, joining: Sequence[RouteRequest]) -> Projection:
    """`report`'s replica once `joining` (routed since the report, and a candidate) join it."""
    block_size = report.block_size
    num_requests = report.num_unfinished + sum(r.num_choices for r in joining)
    blocks = report.num_lifetime_blocks + sum(
        r.num_choices * _blocks(r.lifetime_tokens, block_size) for r in joining
    )
    point = report.capacity_at(blocks / num_requests if num_requests else 1.0)
    demand_tps = report.working_demand_tps + report.waiting_demand_tps
    demand_tps += sum(r.num_choices * point.demand_tps(r.rate_tps) for r in joining)
    needed = sum(r.num_choices * _blocks(r.end_tokens, block_size) for r in joining)
    spare = report.num_free_device_blocks + report.num_free_host_blocks - needed
    return Projection(load=demand_tps / point.gamma_tps, num_spare_blocks=spare)


def _blocks(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)
