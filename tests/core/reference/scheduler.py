"""The scheduler: turns a policy's decisions into a `StepPlan`, and a `StepResult` into outputs.

`schedule(now)` runs five named phases: policy moves -> preemptions -> starts -> chunks (with
out-of-memory retraction) -> copies (loads, then write-through).  `update()` applies the step.
"""

from __future__ import annotations

import bisect

from tokenflow.core.config import SchedulerConfig
from tokenflow.core.estimator import StepTimeEstimator
from tokenflow.core.kv_manager import KVConfig, KVTierManager
from tokenflow.core.plan import (
    BlockCopy,
    RequestOutput,
    ScheduledChunk,
    StepPlan,
    StepResult,
)
from tokenflow.core.policies.base import Moves, Policy, Preemption, SchedulingView, Start
from tokenflow.core.request import FinishReason, PreemptMode, Request, RequestState

_COPY_SHARE_OF_STEP = 0.8  # of a step's predicted time that its overlapped copies may take


class Scheduler:
    """Owns the requests, the KV tier manager and a policy; knows nothing of models or clocks."""

    def __init__(self, config: SchedulerConfig, kv_config: KVConfig, policy: Policy) -> None:
        self.config = config
        self.kv = KVTierManager(kv_config)
        self.policy = policy
        self.estimator = StepTimeEstimator(
            config.initial_decode_step_s,
            config.initial_prefill_token_s,
            per_seq_s=config.initial_decode_seq_s,
            per_context_token_s=config.initial_decode_token_s,
        )
        self.requests: dict[str, Request] = {}
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.preempted: list[Request] = []
        self.new_token_ratio = self._init_ratio = policy.init_new_token_ratio(config)
        self.num_preemptions_total = 0
        self.num_loads_total = 0
        self.num_recomputes_total = 0
        self._num_seen = 0
        self._step_index = 0
        self._released: list[str] = []
        self._evict_copies: list[BlockCopy] = []
        self._loads_completing: list[Request] = []
        self._step_started_s = 0.0

    # -- requests in and out ----------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        """Queue a new request (its arrival_index is assigned here)."""
        if request.request_id in self.requests:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        limit = self.config.max_model_len
        if request.num_prompt_tokens + request.sampling_params.max_tokens > limit:
            raise ValueError(
                f"request {request.request_id}: {request.num_prompt_tokens} prompt tokens + "
                f"max_tokens {request.sampling_params.max_tokens} exceed max_model_len {limit}"
            )
        longest = request.num_prompt_tokens + request.sampling_params.max_tokens
        if self.kv.blocks_for(longest) > self.kv.config.num_device_blocks:
            raise ValueError(
                f"request {request.request_id}: {longest} tokens of prompt + max_tokens do not fit "
                f"in the device KV pool ({self.kv.config.num_device_blocks} blocks of "
                f"{self.kv.block_size} tokens)"
            )
        request.arrival_index = self._num_seen
        self._num_seen += 1
        request.state = RequestState.WAITING
        self.requests[request.request_id] = request
        bisect.insort(self.waiting, request, key=lambda r: r.sort_key)

    def finish_request(self, request_id: str, reason: FinishReason) -> bool:
        """End a request from outside (abort, or a stop string found by the engine layer)."""
        request = self.requests.get(request_id)
        if request is None or request.is_finished:
            return False
        self._finish(request, reason)
        return True

    def _finish(self, request: Request, reason: FinishReason) -> None:
        request.finish_reason = reason
        request.state = (
            RequestState.ABORTED if reason is FinishReason.ABORT else RequestState.FINISHED
        )
        for queue in (self.waiting, self.running, self.preempted):
            if request in queue:
                queue.remove(request)
        self.kv.drop(request.request_id)
        del self.requests[request.request_id]
        self._released.append(request.request_id)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.preempted)

    @property
    def num_unfinished(self) -> int:
        return len(self.requests)

    def view(self, now_s: float) -> SchedulingView:
        """The read-only state a policy decides on."""
        return SchedulingView(
            now_s=now_s,
            running=self.running,
            preempted=self.preempted,
            waiting=self.waiting,
            kv=self.kv,
            estimator=self.estimator,
            config=self.config,
            new_token_ratio=self.new_token_ratio,
            num_preemptions_total=self.num_preemptions_total,
            num_requests_seen=self._num_seen,
            # the derived state, recomputed by scans:
            preempted_by_dry=sorted(
                self.preempted, key=lambda r: (r.last_consume_s + 1.0 / r.rate_tps, r.sort_key)
            ),
            loading=[r for r in self.running if r.state is RequestState.LOADING],
            write_candidates=list(self.running),
            remaining_output_tokens=sum(
                r.sampling_params.max_tokens - r.num_output_tokens for r in self.running
            ),
            started_lifetime_blocks=sum(
                self.kv.blocks_for(
                    max(r.num_tokens, r.num_prompt_tokens + r.sampling_params.max_tokens // 2)
                )
                for r in self.running + self.preempted
            ),
        )

    # -- schedule -------------------------------------------------------------------------------
    def schedule(self, now_s: float) -> StepPlan:
        """Plan one step at time `now_s`."""
        self._step_started_s = now_s
        view = self.view(now_s)
        moves: Moves = self.policy.plan_moves(view)
        for preemption in moves.preemptions:
            self._preempt(self.requests[preemption.request_id], preemption.mode)
        self._apply_starts(moves.starts)
        chunks = self._build_chunks(view)
        loads = self._plan_loads(len(chunks))
        writes = self._plan_write_through(view, len(chunks))
        plan = StepPlan(
            step_index=self._step_index,
            chunks=tuple(chunks),
            device_to_host=tuple(self._evict_copies) + tuple(writes),
            host_to_device=tuple(loads),
            released_request_ids=tuple(self._released),
        )
        self._step_index += 1
        self._evict_copies.clear()
        self._released.clear()
        return plan

    def _preempt(self, request: Request, mode: PreemptMode) -> None:
        """Take a resident request off the device: offload its KV or drop it for recompute."""
        if request.state not in (RequestState.RUNNING, RequestState.LOADING):
            raise ValueError(f"cannot preempt {request.request_id} in state {request.state.value}")
        if request.state is RequestState.LOADING:
            self.kv.free_device(request.request_id)  # its host copy is complete and kept
        elif mode is PreemptMode.OFFLOAD and (
            eviction := self.kv.evict(request.request_id, request.num_computed_tokens)
        ):
            self._evict_copies.extend(eviction.copies)
        else:
            self.kv.drop(request.request_id)
            request.num_computed_tokens = 0
        self.running.remove(request)
        request.state = RequestState.PREEMPTED
        request.num_preemptions += 1
        self.num_preemptions_total += 1
        bisect.insort(self.preempted, request, key=lambda r: r.sort_key)

    def _apply_starts(self, starts: tuple[Start, ...]) -> None:
        for start in starts:
            request = self.requests[start.request_id]
            if len(self.running) >= self.config.max_num_seqs:
                return
            if start.by_load:
                if not self.kv.begin_load(request.request_id, request.num_computed_tokens):
                    return
                request.state = RequestState.LOADING
                self.num_loads_total += 1
            else:
                if request.state is RequestState.PREEMPTED and request.num_computed_tokens:
                    self.kv.drop(request.request_id)  # recompute chosen over a reload
                    request.num_computed_tokens = 0
                if not self.kv.allocate(request.request_id, request.num_tokens):
                    return
                if request.state is RequestState.PREEMPTED:
                    self.num_recomputes_total += 1
                request.state = RequestState.RUNNING
            queue = self.waiting if request in self.waiting else self.preempted
            queue.remove(request)
            self.running.append(request)

    # -- chunks ---------------------------------------------------------------------------------
    def _build_chunks(self, view: SchedulingView) -> list[ScheduledChunk]:
        """Prefill-first (whole prompts) or chunked (decodes + prefill chunks in one budget)."""
        runnable = [r for r in self.running if r.state is RequestState.RUNNING]
        prefills = [r for r in runnable if r.is_prefilling]
        chunk_tokens = self.policy.prefill_chunk_tokens
        if chunk_tokens is None:
            if prefills:
                return self._prefill_chunks(prefills, self.config.max_prefill_tokens, whole=True)
            return self._decode_chunks([r for r in runnable if not r.is_prefilling], view)
        decodes = self._decode_chunks([r for r in runnable if not r.is_prefilling], view)
        prefills = [r for r in prefills if r.state is RequestState.RUNNING]
        return decodes + self._prefill_chunks(prefills, chunk_tokens - len(decodes), whole=False)

    def _prefill_chunks(
        self, prefills: list[Request], budget: int, whole: bool
    ) -> list[ScheduledChunk]:
        chunks: list[ScheduledChunk] = []
        for request in prefills:
            remaining = request.num_tokens - request.num_computed_tokens
            if whole and chunks and remaining > budget:
                break
            count = remaining if whole else min(remaining, budget)
            if count <= 0:
                break
            if not self.kv.allocate(request.request_id, request.num_computed_tokens + count):
                break
            chunks.append(self._chunk(request, count))
            budget -= count
        return chunks

    def _decode_chunks(self, decodes: list[Request], view: SchedulingView) -> list[ScheduledChunk]:
        """One token per stream; when a block cannot be had, retract a victim and retry."""
        chunks: dict[str, ScheduledChunk] = {}
        for request in decodes:
            while request.state is RequestState.RUNNING and not self.kv.allocate(
                request.request_id, request.num_tokens
            ):
                candidates = [
                    r for r in self.running if r.state is RequestState.RUNNING and r is not request
                ]
                preemption = (
                    self.policy.choose_oom_victim(candidates, view)
                    if candidates
                    else Preemption(request.request_id, PreemptMode.RECOMPUTE)
                )
                self._preempt(self.requests[preemption.request_id], preemption.mode)
                chunks.pop(preemption.request_id, None)
                self.new_token_ratio = self._init_ratio
            if request.state is RequestState.RUNNING:
                chunks[request.request_id] = self._chunk(request, 1)
        return list(chunks.values())

    def _chunk(self, request: Request, count: int) -> ScheduledChunk:
        start = request.num_computed_tokens
        num_output = len(request.output_token_ids)
        if count == 1 and num_output and start == len(request.prompt_token_ids) + num_output - 1:
            token_ids: tuple[int, ...] = (request.output_token_ids[-1],)  # a decode
        else:
            token_ids = request.token_ids_from(start, count)
        return ScheduledChunk(
            request_id=request.request_id,
            token_ids=token_ids,
            start_position=start,
            new_block_ids=self.kv.device_block_ids(request.request_id),  # the whole table
            block_table_start=0,
            samples_token=start + count == len(request.prompt_token_ids) + num_output,
            sampling_params=request.sampling_params,
            num_output_tokens=num_output,
        )

    # -- copies ---------------------------------------------------------------------------------
    def _copy_budget_blocks(self, num_chunks: int) -> int:
        """Blocks one link direction moves while the step computes (at least one).

        Sized to a share of the predicted step, not all of it: a step whose copies outlast its
        compute is measured longer, which would widen the next budget and lengthen steps for
        good; below 1 the prediction contracts back to the compute time."""
        step_s = _COPY_SHARE_OF_STEP * self.estimator.decode_time_s(num_chunks)
        block_bytes = self.kv.config.block_bytes
        return max(1, int(self.config.link_bytes_per_s * step_s / block_bytes))

    def _plan_loads(self, num_chunks: int) -> list[BlockCopy]:
        budget = self._copy_budget_blocks(num_chunks)
        copies: list[BlockCopy] = []
        for request in self.running:
            if request.state is not RequestState.LOADING or budget <= len(copies):
                continue
            rid, tokens = request.request_id, request.num_computed_tokens
            copies.extend(self.kv.plan_load(rid, tokens, budget - len(copies)))
            if self.kv.is_loaded(rid, tokens):
                self._loads_completing.append(request)
        return copies

    def _plan_write_through(self, view: SchedulingView, num_chunks: int) -> list[BlockCopy]:
        budget = self._copy_budget_blocks(num_chunks) - len(self._evict_copies)
        order = self.policy.write_through_order(view)
        if budget <= 0 or not order:
            return []
        candidates = [(r.request_id, r.num_computed_tokens) for r in order]
        return self.kv.plan_write_through(candidates, budget)

    # -- update ---------------------------------------------------------------------------------
    def update(self, plan: StepPlan, result: StepResult, now_s: float) -> list[RequestOutput]:
        """Apply a finished step at time `now_s`: new tokens, finished requests, loaded KV."""
        self.kv.end_step()
        duration_s = now_s - self._step_started_s
        self.estimator.observe(
            plan.num_decode_tokens,
            plan.num_prefill_tokens,
            duration_s,
            plan.num_decode_context_tokens,
        )
        for request in self._loads_completing:
            if request.state is RequestState.LOADING:
                request.state = RequestState.RUNNING
        self._loads_completing.clear()
        sampled = {s.request_id: s.token_id for s in result.sampled}
        outputs: list[RequestOutput] = []
        requests, running = self.requests, RequestState.RUNNING
        for chunk in plan.chunks:
            request = requests.get(chunk.request_id)
            if request is None or request.state is not running:
                continue  # finished or aborted while the step ran
            request.num_computed_tokens = chunk.start_position + len(chunk.token_ids)
            if not chunk.samples_token:
                continue
            token_id = sampled[chunk.request_id]
            request.append_token(token_id, now_s)
            reason = self._stop_reason(request, token_id)
            if reason is not None:
                self._finish(request, reason)
            outputs.append(
                RequestOutput(
                    request.request_id, (token_id,), len(request.output_token_ids), reason
                )
            )
        self._decay_new_token_ratio()
        return outputs

    def _stop_reason(self, request: Request, token_id: int) -> FinishReason | None:
        params = request.sampling_params
        num_output = len(request.output_token_ids)
        if num_output >= params.min_tokens and (
            (not params.ignore_eos and token_id in request.eos_token_ids)
            or token_id in params.stop_token_ids
        ):
            return FinishReason.STOP
        if (
            num_output >= params.max_tokens
            or num_output + len(request.prompt_token_ids) >= self.config.max_model_len
        ):
            return FinishReason.LENGTH
        return None

    def _decay_new_token_ratio(self) -> None:
        cfg = self.config
        step = (self._init_ratio - cfg.min_new_token_ratio) / cfg.new_token_ratio_decay_steps
        self.new_token_ratio = max(cfg.min_new_token_ratio, self.new_token_ratio - step)
