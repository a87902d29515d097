"""What a scheduling policy sees and decides, and the FCFS admission they all fall back on.

A policy never changes state: it returns `Moves` (which resident requests to preempt and how,
which others to start and how) and the scheduler carries them out, stopping at the first start
that does not fit.  Mechanism (block allocation, copies, OOM handling) lives in the scheduler.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from tokenflow.core.config import SchedulerConfig
from tokenflow.core.estimator import StepTimeEstimator
from tokenflow.core.kv_manager import KVConfig, PrefixHit
from tokenflow.core.prefix_summary import PrefixSummary
from tokenflow.core.request import PreemptMode, Request, RequestState


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
    def find_prefix(
        self, token_ids: Sequence[int], block_hashes: Sequence[int] | None = None
    ) -> PrefixHit: ...
    def num_private_device_blocks(self, request_id: str) -> int: ...
    def num_charged_device_blocks(self, request_id: str) -> float: ...
    def cached_free_block_ids(self, hit: PrefixHit) -> tuple[int, ...]: ...
    def prefix_summary(self, max_keys_per_tier: int) -> PrefixSummary: ...


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
    # Prefix lookups of waiting requests, made once per view (`prefix_hit`), and which of the
    # waiting requests pays for the cached-free blocks their hits share (`shared_blocks`).
    _hits: dict[str, PrefixHit] = field(default_factory=dict, compare=False, repr=False)
    _claims: dict[str, int] = field(default_factory=dict, compare=False, repr=False)
    _claimed: set[int] = field(default_factory=set, compare=False, repr=False)

    @property
    def seconds_per_block(self) -> float:
        """Link time of one block, one direction."""
        return self.kv.config.block_bytes / self.config.link_bytes_per_s

    @property
    def num_queued_io_blocks(self) -> int:
        """Blocks the link must move before a new load starts: the eviction queue and the
        blocks of loads in flight not yet copied."""
        return self.kv.num_evicting_blocks + self.kv.num_queued_load_blocks

    def loads_faster(self, num_blocks: int, num_tokens: int, queued_blocks: int) -> bool:
        """Whether loading `num_blocks` from the host, behind `queued_blocks` on the link, takes
        no longer than computing `num_tokens` tokens (the rule for resumes and host hits)."""
        io_s = (queued_blocks + num_blocks) * self.seconds_per_block
        return io_s <= self.estimator.prefill_time_s(num_tokens)

    def prefix_hit(self, request: Request) -> PrefixHit:
        """What the tiers cache of a waiting request's prompt (nothing for another state, or
        one that computes its whole prompt: `Request.computes_whole_prompt`)."""
        hit = self._hits.get(request.request_id)
        if hit is None:
            kv = self.kv
            if (
                kv.config.prefix_caching
                and request.state is RequestState.WAITING
                and not request.computes_whole_prompt
            ):
                hashes = request.prompt_block_hashes(kv.block_size)
                hit = kv.find_prefix(request.prompt_token_ids, hashes)
            else:
                hit = PrefixHit((), (), (), kv.block_size)
            self._hits[request.request_id] = hit
        return hit

    def loads_prefix(self, request: Request) -> bool:
        """Whether a waiting request loads the host's part of its cached prefix (it has one and
        loading it is faster than computing it)."""
        hit = self.prefix_hit(request)
        num_blocks = hit.num_host_load_blocks
        return bool(num_blocks) and self.loads_faster(
            num_blocks, num_blocks * hit.block_size, self.num_queued_io_blocks
        )

    def start_tokens(self, request: Request) -> int:
        """Tokens a start computes: none for a reload, else its tokens less the cached prefix
        it starts from."""
        if request.state is not RequestState.WAITING:
            computed = request.num_computed_tokens
            return 0 if self.kv.has_host_copy(request.request_id, computed) else request.num_tokens
        cached = self.prefix_hit(request).num_cached_tokens(self.loads_prefix(request))
        return request.num_tokens - cached

    def shared_blocks(self, request: Request) -> float:
        """Device blocks of a request that it shares with others, each counted at its share:
        a resident's blocks held by k tables count 1/k each in its footprint, so sums over
        residents count a shared block once.  A waiting request's cached prefix counts nothing
        where residents hold it, and neither does its cached-free part where an earlier waiting
        request's prefix has it too (the first in the queue pays for it)."""
        kv = self.kv
        if not kv.config.prefix_caching:
            return 0.0
        if request.state is not RequestState.WAITING:
            rid = request.request_id
            return kv.num_device_blocks_of(rid) - kv.num_charged_device_blocks(rid)
        hit = self.prefix_hit(request)
        free_ids = kv.cached_free_block_ids(hit)
        return len(hit.device_block_ids) - len(free_ids) + self._claimed_before(request)

    def _claimed_before(self, request: Request) -> int:
        """Cached-free blocks of a waiting request's hit that an earlier waiting request's hit
        has too (the queue is scanned once per view, as far as asked)."""
        claims = self._claims
        if request.request_id not in claims:
            claimed, kv = self._claimed, self.kv
            for waiting in self.waiting[len(claims) :]:
                free_ids = kv.cached_free_block_ids(self.prefix_hit(waiting))
                claims[waiting.request_id] = sum(1 for b in free_ids if b in claimed)
                claimed.update(free_ids)
                if waiting is request:
                    break
        return claims.get(request.request_id, 0)

    def start_for(self, request: Request) -> Start:
        """Load when the host tier holds the request's KV, else recompute it; a waiting request
        computes, loading the host's part of its cached prefix when that is faster."""
        if request.state is RequestState.WAITING:
            return Start(request.request_id, self.loads_prefix(request))
        by_load = self.kv.has_host_copy(request.request_id, request.num_computed_tokens)
        return Start(request.request_id, by_load)

    def start_blocks(self, request: Request) -> int:
        """Device blocks a start takes from the free ones (a decode's next block comes later):
        the host copy's blocks for a load, else the request's tokens, less the cached prefix
        that residents hold (it shares those)."""
        computed = request.num_computed_tokens
        if request.state is not RequestState.WAITING:
            by_load = self.kv.has_host_copy(request.request_id, computed)
            return self.kv.blocks_for(computed if by_load else request.num_tokens)
        return self.kv.blocks_for(request.num_tokens) - int(self.shared_blocks(request))

    def reserve_blocks(self, request: Request) -> int:
        """Blocks kept free for a request's future tokens (SGLang's new-token ratio); the
        scheduler keeps the residents' reserve as `num_reserved_blocks` (their remaining
        max_tokens summed in tokens, then rounded up to blocks, as SGLang does)."""
        remaining = request.num_remaining_output_tokens
        return self.kv.blocks_for(int(remaining * self.new_token_ratio))


class WaitReason(enum.Enum):
    """Why an unfinished request is off the device (`Policy.wait_reason`)."""

    QUEUED = "queued"  # not started: admission holds it (memory, reading rate, prefill budget)
    BUFFERED = "buffered"  # paused while its reader reads its buffer; back before it runs dry
    OVERLOAD = "overload"  # left out of the served set while the engine is overloaded
    MEMORY = "memory"  # paused because decoding found no free device block


class Policy:
    """Base policy: FCFS admission with a conservative memory reserve, no write-through."""

    name = "base"
    prefill_chunk_tokens: int | None = None  # None: prefill-first, whole prompts

    def plan_moves(self, view: SchedulingView) -> Moves:
        """Decide this step's preemptions and starts."""
        return Moves(starts=tuple(fcfs_starts(view)))

    def wait_reason(self, request: Request) -> WaitReason | None:
        """Why `request` is off the device now; None while it is on it (running, loading)."""
        if request.state is RequestState.WAITING:
            return WaitReason.QUEUED
        if request.state is RequestState.PREEMPTED:
            return WaitReason.MEMORY
        return None

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
        tokens = view.start_tokens(request)
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
