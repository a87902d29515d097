"""`TokenFlowScheduler`: vLLM's async scheduler, with TokenFlow's core policy deciding who runs.

Use with `--scheduler-cls tokenflow.integrations.vllm.TokenFlowScheduler`.  Each step:

1. the bridge brings its mirrors of the rated requests up to date and builds the core's view;
2. the core policy (`make_policy("tokenflow", ...)`, the same object the native engine uses)
   returns `Moves`: preemptions and starts;
3. preemptions are carried out with vLLM's `_preempt_request`.  With the host KV connector
   (`host_kv.py`, which `serve` enables on vLLM's CPU platform) an `OFFLOAD` first plans the
   store of the stream's blocks, and vLLM loads them back when the stream resumes; a start the
   policy makes by recompute drops the copy.  With vLLM's `OffloadingConnector` (`serve`'s
   choice on CUDA-alike and XPU platforms, `offload_pool.py`) the blocks are written through
   as they are computed, a pause keeps what the pool holds, and the pool is asked each step
   whether it still holds the paused copies.  Without either (or with no host copy) a pause is
   a **recompute**, counted and logged as such;
4. only the policy's starts (and requests without a rate) are left in the waiting queue while
   vLLM's own `schedule()` runs; the others are held back and put back in order afterwards.

vLLM keeps everything else: token budgets, chunked prefill, block allocation, its prefix cache
(a request the policy starts looks up its prompt's cached blocks as any other), and its own
out-of-memory preemption.  Without any rated request the step is vLLM's, unchanged.

With prefix caching, requests share the blocks of a common prefix: the policy is told, per
rated running request, only the blocks it alone holds (`num_blocks_freed_by`), which is what
pausing it returns to vLLM's pool; the shared ones stay with the other holders.
"""

from __future__ import annotations

import time
from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass

from vllm.logger import init_logger
from vllm.platforms import current_platform
from vllm.v1.core.kv_cache_utils import KVCacheBlock
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.request_queue import create_request_queue
from vllm.v1.request import Request, RequestStatus

from tokenflow.core.policies import Moves, make_policy
from tokenflow.core.request import PreemptMode
from tokenflow.integrations.vllm.bridge import PolicyBridge, PoolShape, PoolState
from tokenflow.integrations.vllm.host_kv import HostKVConnector, kv_block_bytes
from tokenflow.integrations.vllm.offload_pool import OffloadPool
from tokenflow.integrations.vllm.settings import IntegrationSettings


@dataclass(frozen=True)
class StepStamp:
    """A scheduled step, until its output comes back."""

    scheduled_s: float  # monotonic time schedule() returned
    num_decode_context_tokens: int  # summed over the step's decoding streams


# Under "vllm." so that vLLM's logging configuration (handler, level, format) applies.
logger = init_logger("vllm.tokenflow.scheduler")


def num_blocks_freed_by(blocks: Sequence[KVCacheBlock]) -> int:
    """Blocks of one request's table (one KV cache group) that no other request holds: those
    that freeing the request (a pause, a finish) returns to the pool.  A prefix-cache hit shares
    a run of leading blocks, so blocks others hold lead the table (reference counts never grow
    along it) and the request's own ones follow: found by bisection, O(log blocks) a step."""
    return len(blocks) - bisect_left(blocks, True, key=_is_held_alone)


def _is_held_alone(block: KVCacheBlock) -> bool:
    return block.ref_cnt == 1 and not block.is_null  # (the null block is never freed)


