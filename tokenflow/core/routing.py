"""Routing new requests across engine replicas: each replica's load report, and the rules.

A replica reports its load every period (`load_report`, built from its `SchedulingView`); a
router picks a replica for each new request from the latest reports.  Reports are a period old
when they are read, so every rule also counts what it routed to a replica since that replica's
last report (`Router.routed_since`): a burst that arrives between two reports is spread, not
sent to the replica that looked idlest.

Rules, by name (`make_router`):
- `round-robin`: replicas in turn;
- `least-outstanding`: fewest unfinished requests (Ray Serve's default router, power of two
  choices over probed queue lengths, approximates it);
- `tokenflow`: the replica whose readers would ask the smallest share of its capacity Gamma
  once the request joins, among those whose KV tiers still hold it (paper section 4.3's
  schedulability, across replicas).  Gamma is read at the footprint the replica would hold, so
  a cold replica is not credited with the capacity of tiny requests.

Ties go to the replica listed first (`Router.replica_ids` order), never to dict order.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from tokenflow.core.policies.base import SchedulingView
from tokenflow.core.policies.capacity import measure_capacity, request_demand_tps
from tokenflow.core.policies.pricing import lifetime_blocks
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

    @classmethod
    def of(cls, request: Request) -> RouteRequest:
        """The routing facts of a core request."""
        return cls(
            request.request_id, request.rate_tps, request.lifetime_tokens, request.end_tokens
        )


def route_request(
    request_id: str,
    rate_tps: float,
    num_prompt_tokens: int,
    max_tokens: int,
    consumption: Consumption = Consumption.READER,
    num_choices: int = 1,
) -> RouteRequest:
    """The routing facts of a request known only by its sizes (a router in front of the
    replicas sees the body, not the tokens): what `RouteRequest.of` reads of a core `Request`
    of these sizes, computed from the sizes alone, so a long prompt costs the router nothing
    in proportion to its length; `num_choices` such requests (prompts x n) when it starts
    several.  ValueError for a reader's rate `Request` would refuse."""
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


@dataclass
class Router:
    """Picks a replica per request from the latest reports (see the module docstring).

    Subclasses give `_key`: the replica with the smallest key wins."""

    replica_ids: list[str]
    name: str = "base"
    reports: dict[str, LoadReport] = field(default_factory=dict)
    routed_since: dict[str, list[RouteRequest]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.replica_ids:
            raise ValueError("a router needs at least one replica")
        for replica_id in self.replica_ids:
            self.routed_since.setdefault(replica_id, [])

    def report(self, replica_id: str, report: LoadReport) -> None:
        """A replica's new report: what was routed to it before is in it now."""
        self.reports[replica_id] = report
        self.routed_since[replica_id] = []

    def add(self, replica_id: str) -> None:
        """A new replica (it goes by its id among the others); nothing if it is known."""
        if replica_id not in self.routed_since:
            self.replica_ids = sorted([*self.replica_ids, replica_id])
            self.routed_since[replica_id] = []

    def remove(self, replica_id: str) -> None:
        """A replica left (died or was scaled down): nothing goes to it any more."""
        self.replica_ids = [r for r in self.replica_ids if r != replica_id]
        self.reports.pop(replica_id, None)
        self.routed_since.pop(replica_id, None)

    def record(self, replica_id: str, request: RouteRequest) -> None:
        """`request` reached `replica_id` other than by `choose` (moved there): counted as
        routed to it until its next report."""
        self.routed_since[replica_id].append(request)

    def choose(self, request: RouteRequest, candidates: Sequence[str] | None = None) -> str:
        """The replica for `request` (among `candidates`, default all), recorded as routed."""
        ids = [r for r in self.replica_ids if candidates is None or r in candidates]
        if not ids:
            raise ValueError("no replica to route to")
        keys = [(self._key(replica_id, request), index) for index, replica_id in enumerate(ids)]
        chosen = ids[min(keys)[1]]
        self.routed_since[chosen].append(request)
        return chosen

    def _key(self, replica_id: str, request: RouteRequest) -> tuple[float, ...]:
        raise NotImplementedError


@dataclass
class RoundRobinRouter(Router):
    """Replicas in turn."""

    name: str = "round-robin"
    num_routed: int = 0

    def choose(self, request: RouteRequest, candidates: Sequence[str] | None = None) -> str:
        """The next replica in turn (among `candidates`)."""
        ids = [r for r in self.replica_ids if candidates is None or r in candidates]
        if not ids:
            raise ValueError("no replica to route to")
        chosen = ids[self.num_routed % len(ids)]
        self.num_routed += 1
        self.routed_since[chosen].append(request)
        return chosen


@dataclass
class LeastOutstandingRouter(Router):
    """Fewest unfinished requests: the last report's plus those routed since."""

    name: str = "least-outstanding"

    def _key(self, replica_id: str, request: RouteRequest) -> tuple[float, ...]:
        report = self.reports.get(replica_id)
        reported = report.num_unfinished if report else 0
        return (reported + sum(r.num_choices for r in self.routed_since[replica_id]),)


@dataclass
class TokenFlowRouter(Router):
    """The smallest share of Gamma asked once the request joins, where memory holds it.

    A replica that has not reported yet (just started) is taken to be an idle copy of the
    first reported one: replicas of one deployment run the same engine on the same tiers."""

    name: str = "tokenflow"

    def _key(self, replica_id: str, request: RouteRequest) -> tuple[float, ...]:
        report = self.reports.get(replica_id)
        if report is None:
            peer = next((self.reports[r] for r in self.replica_ids if r in self.reports), None)
            if peer is None:  # (no replica has reported: fewest routed first)
                return (1.0, 0.0, float(len(self.routed_since[replica_id])))
            report = peer.idle()
        projection = project(report, [*self.routed_since[replica_id], request])
        fits = projection.load <= 1.0 and projection.num_spare_blocks >= 0
        return (0.0 if fits else 1.0, projection.load, 0.0)


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


ROUTER_NAMES = ("round-robin", "least-outstanding", "tokenflow")


def make_router(name: str, replica_ids: Sequence[str]) -> Router:
    """A router by name over `replica_ids`; ValueError names the valid ones."""
    routers: dict[str, type[Router]] = {
        "round-robin": RoundRobinRouter,
        "least-outstanding": LeastOutstandingRouter,
        "tokenflow": TokenFlowRouter,
    }
    if name not in routers:
        raise ValueError(f"unknown router {name!r}; choose one of {', '.join(ROUTER_NAMES)}")
    return routers[name](list(replica_ids))


def parse_router_names(text: str) -> list[str]:
    """ "round-robin,tokenflow" -> ["round-robin", "tokenflow"]; ValueError naming unknown ones."""
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in ROUTER_NAMES]
    if unknown or not names:
        raise ValueError(f"unknown router {unknown}; choose from {', '.join(ROUTER_NAMES)}")
    return names
