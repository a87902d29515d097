"""The adapter from vLLM's scheduler state to the core's `SchedulingView` (no vLLM import here).

vLLM owns the requests and the KV blocks; the core policy decides.  The bridge keeps, per vLLM
request that states a reading rate, a mirror `tokenflow.core.request.Request` (its output tokens
timestamped as they appear, so the reader's virtual buffer is the core's own model), and a
`KVTierManager` whose device tier mirrors vLLM's block pool:

- each mirrored request running in vLLM owns as many mirror blocks as vLLM blocks it alone
  holds: what pausing it frees (`PoolState.blocks_of`);
- requests without a rate, and vLLM's blocks that several requests hold (a prefix its cache
  shares between them), are charged to a placeholder owner, so the mirror's free count equals
  vLLM's.  A pause never counts a shared block as freed, and a stream sharing a prefix is
  priced as a whole (its pause copies, and its resume needs, all its computed tokens' blocks).

The host tier mirrors whichever connector keeps paused streams' KV, so the policy's pause
threshold and its reload-vs-recompute choice see what a pause and a resume really cost:

- **the host KV connector** (`host_kv.py`, vLLM's CPU platform): an `OFFLOAD` the connector
  stores becomes a host copy (`KVTierManager.evict`), with the real bytes per block and the
  link speed the scheduler measured.  The copy stays until vLLM runs the stream again (the
  connector loaded and released it) or the stream is dropped;
- **vLLM's `OffloadingConnector`** (`offload_pool.py`, CUDA-alike and XPU): every full block is
  written through to an LRU pool, so running mirrors' full blocks count as synced
  (`write_through`: a pause costs its unsynced tail), a pause keeps what the pool holds of the
  stream, and, since the pool may evict a paused copy (`copies_may_be_evicted`), every step
  the mirror drops a paused copy the pool no longer holds in full (`PoolState.held_tokens_of`):
  that resume is then priced, and chosen, as a recompute;
- **no connector**: the host tier is virtual.  Every `OFFLOAD` is carried out as a recompute,
  every start is a recompute (`Start.by_load` is False), the tier's size only bounds the working
  set (W_static counts device + host blocks), and the per-block "link" time follows the
  measured recompute (prefill) time of a block, so the pause threshold charges a recompute.

Requests are read through the small `VllmRequestLike` protocol, so tests can use fakes.

The plugin cannot drive the core's `Scheduler`: that owns its requests' lifecycle and its KV
blocks, which vLLM owns here.  So it shares the scheduler's parts instead: the policy, the
admission reserve's cycle (`ReserveRatio`) and the view builder (`tokenflow.core.view`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Protocol

from tokenflow.core.config import SchedulerConfig
from tokenflow.core.consumption import reader_rate_of
from tokenflow.core.estimator import StepTimeEstimator
from tokenflow.core.kv_manager import KVConfig, KVTierManager
from tokenflow.core.policies import Moves, Policy, SchedulingView
from tokenflow.core.request import Request, RequestState, SamplingParams
from tokenflow.core.view import ReserveRatio, build_view

_PREEMPTED = RequestState.PREEMPTED
OTHER_OWNER = "__vllm_unmirrored__"  # mirror blocks standing for KV the policy does not manage


class VllmRequestLike(Protocol):
    """What the bridge reads from a vLLM `Request`."""

    request_id: str
    prompt_token_ids: list[int] | None
    num_computed_tokens: int
    max_tokens: int
    num_preemptions: int

    @property
    def output_token_ids(self) -> Sequence[int]: ...


@dataclass(frozen=True)
class PoolShape:
    """vLLM's KV pool as the mirror sees it."""

    num_device_blocks: int  # usable blocks (vLLM's pool less its null block)
    block_size: int  # tokens per block
    host_factor: float  # host tier = host_factor x device blocks (bounds the working set)
    recompute_block_s: float  # seconds to recompute one block's KV (the virtual link's cost)
    # Real host tier (a connector keeps paused streams' KV): bytes of one block, all layers, K
    # and V.  None: the host tier is virtual and a pause is priced as its recompute.
    offload_block_bytes: int | None = None
    # vLLM's OffloadingConnector: running streams' full blocks are on the host already ...
    write_through: bool = False
    # ... and a paused stream's copy lasts only while the LRU pool keeps it (PoolState says).
    copies_may_be_evicted: bool = False


