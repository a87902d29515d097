"""What a scheduling policy sees and decides, and the FCFS admission they all fall back on.

A policy never changes state: it returns `Moves` (which resident requests to preempt and how,
which others to start and how) and the scheduler carries them out, stopping at the first start
that does not fit.  Mechanism (block allocation, copies, OOM handling) lives in the scheduler.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

from tokenflow.core.config import SchedulerConfig
from tokenflow.core.estimator import StepTimeEstimator
from tokenflow.core.kv_manager import KVConfig
from tokenflow.core.request import PreemptMode, Request


# Preemption and Start are treated as immutable; not frozen because frozen dataclasses are
# slow to build and a decision makes one per stream it moves.
@dataclass(slots=True)
class Preemption:
    request_id: str
    mode: PreemptMode


@dataclass(slots=True)
class Start:
    """Bring a request onto the device: by loading its host KV, or by (re)computing it."""

    request_id: str
    by_load: bool


@dataclass(frozen=True)
class Moves:
    preemptions: tuple[Preemption, ...] = ()
    starts: tuple[Start, ...] = ()


class KVState(Protocol):
    """What a policy may read of the KV tiers (`KVTierManager` is one); it never changes them."""

    config: KVConfig
    block_size: int

    def blocks_for(self, num_tokens: int) -> int: ...
    @property
    def num_free_device_blocks(self) -> int: ...
    @property
    def num_free_host_blocks(self) -> int: ...
    @property
    def device_usage(self) -> float: ...
    def num_device_blocks_of(self, request_id: str) -> int: ...
    def synced_tokens(self, request_id: str) -> int: ...
    def has_host_copy(self, request_id: str, num_tokens: int) -> bool: ...
    @property
    def num_evicting_blocks(self) -> int: ...
    @property
    def num_queued_load_blocks(self) -> int: ...


@dataclass(frozen=True)
class SchedulingView:
    """The state a policy decides on: the requests by state (each list in first-come-first-
    served order), the KV tiers read-only, the step-time estimator, the limits and the time."""

    now_s: float
    running: Sequence[Request]  # resident on the device: RUNNING or LOADING
    preempted: Sequence[Request]  # started once, now off the device
    waiting: Sequence[Request]  # never started
    kv: KVState
    estimator: StepTimeEstimator
    config: SchedulerConfig
    new_token_ratio: float  # the admission reserve's share of each request's remaining output
    num_reserved_blocks: int  # kept free for the residents' future tokens (`reserve_blocks`)
    num_preemptions_total: int
    num_requests_seen: int

    def start_for(self, request: Request) -> Start:
        """Load when the host tier holds the request's KV, else recompute it."""
        by_load = self.kv.has_host_copy(request.request_id, request.num_computed_tokens)
        return Start(request.request_id, by_load)

    def start_blocks(self, request: Request) -> int:
        """Device blocks a start needs (a decode's next block comes later): the host copy's
        blocks for a load, else the request's tokens."""
        computed = request.num_computed_tokens
        by_load = self.kv.has_host_copy(request.request_id, computed)
        return self.kv.blocks_for(computed if by_load else request.num_tokens)

    def reserve_blocks(self, request: Request) -> int:
        """Blocks kept free for a request's future tokens (SGLang's new-token ratio); the
        scheduler keeps the residents' reserve as `num_reserved_blocks` (their remaining
        max_tokens summed in tokens, then rounded up to blocks, as SGLang does)."""
        remaining = request.num_remaining_output_tokens
        return self.kv.blocks_for(int(remaining * self.new_token_ratio))


class Policy:
    """Base policy: FCFS admission with a conservative memory reserve, no write-through."""

    name = "base"
    prefill_chunk_tokens: int | None = None  # None: prefill-first, whole prompts

    def plan_moves(self, view: SchedulingView) -> Moves:
        """Decide this step's preemptions and starts."""
        return Moves(starts=tuple(fcfs_starts(view)))

    def init_new_token_ratio(self, config: SchedulerConfig) -> float:
        """Where the admission reserve's new-token ratio starts, and returns to after an
        out-of-memory retraction (it decays to `config.min_new_token_ratio`)."""
        return config.init_new_token_ratio

    def choose_oom_victim(self, candidates: list[Request], view: SchedulingView) -> Preemption:
        """Pick the request to retract when decode growth finds no free block (SGLang's rule:
        fewest generated tokens, then longest prompt, then latest arrival), by recompute."""
        victim = min(
            candidates,
            key=lambda r: (
                r.num_output_tokens,
                -r.num_prompt_tokens,
                -r.arrival_s,
                -r.arrival_index,
            ),
        )
        return Preemption(victim.request_id, PreemptMode.RECOMPUTE)

    def write_through_order(
        self, view: SchedulingView, pending: Iterable[Request]
    ) -> list[Request]:
        """Which of `pending` (running streams with a full block not yet on the host) to copy
        first; none here (no write-through)."""
        return []


def fcfs_starts(
    view: SchedulingView,
    max_prefill_tokens: int | None = None,
    candidates: Sequence[Request] | None = None,
    max_num_seqs: int | None = None,
) -> list[Start]:
    """Starts while they fit beside the reserve of every resident request.

    Candidates default to the preempted and waiting requests in arrival order.  Strict order:
    stops at the first candidate that does not fit (no overtaking).  The prefill tokens started
    together are capped by `max_prefill_tokens`, the residents by `max_num_seqs` (defaults:
    the config's).
    """
    if max_prefill_tokens is None:
        max_prefill_tokens = view.config.max_prefill_tokens
    if max_num_seqs is None:
        max_num_seqs = view.config.max_num_seqs
    if candidates is None:
        # Both queues are in arrival order: with none paused (most steps of a baseline) the
        # merge is the waiting queue itself.
        if view.preempted:
            candidates = sorted([*view.preempted, *view.waiting], key=lambda r: r.sort_key)
        else:
            candidates = view.waiting
    if not candidates or view.start_blocks(candidates[0]) > view.kv.num_free_device_blocks:
        return []  # cheap exit before summing the reserve: the head does not fit anyway
    free = view.kv.num_free_device_blocks - view.num_reserved_blocks
    num_resident = len(view.running)
    prefill_tokens = 0
    starts: list[Start] = []
    for request in candidates:
        start = view.start_for(request)
        need = view.start_blocks(request)
        tokens = 0 if start.by_load else request.num_tokens
        if num_resident >= max_num_seqs:
            break
        if need + view.reserve_blocks(request) > free:
            break
        if starts and prefill_tokens + tokens > max_prefill_tokens:
            break
        starts.append(start)
        free -= need + view.reserve_blocks(request)
        prefill_tokens += tokens
        num_resident += 1
    return starts
