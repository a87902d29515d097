"""Routing new requests across engine replicas: the rules, on each replica's load report.

A replica reports its load every period (load_report.py, built from its `SchedulingView`); a
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

from collections.abc import Sequence
from dataclasses import dataclass, field

from tokenflow.core.load_report import LoadReport, Projection, RouteRequest, project
from tokenflow.core.prefix_summary import num_common_blocks

MAX_SESSIONS = 1 << 16  # sessions whose last replica a router remembers (the latest ones)


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
        queued_tokens = report.waiting_prompt_tokens + self._routed_prompt_tokens(
            replica_id, request
        )
        loss_s = reader_loss_s(report, projection, request, num_cached, queued_tokens)
        return (0.0 if fits else 1.0, loss_s, projection.load)

    def _routed_prompt_tokens(self, replica_id: str, request: RouteRequest) -> int:
        """Prompt tokens routed to the replica since its report, taken as queued there, but
        for `request`'s own session's earlier turns: a conversation's next turn comes once its
        client has its last answer, so that prompt is computed though no report says so yet.
        (Counted, it would queue a turn behind its own history on the replica that caches
        it, and a replica that reported sooner or priced its prefill a little cheaper would
        win the turn without its prefix.)"""
        session = request.session_key
        return sum(
            r.num_prompt_tokens * r.num_choices
            for r in self.routed_since[replica_id]
            if session is None or r.session_key != session
        )


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
      (`queued_prompt_tokens`: its waiting requests' and those routed since its report, its
      own session's earlier turns left out, `TokenFlowRouter._routed_prompt_tokens`) and for
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