@dataclass(frozen=True)
class PoolState:
    """vLLM's block usage at one step."""

    num_free_blocks: int
    blocks_of: dict[str, int]  # device blocks only this mirrored running request holds
    # Evictable copies (`PoolShape.copies_may_be_evicted`): leading tokens the pool holds now of
    # each request in `PolicyBridge.paused_copy_ids`; None: copies are kept until released.
    held_tokens_of: Mapping[str, int] | None = None


class PolicyBridge:
    """Mirrors rated vLLM requests as core requests and asks the core policy for moves."""

    def __init__(
        self,
        policy: Policy,
        config: SchedulerConfig,
        shape: PoolShape,
        default_rate_tps: float | None = None,
    ) -> None:
        self.policy = policy
        self.config = config
        self.can_offload = shape.offload_block_bytes is not None
        self.write_through = self.can_offload and shape.write_through
        block_bytes = shape.offload_block_bytes or self._block_bytes(shape.recompute_block_s)
        num_host = max(0, round(shape.num_device_blocks * shape.host_factor))
        self.kv = KVTierManager(
            KVConfig(shape.num_device_blocks, num_host, shape.block_size, block_bytes)
        )
        self.estimator = StepTimeEstimator(
            config.initial_decode_step_s, config.initial_prefill_token_s
        )
        self.default_rate_tps = default_rate_tps
        self.requests: dict[str, Request] = {}
        self.reserve = ReserveRatio(config, policy.init_new_token_ratio(config))
        self.num_preemptions_total = 0
        self.num_offloads_as_recompute = 0
        self.num_offloads = 0
        self.num_copies_lost = 0  # paused copies the offloading pool evicted before the resume
        self._num_seen = 0

    # -- requests in and out ----------------------------------------------------------------------
    def rate_of(self, extra_args: dict | None) -> float | None:
        """The reading rate from `vllm_xargs.stream_rate`, else the server default (None: vLLM's
        own behaviour).  A malformed rate counts as absent."""
        rate = reader_rate_of((extra_args or {}).get("stream_rate"))
        return self.default_rate_tps if rate is None else rate

    def track(self, request: VllmRequestLike, rate_tps: float, now_s: float) -> Request:
        """Start mirroring a new vLLM request read at `rate_tps`."""
        mirror = Request(
            request_id=request.request_id,
            prompt_token_ids=tuple(request.prompt_token_ids or (0,)),
            sampling_params=SamplingParams(max_tokens=max(1, request.max_tokens)),
            rate_tps=rate_tps,
            arrival_s=now_s,
            arrival_index=self._num_seen,
        )
        self._num_seen += 1
        self.requests[request.request_id] = mirror
        return mirror

    def forget(self, request_id: str) -> None:
        """The request finished or was aborted: drop its mirror and its mirror blocks."""
        if self.requests.pop(request_id, None) is not None:
            self.kv.drop(request_id)

    @property
    def has_requests(self) -> bool:
        return bool(self.requests)

    @property
    def num_requests_seen(self) -> int:
        return self._num_seen

    @property
    def paused_copy_ids(self) -> list[str]:
        """Paused mirrors with a host copy, in arrival order (what `held_tokens_of` covers)."""
        return [
            request_id
            for request_id, request in self.requests.items()
            if request.state is _PREEMPTED and self.kv.synced_tokens(request_id)
        ]

    # -- one step -------------------------------------------------------------------------------
    def view(
        self,
        running: Iterable[VllmRequestLike],
        waiting: Iterable[VllmRequestLike],
        pool: PoolState,
        now_s: float,
    ) -> SchedulingView:
        """Bring the mirrors up to date with vLLM's queues and return the policy's view."""
        mirrored_running = self._sync(running, now_s, is_running=True)
        self.kv.free_device(OTHER_OWNER)  # re-charged below, after the mirrored requests
        on_device = {r.request_id for r in mirrored_running}
        for request_id, request in self.requests.items():
            if request_id not in on_device and self.kv.num_device_blocks_of(request_id):
                self.kv.free_device(request_id)
                request.num_computed_tokens = 0
        for request in mirrored_running:
            if not self.write_through and self.kv.synced_tokens(request.request_id):
                self.kv.drop(request.request_id)  # resumed: the connector released the copy
            self._resize(request.request_id, pool.blocks_of.get(request.request_id, 0))
        if self.write_through:  # vLLM stores every full block as it is computed
            # (counted up to the blocks a mirror holds: a shared prefix is the placeholder's)
            candidates = [
                (r.request_id, min(r.num_computed_tokens, self._tokens_held(r.request_id)))
                for r in mirrored_running
            ]
            self.kv.plan_write_through(candidates, self.kv.config.num_host_blocks)
        if pool.held_tokens_of is not None:
            self._drop_lost_copies(pool.held_tokens_of)
        self._charge_unmirrored(pool.num_free_blocks)
        if not self.can_offload:
            self._price_recompute()
        off_device = self._sync(waiting, now_s, is_running=False)
        preempted = sorted((r for r in off_device if r.state is _PREEMPTED), key=_fcfs)
        return build_view(
            self,
            now_s,
            sorted(mirrored_running, key=_fcfs),
            preempted,
            sorted((r for r in off_device if r.state is not _PREEMPTED), key=_fcfs),
            sum(r.num_remaining_output_tokens for r in mirrored_running),
        )

    def plan(self, view: SchedulingView) -> Moves:
        """The core policy's moves for this step (and the new-token ratio's decay)."""
        moves = self.policy.plan_moves(view)
        self.reserve.decay()
        return moves

    def preempted(self, request_id: str, num_offloaded_tokens: int = 0) -> None:
        """vLLM preempted a mirrored request: by recompute (its KV is gone), or, with
        `num_offloaded_tokens`, after storing that many tokens' KV on the host."""
        request = self.requests.get(request_id)
        if request is None:
            return
        offloaded = num_offloaded_tokens > 0 and self._evict(request_id, num_offloaded_tokens)
        if not offloaded:
            self.kv.drop(request_id)  # its KV is gone (a write-through copy included)
        request.state = RequestState.PREEMPTED
        request.num_computed_tokens = num_offloaded_tokens if offloaded else 0
        self.num_offloads += offloaded
        request.num_preemptions += 1
        self.num_preemptions_total += 1

    def discarded(self, request_id: str) -> None:
        """A paused stream's host copy was dropped (it resumes by recompute)."""
        request = self.requests.get(request_id)
        if request is not None and request.state is _PREEMPTED:
            self.kv.drop(request_id)
            request.num_computed_tokens = 0

    def _drop_lost_copies(self, held_tokens_of: Mapping[str, int]) -> None:
        """A paused copy the pool no longer holds in full is dropped: the resume is priced as a
        recompute (what vLLM still loads of it only makes that resume cheaper)."""
        for request_id, held_tokens in held_tokens_of.items():
            request = self.requests.get(request_id)
            if request is None or request.state is not _PREEMPTED:
                continue
            synced_tokens = self.kv.synced_tokens(request_id)
            if synced_tokens and synced_tokens > held_tokens:
                self.kv.drop(request_id)
                request.num_computed_tokens = 0
                self.num_copies_lost += 1

    def _evict(self, request_id: str, num_tokens: int) -> bool:
        """Move the mirror's blocks to its host tier (vLLM stored them this step)."""
        self.kv.drop(request_id)  # any older host copy
        # The copy covers the blocks the stream shares too, which the placeholder holds until
        # the next view charges it again: release it so they can be counted here.
        self.kv.free_device(OTHER_OWNER)
        self._resize(request_id, self.kv.blocks_for(num_tokens))
        if self.kv.evict(request_id, num_tokens) is None:
            return False
        self.kv.end_step()  # the stores run before the next forward pass: blocks are free now
        return True

    def out_of_memory(self) -> None:
        """vLLM retracted a request for lack of blocks: admit less eagerly again (as the core)."""
        self.reserve.reset()

    def observe_step(
        self,
        num_decode: int,
        num_prefill_tokens: int,
        duration_s: float,
        decode_context_tokens: int = 0,
    ) -> None:
        """Feed one measured engine step to the step-time estimator (`decode_context_tokens`:
        summed over the decoding streams, as the native engine reports it)."""
        self.estimator.observe(num_decode, num_prefill_tokens, duration_s, decode_context_tokens)

    # -- helpers --------------------------------------------------------------------------------
    def _sync(
        self, requests: Iterable[VllmRequestLike], now_s: float, is_running: bool
    ) -> list[Request]:
        mirrors: list[Request] = []
        for vllm_request in requests:
            mirror = self.requests.get(vllm_request.request_id)
            if mirror is None:
                continue
            outputs = vllm_request.output_token_ids
            for index in range(mirror.num_output_tokens, len(outputs)):
                mirror.append_token(outputs[index], now_s)
            if is_running:
                mirror.state = RequestState.RUNNING
                computed = vllm_request.num_computed_tokens
                mirror.num_computed_tokens = min(computed, mirror.num_tokens)
            else:
                started = mirror.output_token_ids or vllm_request.num_preemptions
                mirror.state = RequestState.PREEMPTED if started else RequestState.WAITING
                # A paused stream with a host copy resumes from it (the core's convention).
                mirror.num_computed_tokens = self.kv.synced_tokens(mirror.request_id)
            mirrors.append(mirror)
        return mirrors

    def _block_bytes(self, recompute_block_s: float) -> int:
        """Virtual bytes per block such that a pause's evict + load round trip over the virtual
        link (2 x blocks x block_bytes / link bandwidth) costs one recompute of those blocks."""
        return max(1, round(recompute_block_s / 2 * self.config.link_bytes_per_s))

    def _price_recompute(self) -> None:
        """Follow the measured prefill cost: the policy's pause threshold then charges a pause
        what its recompute costs on this engine now (re-priced when it moves by over 10%): per
        block, at the recent prefills' mean cost per token (their fixed cost spread over them)."""
        recompute_block_s = self.estimator.prefill_mean_token_s * self.kv.block_size
        block_bytes = self._block_bytes(recompute_block_s)
        if abs(block_bytes - self.kv.config.block_bytes) > 0.1 * self.kv.config.block_bytes:
            self.kv.config = replace(self.kv.config, block_bytes=block_bytes)

    def _tokens_held(self, request_id: str) -> int:
        return self.kv.num_device_blocks_of(request_id) * self.kv.block_size

    def _resize(self, owner: str, num_blocks: int) -> None:
        if self.kv.num_device_blocks_of(owner) > num_blocks:
            self.kv.free_device(owner)
        if num_blocks:
            self.kv.allocate(owner, num_blocks * self.kv.block_size)

    def _charge_unmirrored(self, num_free_blocks: int) -> None:
        """Make the mirror's free count equal vLLM's by resizing the placeholder owner."""
        total = self.kv.config.num_device_blocks
        current = self.kv.num_device_blocks_of(OTHER_OWNER)
        mirrored = total - self.kv.num_free_device_blocks - current
        target = max(0, total - num_free_blocks - mirrored)
        self._resize(OTHER_OWNER, min(target, self.kv.num_free_device_blocks + current))


def _fcfs(request: Request) -> tuple[float, int]:
    return request.sort_key
