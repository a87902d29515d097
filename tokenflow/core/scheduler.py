"""The scheduler: turns a policy's decisions into a `StepPlan`, and a `StepResult` into outputs.

`schedule(now)` runs six named phases: policy moves -> preemptions -> starts -> decode blocks
(a decode that finds no free block retracts a victim the policy picks) -> chunks
(`ChunkBuilder`, chunker.py) -> copies (loads, then write-through).  `update()` applies the
step: the executor's tokens meet the requests kept in chunk order (`TokenAppender`,
appender.py), and the requests that stopped, or whose sampling row failed, are finished here.

With prefix caching on (`KVConfig.prefix_caching`), a request starting fresh shares the device's
cached blocks of its prompt's leading full blocks, loads the host's beyond them when the policy
says so (`Start.by_load`), and computes from the first token after them; one whose next block
another resident is computing right now waits a step for it (one prefill per prefix: `n > 1`
and users arriving together on one system prompt prefill it once).  `update()` caches the full
blocks each step computed before finished requests release theirs.  Each release says when its
request expects the blocks back (`_return_s`), which the retention ranks them by.
"""

from __future__ import annotations

from tokenflow.core.appender import TokenAppender, check_sampled
from tokenflow.core.chunker import ChunkBuilder
from tokenflow.core.config import SchedulerConfig
from tokenflow.core.estimator import StepTimeEstimator
from tokenflow.core.kv_manager import KVConfig, KVTierManager, PrefixHit
from tokenflow.core.migration import StreamExport, export_of, request_of
from tokenflow.core.plan import (
    BlockCopy,
    RequestOutput,
    ScheduledChunk,
    StepPlan,
    StepResult,
)
from tokenflow.core.policies.base import Moves, Policy, Preemption, SchedulingView, Start
from tokenflow.core.queues import RequestQueues
from tokenflow.core.request import (
    FinishReason,
    PreemptMode,
    Request,
    RequestState,
)
from tokenflow.core.retention import NOT_EXPECTED, expected_return_s
from tokenflow.core.step_budget import StepBudget
from tokenflow.core.view import ReserveRatio, build_view

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
        self.queues = RequestQueues()
        self.waiting = self.queues.waiting  # (the same lists, for readers of the scheduler)
        self.running = self.queues.running
        self.preempted = self.queues.preempted
        self.reserve = ReserveRatio(config, policy.init_new_token_ratio(config))
        self.num_preemptions_total = 0
        self.num_loads_total = 0
        self.num_recomputes_total = 0
        self.num_prefix_queried_tokens = 0  # prompt tokens looked up in the prefix cache
        self.num_prefix_hit_tokens = 0  # of them, found cached on the device
        self.num_prefix_host_hit_tokens = 0  # of them, found cached in the host tier after that
        self._num_seen = 0
        self._step_index = 0
        self._released: list[str] = []
        self._evict_copies: list[BlockCopy] = []
        self._loads_completing: list[Request] = []
        self._step_started_s = 0.0
        self._now_s = 0.0  # the time of the last schedule or update
        # The last plan, kept for `update`: it walks its chunks beside their requests (kept in
        # chunk order by the chunk builder) instead of looking each one up.
        self._planned: StepPlan | None = None
        self._chunks = ChunkBuilder(self.kv, self.queues)
        self._appender = TokenAppender(self.queues, kv_config.block_size, config.max_model_len)

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
        self.requests[request.request_id] = request
        self.queues.add_waiting(request)

    def finish_request(self, request_id: str, reason: FinishReason) -> bool:
        """End a request from outside (abort, or a stop string found by the engine layer)."""
        request = self.requests.get(request_id)
        if request is None or request.is_finished:
            return False
        self._finish(request, reason)
        return True

    def _finish(self, request: Request, reason: FinishReason) -> None:
        self.queues.remove(request)
        self._chunks.forget(request.request_id)
        request.finish_reason = reason
        request.state = (
            RequestState.ABORTED if reason is FinishReason.ABORT else RequestState.FINISHED
        )
        self.kv.drop(request.request_id, self._return_s(request))
        del self.requests[request.request_id]
        self._released.append(request.request_id)

    def _return_s(self, request: Request) -> float:
        """When a request that lets go of its KV blocks expects them back (retention.py): a
        paused one when its reader runs dry; a finished one at its reader's next message, if
        it expects one (a reader, or a client that named its session); an aborted one never."""
        if request.state is RequestState.ABORTED:
            return NOT_EXPECTED
        if not request.is_finished:
            return request.dry_s
        expects_next_turn = request.is_reader or request.session_key is not None
        read_done_s = request.last_consume_s if request.is_reader else self._now_s
        return expected_return_s(read_done_s, expects_next_turn, self.kv.config.expected_think_s)

    # -- streams moving between engines (tokenflow/core/migration.py) -------------------------
    def export_stream(self, request_id: str) -> StreamExport:
        """Take an unfinished request out between steps, freeing its KV in both tiers, and
        return its portable state.  A resident's KV is dropped: it resumes by recompute
        wherever it is imported (a grammar's state too: the target advances a fresh matcher by
        the tokens generated).  ValueError if it is unknown or a step is in flight."""
        request = self.requests.get(request_id)
        if request is None:
            raise ValueError(f"cannot export {request_id!r}: no such unfinished request")
        if self._planned is not None:
            raise ValueError(f"cannot export {request_id!r} while a step is in flight")
        state = export_of(request)
        self.queues.remove(request)
        self._chunks.forget(request_id)
        self.kv.drop(request_id)
        del self.requests[request_id]
        self._released.append(request_id)  # (the executor forgets its per-request state)
        return state

    def import_stream(self, state: StreamExport) -> Request:
        """Take in a stream exported by another engine: a started one as a paused stream that
        resumes by recompute, one that never started as a waiting request (its arrival time
        kept).  ValueError as `add_request`."""
        request = request_of(state)
        self.add_request(request)
        if state.is_started:
            self.queues.park(request)
        return request

    @property
    def has_work(self) -> bool:
        return self.queues.has_work

    @property
    def num_unfinished(self) -> int:
        return len(self.requests)

    @property
    def num_requests_seen(self) -> int:
        return self._num_seen

    @property
    def new_token_ratio(self) -> float:
        """The admission reserve's ratio now (`ReserveRatio`); settable, as tests do to
        admit without a reserve."""
        return self.reserve.value

    @new_token_ratio.setter
    def new_token_ratio(self, ratio: float) -> None:
        self.reserve.value = ratio

    def view(self, now_s: float) -> SchedulingView:
        """The state a policy decides on, as it is now (the queues copied: a snapshot)."""
        queues = self.queues
        return build_view(
            self,
            now_s,
            tuple(queues.running),
            tuple(queues.preempted),
            tuple(queues.waiting),
            queues.remaining_output_tokens,
        )

    # -- schedule -------------------------------------------------------------------------------
    def schedule(self, now_s: float, step_budget: StepBudget | None = None) -> StepPlan:
        """Plan one step at time `now_s`, within `step_budget`'s tokens if given (else the
        policy's own prefill rule, `Policy.prefill_chunk_tokens`)."""
        self._step_started_s = self._now_s = now_s
        self.kv.set_time(now_s)
        chunk_tokens = self.policy.prefill_chunk_tokens
        if step_budget is not None:
            num_decodes = sum(1 for r in self.running if not r.is_prefilling)
            chunk_tokens = step_budget.tokens(self.estimator, num_decodes)
        moves: Moves = self.policy.plan_moves(self.view(now_s))
        for preemption in moves.preemptions:
            self._preempt(self.requests[preemption.request_id], preemption.mode)
        self._apply_starts(moves.starts)
        chunks = self._build_chunks(now_s, chunk_tokens)
        budget = self._copy_budget_blocks(len(chunks))  # per link direction
        loads = self._plan_loads(budget)
        writes = self._plan_write_through(now_s, budget - len(self._evict_copies))
        plan = StepPlan(
            step_index=self._step_index,
            chunks=tuple(chunks),
            device_to_host=tuple(self._evict_copies) + tuple(writes),
            host_to_device=tuple(loads),
            released_request_ids=tuple(self._released),
        )
        self._planned = plan
        self._step_index += 1
        self._evict_copies.clear()
        self._released.clear()
        return plan

    def _preempt(self, request: Request, mode: PreemptMode) -> None:
        """Take a resident request off the device: offload its KV or drop it for recompute."""
        if request.state not in (RequestState.RUNNING, RequestState.LOADING):
            raise ValueError(f"cannot preempt {request.request_id} in state {request.state.value}")
        rid, return_s = request.request_id, self._return_s(request)
        if request.state is RequestState.LOADING:
            self.kv.free_device(rid, return_s)  # its host copy is complete and kept
        elif mode is PreemptMode.OFFLOAD and (
            eviction := self.kv.evict(rid, request.num_computed_tokens, return_s)
        ):
            self._evict_copies.extend(eviction.copies)
        else:
            self.kv.drop(rid, return_s)
            request.num_computed_tokens = 0
        self.queues.pause(request)
        self._chunks.forget(request.request_id)  # its next table comes whole
        request.num_preemptions += 1
        self.num_preemptions_total += 1

    def _apply_starts(self, starts: tuple[Start, ...]) -> None:
        promised: set[int] | None = None  # keys residents are computing (built when needed)
        for start in starts:
            request = self.requests[start.request_id]
            if len(self.running) >= self.config.max_num_seqs:
                return
            if request.state is RequestState.WAITING:
                hit = self._prefix_hit(request)
                if hit is not None:
                    promised = self._promised_keys() if promised is None else promised
                    if self._waits_for_prefix(request, hit, promised):
                        continue
                state = self._start_fresh(request, hit, load_host=start.by_load)
                if state is None:
                    return
                if promised is not None:
                    promised.update(self._keys_to_compute(request))
            elif start.by_load:
                if not self.kv.begin_load(request.request_id, request.num_computed_tokens):
                    return
                state = RequestState.LOADING
                self.num_loads_total += 1
            else:
                if request.num_computed_tokens:
                    self.kv.drop(request.request_id, request.dry_s)  # recompute over a reload
                    request.num_computed_tokens = 0
                if not self.kv.allocate(request.request_id, request.num_tokens):
                    return
                self.num_recomputes_total += 1
                state = RequestState.RUNNING
            self.queues.enter_device(request, state)

    def _prefix_hit(self, request: Request) -> PrefixHit | None:
        """What the tiers cache of a never-started request's prompt; None without prefix
        caching or for one that computes its whole prompt (`Request.computes_whole_prompt`)."""
        kv = self.kv
        if not kv.config.prefix_caching or request.computes_whole_prompt:
            return None
        hashes = request.prompt_block_hashes(kv.block_size)
        return kv.find_prefix(request.prompt_token_ids, hashes)

    def _start_fresh(
        self, request: Request, hit: PrefixHit | None, load_host: bool
    ) -> RequestState | None:
        """Device blocks for a never-started request (None: they do not fit), and the state it
        starts in.  With a prefix `hit` it shares the cached blocks of its prompt's leading
        full blocks (`Request.num_cached_tokens`), loading the host's beyond the device's when
        `load_host` (it starts loading)."""
        kv, rid = self.kv, request.request_id
        if hit is None:
            return RequestState.RUNNING if kv.allocate(rid, request.num_tokens) else None
        load_host = load_host and hit.num_host_load_blocks > 0
        if not kv.allocate_with_prefix(rid, request.num_tokens, hit, load_host):
            return None
        request.num_computed_tokens = request.num_cached_tokens = hit.num_cached_tokens(load_host)
        # vLLM's prefix_cache_queries / prefix_cache_hits, in tokens, per tier.
        self.num_prefix_queried_tokens += request.num_prompt_tokens
        self.num_prefix_hit_tokens += hit.num_device_tokens
        if not load_host:
            return RequestState.RUNNING
        self.num_prefix_host_hit_tokens += request.num_cached_tokens - hit.num_device_tokens
        self.num_loads_total += 1
        return RequestState.LOADING

    def _keys_to_compute(self, request: Request) -> list[int]:
        """The keys of the prompt's full blocks a resident has yet to compute."""
        hashes = request.prompt_block_hashes(self.kv.block_size)
        return hashes[request.num_computed_tokens // self.kv.block_size :]

    def _promised_keys(self) -> set[int]:
        """The keys of the prompt blocks residents are computing (or loading) now."""
        promised: set[int] = set()
        for request in self.running:
            if request.is_prefilling and not request.computes_whole_prompt:
                promised.update(self._keys_to_compute(request))
        return promised

    def _waits_for_prefix(self, request: Request, hit: PrefixHit, promised: set[int]) -> bool:
        """Whether a waiting request's first block past its cached prefix (`hit`) is one a
        resident is computing: it starts once that is cached, computing only what follows."""
        if not promised:
            return False
        bs = self.kv.block_size
        hashes = request.prompt_block_hashes(bs)
        index = len(hit.block_hashes)
        return index < (request.num_prompt_tokens - 1) // bs and hashes[index] in promised

    # -- chunks ---------------------------------------------------------------------------------
    def _build_chunks(self, now_s: float, chunk_tokens: int | None) -> list[ScheduledChunk]:
        """Prefill-first (`chunk_tokens` None): a step of whole prompts while any prompt is
        left, else the decodes; chunked: the decodes and prompt chunks within `chunk_tokens`."""
        decoding, prefilling = self._chunks.residents()
        if chunk_tokens is None and prefilling:
            return self._chunks.prefill_first(prefilling, self.config.max_prefill_tokens)
        decoding = self._grow_decodes(decoding, now_s)
        if chunk_tokens is not None:
            prefilling = [r for r in prefilling if r.state is RequestState.RUNNING]
        return self._chunks.build(decoding, prefilling, chunk_tokens)

    def _grow_decodes(self, decoding: list[Request], now_s: float) -> list[Request]:
        """Give each decoding stream the block its next token needs, retracting the victims
        the policy picks until one is free; the streams still running after, in order."""
        kv, block_size, running = self.kv, self.kv.block_size, RequestState.RUNNING
        tables, no_table = kv.device_tables, ()
        retracted = False
        for request in decoding:
            if request.num_tokens <= len(tables.get(request.request_id, no_table)) * block_size:
                continue  # (its last block has room: most streams, most steps)
            while request.state is running and not kv.allocate(
                request.request_id, request.num_tokens
            ):
                self._retract_for(request, now_s)
                retracted = True
            retracted |= request.state is not running
        return [r for r in decoding if r.state is running] if retracted else decoding

    def _retract_for(self, request: Request, now_s: float) -> None:
        """Free blocks for `request`: preempt the victim the policy picks among the other
        running streams (on a view taken now), or `request` itself when it runs alone."""
        candidates = [
            r for r in self.running if r.state is RequestState.RUNNING and r is not request
        ]
        preemption = (
            self.policy.choose_oom_victim(candidates, self.view(now_s))
            if candidates
            else Preemption(request.request_id, PreemptMode.RECOMPUTE)
        )
        self._preempt(self.requests[preemption.request_id], preemption.mode)
        self.reserve.reset()

    # -- copies ---------------------------------------------------------------------------------
    def _copy_budget_blocks(self, num_chunks: int) -> int:
        """Blocks one link direction moves while the step computes (at least one).

        Sized to a share of the predicted step, not all of it: a step whose copies outlast its
        compute is measured longer, which would widen the next budget and lengthen steps for
        good; below 1 the prediction contracts back to the compute time."""
        step_s = _COPY_SHARE_OF_STEP * self.estimator.decode_time_s(num_chunks)
        block_bytes = self.kv.config.block_bytes
        return max(1, int(self.config.link_bytes_per_s * step_s / block_bytes))

    def _plan_loads(self, budget: int) -> list[BlockCopy]:
        if not self.queues.loading:
            return []
        copies: list[BlockCopy] = []
        for request in self.queues.loading:
            if budget <= len(copies):
                break
            rid, tokens = request.request_id, request.num_computed_tokens
            copies.extend(self.kv.plan_load(rid, tokens, budget - len(copies)))
            if self.kv.is_loaded(rid, tokens):
                self._loads_completing.append(request)
        return copies

    def _plan_write_through(self, now_s: float, budget: int) -> list[BlockCopy]:
        """Copies of full blocks to the host, in the policy's order, within `budget` blocks.

        Only the write candidates are looked at (`RequestQueues.write_candidates`); the ones
        whose full blocks all have a host copy leave the set, and come back when a step fills
        another of their blocks."""
        candidates = self.queues.write_candidates
        if not candidates or budget <= 0:
            return []
        kv = self.kv
        for rid in [
            rid
            for rid, r in candidates.items()
            if not kv.has_unsynced_full_block(rid, r.num_computed_tokens)
        ]:
            del candidates[rid]
        pending = [r for r in candidates.values() if r.state is RequestState.RUNNING]
        order = self.policy.write_through_order(self.view(now_s), pending) if pending else []
        if not order:
            return []
        return kv.plan_write_through([(r.request_id, r.num_computed_tokens) for r in order], budget)

    # -- update ---------------------------------------------------------------------------------
    def update(self, plan: StepPlan, result: StepResult, now_s: float) -> list[RequestOutput]:
        """Apply the last planned step, finished at time `now_s`: new tokens, finished
        requests, loaded KV.  `result.sampled` is in chunk order (tokenflow.core.plan)."""
        if plan is not self._planned:
            raise ValueError(f"step {plan.step_index} is not the last plan, or applied already")
        self._planned = None
        self._now_s = now_s
        self.kv.set_time(now_s)
        decoding, prefilling = self._chunks.decoding, self._chunks.prefilling
        sampled = result.sampled
        num_decodes = len(decoding)
        prefills = plan.chunks[num_decodes:]
        check_sampled(plan, decoding, sampled, num_decodes + sum(c.samples_token for c in prefills))
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
                self.queues.load_finished(request)
        self._loads_completing.clear()
        failed = self._fail_rows(result) if result.failed_rows else []
        outputs = self._appender.append_decodes(decoding, sampled, now_s)
        if prefills:
            outputs += self._appender.append_prefills(
                prefills, prefilling, sampled[num_decodes:], now_s
            )
        if self.kv.config.prefix_caching:
            self._cache_computed_blocks(decoding, prefilling)
        for output in outputs:
            if output.finish_reason is not None:
                self._finish(self.requests[output.request_id], output.finish_reason)
        # (a finished request left with its own remaining count: subtracting after is exact)
        self.queues.remaining_output_tokens -= len(outputs)  # (one output per token sampled)
        self.reserve.decay()
        return outputs + failed

    def _fail_rows(self, result: StepResult) -> list[RequestOutput]:
        """End the requests whose sampling row failed (`StepResult.failed_rows`) as aborts, with
        why, before the tokens are appended: their placeholders never are; the others go on."""
        outputs: list[RequestOutput] = []
        for request_id, reason in result.failed_rows.items():  # (in row order: deterministic)
            if (request := self.requests.get(request_id)) is not None:  # (else it ended)
                self._finish(request, FinishReason.ABORT)  # its KV freed, not expected back
                n = request.num_output_tokens
                outputs.append(RequestOutput(request_id, (), n, FinishReason.ABORT, error=reason))
        return outputs

    def _cache_computed_blocks(self, decoding: list[Request], prefilling: list[Request]) -> None:
        """Cache the full blocks the step computed (prefix caching on): those of each prompt
        chunk, and of each decode whose token filled its block; before any finished request
        releases its blocks (a released cached block stays reusable)."""
        kv, block_size, running = self.kv, self.kv.block_size, RequestState.RUNNING
        for request in decoding:
            if not request.num_computed_tokens % block_size and request.state is running:
                kv.cache_full_blocks(
                    request.request_id, request.num_computed_tokens, request.token_ids_from
                )
        for request in prefilling:
            if request.state is running:
                kv.cache_full_blocks(
                    request.request_id, request.num_computed_tokens, request.token_ids_from
                )
