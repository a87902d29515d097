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
- `prefix-affinity`: the longest cached prefix of the prompt, ties and misses to
  least-outstanding (Ray Serve's PrefixCacheAffinityRouter and llm-d's prefix scorer, without
  their load guards);
- `tokenflow`: among the replicas whose KV tiers still hold the request and whose readers
  would ask at most their capacity Gamma once it joins (paper section 4.3's schedulability,
  across replicas), the one where its reader loses least (`reader_loss_s`: the prefill a
  cached prefix saves against the stall of a replica past Gamma); then the smallest share of
  Gamma asked.  Gamma is read at the footprint the replica would hold, so a cold replica is
  not credited with the capacity of tiny requests.

What a replica caches.  A report carries a bounded sample of the block keys its tiers cache
(prefix_summary.py); a request carries its prompt's block keys when the caller has its tokens
(the simulator, a token-id prompt), else the session its client named (`prompt_cache_key`).
A replica holds a request's prefix as far as its report's sample, or a prompt routed to it since,
shares it; a session is held where the router sent the session's last turn.

Ties go to the replica listed first (`Router.replica_ids` order), never to dict order.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from tokenflow.core.policies.base import SchedulingView
from tokenflow.core.policies.capacity import measure_capacity, request_demand_tps
from tokenflow.core.policies.pricing import lifetime_blocks
from tokenflow.core.prefix_summary import MAX_KEYS_PER_TIER, PrefixSummary, num_common_blocks
from tokenflow.core.request import (
    Consumption,
    Request,
    end_footprint_tokens,
    is_reader_rate,
    lifetime_footprint_tokens,
    reader_rate_error,
)

_LADDER_STEP = 2**0.25  # footprints at which a report samples Gamma, ~19% apart
MAX_SESSIONS = 1 << 16  # sessions whose last replica a router remembers (the latest ones)


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


@dataclass
class Router:
    """Picks a replica per request from the latest reports (see the module docstring).

    Subclasses give `_key`: the replica with the smallest key wins."""

    replica_ids: list[str]
    name: str = "base"
    reports: dict[str, LoadReport] = field(default_factory=dict)
    routed_since: dict[str, list[RouteRequest]] = field(default_factory=dict)
    # Where each named session's last turn went (the latest MAX_SESSIONS, oldest first).
    session_replicas: dict[str, str] = field(default_factory=dict)

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
        sessions = self.session_replicas
        for session in [s for s, r in sessions.items() if r == replica_id]:
            del sessions[session]

    def record(self, replica_id: str, request: RouteRequest) -> None:
        """`request` reached `replica_id` other than by `choose` (moved there): counted as
        routed to it until its next report, and its session as held there."""
        self.routed_since[replica_id].append(request)
        session = request.session_key
        if session is not None:
            self.session_replicas.pop(session, None)
            self.session_replicas[session] = replica_id
            if len(self.session_replicas) > MAX_SESSIONS:
                del self.session_replicas[next(iter(self.session_replicas))]

    def choose(self, request: RouteRequest, candidates: Sequence[str] | None = None) -> str:
        """The replica for `request` (among `candidates`, default all), recorded as routed."""
        ids = [r for r in self.replica_ids if candidates is None or r in candidates]
        if not ids:
            raise ValueError("no replica to route to")
        keys = [(self._key(replica_id, request), index) for index, replica_id in enumerate(ids)]
        chosen = ids[min(keys)[1]]
        self.record(chosen, request)
        return chosen

    def num_outstanding(self, replica_id: str) -> int:
        """Unfinished requests on the replica: its last report's plus those routed since."""
        report = self.reports.get(replica_id)
        reported = report.num_unfinished if report else 0
        return reported + sum(r.num_choices for r in self.routed_since[replica_id])

    def num_cached_tokens(self, replica_id: str, request: RouteRequest) -> int:
        """Leading prompt tokens of `request` the replica holds, as far as the router can
        tell (the module docstring): a named session without block keys counts its whole
        prompt where its last turn went."""
        hashes = request.prefix_block_hashes
        if not hashes:
            held = self.session_replicas.get(request.session_key or "") == replica_id
            return request.num_prompt_tokens if held and request.session_key else 0
        report = self.reports.get(replica_id)
        num_blocks = report.cached_prefixes.num_cached_blocks(hashes) if report else 0
        for routed in self.routed_since[replica_id]:
            if routed.prefix_block_size == request.prefix_block_size:
                num_blocks = max(num_blocks, num_common_blocks(hashes, routed.prefix_block_hashes))
        return num_blocks * request.prefix_block_size

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
        self.record(chosen, request)
        return chosen


@dataclass
class LeastOutstandingRouter(Router):
    """Fewest unfinished requests: the last report's plus those routed since."""

    name: str = "least-outstanding"

    def _key(self, replica_id: str, request: RouteRequest) -> tuple[float, ...]:
        return (self.num_outstanding(replica_id),)


@dataclass
class PrefixAffinityRouter(Router):
    """The longest cached prefix of the prompt (`num_cached_tokens`); ties, misses included,
    to the fewest unfinished requests."""

    name: str = "prefix-affinity"

    def _key(self, replica_id: str, request: RouteRequest) -> tuple[float, ...]:
        return (-self.num_cached_tokens(replica_id, request), self.num_outstanding(replica_id))


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
        num_cached = self.num_cached_tokens(replica_id, request)
        queued_tokens = report.waiting_prompt_tokens
        queued_tokens += sum(
            r.num_prompt_tokens * r.num_choices for r in self.routed_since[replica_id]
        )
        loss_s = reader_loss_s(report, projection, request, num_cached, queued_tokens)
        return (0.0 if fits else 1.0, loss_s, projection.load)


def reader_loss_s(
    report: LoadReport,
    projection: Projection,
    request: RouteRequest,
    num_cached_tokens: int,
    queued_prompt_tokens: int = 0,
) -> float:
    """What the request's reader loses on `report`'s replica once it joins (`projection`), in
    seconds: the wait for its first token plus its stalls.

    - its first token waits for the prompt tokens queued ahead of it there
      (`queued_prompt_tokens`: its waiting requests' and those routed since its report) and for
      its own prompt less the prefix the replica caches (`num_cached_tokens`), each at the
      replica's `prefill_token_s`;
    - past Gamma (load L > 1) the replica's readers are served 1/L of their rates, so over the
      request's reading time (its output at its reader's rate) its reader stalls 1 - 1/L of
      it; within Gamma the buffers' slack absorbs the new work and no reader stalls.

    So a cached prefix draws a turn to its replica as far as the prefill it saves outweighs the
    queue it joins there."""
    read_s = request.num_output_tokens / request.rate_tps  # (0 for an eager request)
    load = projection.load
    stall_s = read_s * (1.0 - 1.0 / load) if load > 1.0 else 0.0
    own_tokens = max(request.num_prompt_tokens - num_cached_tokens, 1)
    return stall_s + (queued_prompt_tokens + own_tokens) * report.prefill_token_s


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


ROUTER_NAMES = ("round-robin", "least-outstanding", "prefix-affinity", "tokenflow")


def make_router(name: str, replica_ids: Sequence[str]) -> Router:
    """A router by name over `replica_ids`; ValueError names the valid ones."""
    routers: dict[str, type[Router]] = {
        "round-robin": RoundRobinRouter,
        "least-outstanding": LeastOutstandingRouter,
        "prefix-affinity": PrefixAffinityRouter,
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