class TokenFlowScheduler(AsyncScheduler):
    """vLLM scheduler whose admission and preemption come from TokenFlow's core policy."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        settings = IntegrationSettings.from_additional_config(self.vllm_config.additional_config)
        connector = self.connector
        self.host_kv = connector if isinstance(connector, HostKVConnector) else None
        self.offload_pool = OffloadPool.of(connector, kv_block_bytes(self.kv_cache_config))
        core_config = settings.core_config(
            max_num_seqs=self.scheduler_config.max_num_seqs,
            max_prefill_tokens=self.scheduler_config.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            **self._link_speed(settings),
        )
        shape = self._pool_shape(settings, core_config.initial_prefill_token_s)
        tokenflow = settings.policy_config(current_platform.device_type)
        policy = make_policy("tokenflow", core_config, tokenflow)
        self.bridge = PolicyBridge(policy, core_config, shape, settings.default_rate_tps)
        self._scheduled_at: dict[int, StepStamp] = {}
        self._last_update_s = 0.0
        logger.info(
            "TokenFlow scheduler: %d blocks of %d tokens, default rate %s, pauses %s",
            shape.num_device_blocks,
            self.block_size,
            settings.default_rate_tps,
            self._pauses_in_words(shape, core_config.link_bytes_per_s),
        )

    def _pool_shape(self, settings: IntegrationSettings, prefill_token_s: float) -> PoolShape:
        """The device pool, and the host tier of the connector in use (none: a virtual one)."""
        num_device_blocks = self.cache_config.num_gpu_blocks - 1  # less vLLM's null block
        host, pool = self.host_kv, self.offload_pool
        host_factor, block_bytes = settings.host_factor, None  # no connector: a virtual tier
        if host is not None:
            host_factor, block_bytes = host.num_host_blocks / num_device_blocks, host.block_bytes
        elif pool is not None:
            host_factor, block_bytes = pool.num_blocks / num_device_blocks, pool.block_bytes
        return PoolShape(
            num_device_blocks=num_device_blocks,
            block_size=self.block_size,
            host_factor=host_factor,
            recompute_block_s=prefill_token_s * self.block_size,
            offload_block_bytes=block_bytes,
            write_through=pool is not None and pool.offloads_decode_blocks,
            copies_may_be_evicted=pool is not None,
        )

    def _pauses_in_words(self, shape: PoolShape, link_bytes_per_s: float) -> str:
        if self.host_kv is None and self.offload_pool is None:
            return "by recompute (no KV offload connector: OFFLOAD moves fall back to recompute)"
        kind = "host KV connector" if self.host_kv else "vLLM OffloadingConnector (LRU pool)"
        words = (
            f"offload to {round(shape.host_factor * shape.num_device_blocks)} host blocks "
            f"({kind}) at {link_bytes_per_s / 1e9:.1f} GB/s"
        )
        if self.offload_pool is not None and not self.offload_pool.offloads_decode_blocks:
            words += "; offload_prompt_only is set: decoded KV is recomputed on resume"
        return words

    def _link_speed(self, settings: IntegrationSettings) -> dict[str, float]:
        """The host link's speed for the policy's pause and reload costs: as configured, else
        (KV pool in host memory, vLLM's CPU platform) the connector's copy path, measured."""
        if self.host_kv is None or "link_bytes_per_s" in settings.scheduler:
            return {}
        if not current_platform.is_cpu():
            return {}  # the core default: a PCIe-class link
        return {"link_bytes_per_s": self.host_kv.measure_copy_bytes_per_s()}

    # -- requests in and out ----------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        """vLLM's add_request; a request with a reading rate is also mirrored for the policy."""
        is_new = request.request_id not in self.requests
        super().add_request(request)
        params = request.sampling_params
        if not is_new or params is None:
            return
        rate = self.bridge.rate_of(params.extra_args)
        if rate is not None:
            self.bridge.track(request, rate, time.monotonic())
            logger.info("request %s: stream_rate %.3g tok/s", request.request_id, rate)

    def _free_request(self, request: Request, delay_free_blocks: bool = False):
        """vLLM's _free_request (finish or abort); the mirror goes too."""
        self.bridge.forget(request.request_id)
        return super()._free_request(request, delay_free_blocks)

    # -- a step ---------------------------------------------------------------------------------
    def schedule(self, throttle_prefills: bool = False) -> SchedulerOutput:
        """Apply the core policy's moves, then run vLLM's schedule on the allowed requests."""
        if not self.bridge.has_requests:
            return self._stamp(super().schedule(throttle_prefills))
        now = time.monotonic()
        view = self.bridge.view(self.running, self.waiting, self._pool_state(), now)
        moves = self.bridge.plan(view)
        policy_preempted = self._preempt(moves, now)
        self._drop_unwanted_copies(moves)
        orig = list(self.waiting)
        held = self._hold_back(moves, orig)
        try:
            output = super().schedule(throttle_prefills)
        finally:
            self._restore(orig, held)
        oom = sorted(set(output.preempted_req_ids or ()) - policy_preempted)
        for request_id in oom:
            pool = self.offload_pool  # the pool may hold what it wrote through
            held = pool.held_tokens(self.requests[request_id]) if pool else 0
            self.bridge.preempted(request_id, held)
        if oom:
            self.bridge.out_of_memory()
        return self._stamp(output)

    def _pool_state(self) -> PoolState:
        manager = self.kv_cache_manager
        blocks_of = {}
        for request in self.running:
            if request.request_id in self.bridge.requests:
                groups = manager.get_blocks(request.request_id).blocks
                blocks_of[request.request_id] = num_blocks_freed_by(groups[0]) if groups else 0
        held_tokens_of = None
        if self.offload_pool is not None:
            held_tokens_of = {
                request_id: self.offload_pool.held_tokens(self.requests[request_id])
                for request_id in self.bridge.paused_copy_ids
                if request_id in self.requests
            }
        return PoolState(manager.block_pool.get_num_free_blocks(), blocks_of, held_tokens_of)

    def _preempt(self, moves: Moves, now: float) -> set[str]:
        done: set[str] = set()
        for preemption in moves.preemptions:
            request = self.requests.get(preemption.request_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue
            if request not in self.running or not self._request_blocks_can_be_freed(request):
                continue
            offload = preemption.mode is PreemptMode.OFFLOAD
            num_stored = self._store(request) if offload else 0
            self.running.remove(request)
            self._preempt_request(request, now, drop_stale_output=self.requires_kv_delivery)
            self.bridge.preempted(request.request_id, num_stored)
            done.add(request.request_id)
            if offload and not num_stored:
                self.bridge.num_offloads_as_recompute += 1
                logger.debug("request %s: no offload, preempted by recompute", request.request_id)
        if done:
            logger.info(
                "TokenFlow preempted %d stream(s) (so far %d offloaded, %d offloads recomputed, "
                "%d paused copies evicted by the offloading pool)",
                len(done),
                self.bridge.num_offloads,
                self.bridge.num_offloads_as_recompute,
                self.bridge.num_copies_lost,
            )
        return done

    def _store(self, request: Request) -> int:
        """Plan the host store of a stream about to be paused; the tokens stored (0: none, the
        pause is a recompute: no connector, or the host KV connector's memory is full).  vLLM's
        pool stored the full blocks as they were computed: what it holds of them now."""
        if self.offload_pool is not None:
            return self.offload_pool.held_tokens(request)
        if self.host_kv is None:
            return 0
        num_tokens = min(request.num_computed_tokens, request.num_tokens)
        block_ids = self.kv_cache_manager.get_block_ids(request.request_id)[0]
        return num_tokens if self.host_kv.store(request.request_id, block_ids, num_tokens) else 0

    def _drop_unwanted_copies(self, moves: Moves) -> None:
        """A start the policy makes by recompute (a reload would be slower) drops the copy."""
        if self.host_kv is None:
            return
        for start in moves.starts:
            if not start.by_load and self.host_kv.host_tokens(start.request_id):
                self.host_kv.discard(start.request_id)
                self.bridge.discarded(start.request_id)

    def _hold_back(self, moves: Moves, orig: list[Request]) -> set[str]:
        """Leave in the waiting queue only the policy's starts (first, in its order) and the
        requests the policy does not manage; returns the ids held back."""
        mirrored = self.bridge.requests
        starts = [s.request_id for s in moves.starts]
        allowed = set(starts)
        by_id = {r.request_id: r for r in orig}
        queue = create_request_queue(self.policy)
        for request_id in starts:
            if request_id in by_id:
                queue.add_request(by_id[request_id])
        for request in orig:
            if request.request_id not in mirrored:
                queue.add_request(request)
        self.waiting = queue
        return {r.request_id for r in orig if r.request_id in mirrored} - allowed

    def _restore(self, orig: list[Request], held: set[str]) -> None:
        """Put the held-back requests back; the original order survives, newcomers (requests
        vLLM preempted meanwhile) go first, as vLLM prepends them."""
        left = list(self.waiting)
        left_ids = {r.request_id for r in left}
        orig_ids = {r.request_id for r in orig}
        queue = create_request_queue(self.policy)
        for request in left:
            if request.request_id not in orig_ids:
                queue.add_request(request)
        for request in orig:
            if request.request_id in left_ids or request.request_id in held:
                queue.add_request(request)
        self.waiting = queue

    # -- measured step times --------------------------------------------------------------------
    def _stamp(self, output: SchedulerOutput) -> SchedulerOutput:
        if len(self._scheduled_at) > 64:  # outputs never handed back (e.g. an engine reset)
            self._scheduled_at.clear()
        if output.total_num_scheduled_tokens:
            # Context the decoding streams attend to (vLLM advanced num_computed_tokens already):
            # the estimator separates per-stream from per-context-token cost with it.
            context = sum(
                self.requests[request_id].num_computed_tokens
                for request_id, n in output.num_scheduled_tokens.items()
                if n == 1 and request_id in self.requests
            )
            self._scheduled_at[id(output)] = StepStamp(time.monotonic(), context)
        return output

    def update_from_output(self, scheduler_output, model_runner_output):
        """vLLM's update; the step's duration feeds the policy's step-time estimator."""
        result = super().update_from_output(scheduler_output, model_runner_output)
        now = time.monotonic()
        stamp = self._scheduled_at.pop(id(scheduler_output), None)
        if stamp is not None:
            started = max(stamp.scheduled_s, self._last_update_s)
            counts = scheduler_output.num_scheduled_tokens.values()
            num_decode = sum(1 for n in counts if n == 1)
            num_prefill = sum(n for n in counts if n > 1)
            self.bridge.observe_step(
                num_decode, num_prefill, now - started, stamp.num_decode_context_tokens
            )
        self._last_update_s = now
        return result
