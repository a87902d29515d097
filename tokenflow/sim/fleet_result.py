"""What a fleet run reports (tokenflow/sim/fleet.py): one summary over every request, each
replica's share, the moves made, and the prefix cache and conversations over the fleet."""

from __future__ import annotations

from dataclasses import dataclass

from tokenflow.core.rebalance import StreamKind
from tokenflow.eval.metrics import RequestTrace, Summary
from tokenflow.sim.arrivals import SessionStats
from tokenflow.sim.runner import PrefixCacheStats


@dataclass(frozen=True)
class MoveRecord:
    """One move made (a queued request or a started stream: `kind`): planned at `planned_s` (a
    round of the rule), exported from its source at `exported_s` (the end of the source's step
    then), landed on its target at `landed_s`."""

    request_id: str
    kind: StreamKind
    source_id: str
    target_id: str
    planned_s: float
    exported_s: float
    landed_s: float


@dataclass(frozen=True)
class FleetResult:
    router: str
    summary: Summary  # over every request of the fleet, as a single engine's
    num_requests_by_replica: tuple[int, ...]  # routed to each replica (every one that joined)
    ttft_p99_by_replica_s: tuple[float, ...]
    wall_s: float
    moves: tuple[MoveRecord, ...] = ()  # in the order made (a request may move more than once)
    num_cut: int = 0  # streams a leaving replica cut at its drain deadline
    traces: tuple[RequestTrace, ...] = ()  # every request's, as the summary reads them
    prefix_cache: PrefixCacheStats | None = None  # every replica's lookups (None: no cache)
    sessions: SessionStats | None = None  # the workload's conversations (None: it has none)

    @property
    def num_moved(self) -> int:
        return len(self.moves)
