"""The routing rule (tokenflow/core/routing.py) as a Ray Serve request router.

Ray Serve calls `choose_replicas` for every request to the engine deployment; each candidate's
`routing_stats` hold the `LoadReport` its replica last returned from `record_routing_stats`
(every `request_routing_stats_period_s`).  A report is handed to the core router once, when it
is new, so the core router's count of what it routed since a replica's report stays right.
The chosen replica ranks first; the others follow in case it refuses the request.  A request
that replicas refused already (a 429 passed back to the ingress, which offers it again) names
them in its facts (`reports.AVOID_KEY`), and they are left out while any other is up.  A
request moved to a replica with room (the fleet's `board.MoveBoard` planned it) names that
replica (`reports.PREFER_KEY`): it goes there while it is a candidate, else the rule routes it.
"""

from __future__ import annotations

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from tokenflow.core.routing import Router, make_router
from tokenflow.replicas.reports import (
    avoided_replicas,
    facts_to_route_request,
    preferred_replica,
    report_from_stats,
)


class TokenFlowRequestRouter(RequestRouter):
    """Routes by `tokenflow.core.routing`'s rule named by `request_router_kwargs["rule"]`
    (default `tokenflow`)."""

    def initialize_state(self, **kwargs: object) -> None:
        """Ray Serve passes `request_router_kwargs` here."""
        self._rule = str(kwargs.get("rule", "tokenflow"))
        self._router: Router | None = None
        self._report_times: dict[str, float] = {}

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        """The preferred replica (a move's target) if it is a candidate, else the rule's,
        first; then the others in id order; replicas the request avoids only when no other is
        up."""
        facts, avoid, prefer = None, frozenset[str](), None
        if pending_request is not None and pending_request.args:
            facts = facts_to_route_request(pending_request.args[0])
            avoid = avoided_replicas(pending_request.args[0])
            prefer = preferred_replica(pending_request.args[0])
        candidates = [r for r in candidate_replicas if r.replica_id.unique_id not in avoid]
        candidates = candidates or candidate_replicas
        by_id = {r.replica_id.unique_id: r for r in candidates}
        ids = sorted(by_id)
        if not ids or facts is None:
            return [candidates]
        router = self._synced(ids, by_id)
        if prefer in by_id:
            chosen = prefer
            router.record(chosen, facts)  # (counted as routed there until its next report)
        else:
            chosen = router.choose(facts, candidates=ids)
        return [[by_id[chosen]], *([by_id[i]] for i in ids if i != chosen)]

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        """Nothing more goes to a dead replica."""
        super().on_replica_actor_died(replica_id)
        if self._router is not None:
            self._router.remove(replica_id.unique_id)
        self._report_times.pop(replica_id.unique_id, None)

    def _synced(self, ids: list[str], by_id: dict[str, RunningReplica]) -> Router:
        """The core router over the current replicas, with every new report handed over."""
        if self._router is None:
            self._router = make_router(self._rule, ids)
        router = self._router
        for replica_id in ids:
            router.add(replica_id)
            report = report_from_stats(by_id[replica_id].routing_stats)
            if report is not None and self._report_times.get(replica_id) != report.now_s:
                self._report_times[replica_id] = report.now_s
                router.report(replica_id, report)
        return router
