"""What the layers above the engine read of it: what it serves with (`EngineDescription`, for
the start-up log) and its load (`core/load_report.py`'s report, `core/rebalance.py`'s replica load).

These are results and frozen records, never the scheduler: `AsyncEngine` takes the loads on its
engine thread, the one thread that may read engine state, and hands them over.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tokenflow.core.load_report import LoadReport, load_report
from tokenflow.core.rebalance import ReplicaLoad, replica_load

if TYPE_CHECKING:
    from tokenflow.core.scheduler import Scheduler
    from tokenflow.engine.llm_engine import LLMEngine

# (the engine's clock now, the ids of its unfinished requests) -> when each request that moved
# to this engine reached it, on the engine's clock
Landings = Callable[[float, Collection[str]], Mapping[str, float]]


@dataclass(frozen=True)
class EngineDescription:
    """What an engine serves with; fixed once it is built, so any thread may read it."""

    model_name: str
    device: str  # "cpu", "cuda:0"
    executor: str  # "torch" or "llama-cpp"
    policy: str
    kernels: str | None  # the kernel choice in one line (our PyTorch model's); None: not ours
    max_model_len: int  # the served context: prompt + output tokens
    block_size: int  # tokens per KV block
    num_device_blocks: int
    num_host_blocks: int

    @property
    def device_kv_tokens(self) -> int:
        return self.num_device_blocks * self.block_size

    @property
    def host_kv_tokens(self) -> int:
        return self.num_host_blocks * self.block_size

    def lines(self) -> list[str]:
        """The start-up log's summary: what runs where, the KV tiers, the kernels."""
        lines = [
            f"{self.model_name} on {self.device}: {self.executor} executor, policy "
            f"{self.policy}, context {self.max_model_len} tokens",
            f"KV tiers: device {self.device_kv_tokens} tokens ({self.num_device_blocks} blocks "
            f"of {self.block_size}), host {self.host_kv_tokens} tokens "
            f"({self.num_host_blocks} blocks)",
        ]
        if self.kernels is not None:
            lines.append(self.kernels)
        return lines


def describe(llm: LLMEngine) -> EngineDescription:
    """`llm`'s description (read once it is built, before any step)."""
    kv = llm.scheduler.kv.config
    return EngineDescription(
        model_name=llm.model_name,
        device=str(llm.device),
        executor=llm.args.executor,
        policy=llm.args.policy,
        kernels=llm.kernels,
        max_model_len=llm.max_model_len,
        block_size=kv.block_size,
        num_device_blocks=kv.num_device_blocks,
        num_host_blocks=kv.num_host_blocks,
    )


def measure_load(scheduler: Scheduler, now_s: float) -> LoadReport:
    """The scheduler's load report at `now_s` (on the thread that owns it)."""
    return load_report(scheduler.view(now_s))


def measure_replica_load(
    scheduler: Scheduler,
    now_s: float,
    replica_id: str,
    movable_ids: Collection[str],
    reached_s: Landings,
) -> ReplicaLoad:
    """The replica's load at `now_s` and its queued requests and paused streams among
    `movable_ids`, each waiting since `reached_s` says it reached this engine, else since its
    arrival (on the thread that owns the scheduler)."""
    view = scheduler.view(now_s)
    reached = reached_s(now_s, frozenset(scheduler.requests))
    return replica_load(replica_id, view, reached, movable_ids=movable_ids)
