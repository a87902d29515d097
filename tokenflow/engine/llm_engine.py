"""The synchronous real engine: model + tiered KV cache + the core's step loop, on a wall clock.

`LLM` (offline) and `AsyncEngine` (serving) both drive one `LLMEngine`.

Failure isolation: a failure that belongs to one request (its sampling row, its text) ends only
that request with an "error" delta; a step whose forward pass or copies raise ends only the
requests of that plan.  The engine goes on with everyone else.

Responsiveness: every policy prefills in chunks here, sized each step so a step takes about
`EngineArgs.step_target_ms` (from the scheduler's measured per-token prefill cost), so a long
prompt, or the recompute of a preempted stream, never freezes the other streams for long.
"""

from __future__ import annotations

import logging
import time

import torch

from tokenflow.core.build import build_core
from tokenflow.core.config import SchedulerConfig
from tokenflow.core.consumption import resolve_given
from tokenflow.core.engine_core import StepFailed
from tokenflow.core.kv_manager import KVConfig
from tokenflow.core.migration import StreamExport
from tokenflow.core.plan import StepPlan
from tokenflow.core.request import (
    Consumption,
    FinishReason,
    Request,
    RequestState,
    SamplingParams,
)
from tokenflow.core.step_budget import StepBudget
from tokenflow.engine.build import ExecutorFactory, build_torch_executor
from tokenflow.engine.client import EngineStats, GenerationDelta
from tokenflow.engine.clock import WallClock
from tokenflow.engine.engine_args import EngineArgs, resolve_device
from tokenflow.engine.output_processor import OutputProcessor
from tokenflow.engine.snapshot import MoveWatch, StreamsSnapshot, take_snapshot
from tokenflow.model.grammar import CompiledGrammar

logger = logging.getLogger(__name__)


def measure_copy_bytes_per_s(device: torch.device, num_bytes: int = 32 << 20) -> float:
    """Host <-> device copy bandwidth, measured once at start (on CPU: a memory copy)."""
    src = torch.empty(num_bytes, dtype=torch.uint8, device=device)
    pin = device.type == "cuda"
    dst = torch.empty(num_bytes, dtype=torch.uint8, pin_memory=pin)
    dst.copy_(src)  # warm-up
    if pin:
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(3):
        dst.copy_(src, non_blocking=pin)
    if pin:
        torch.cuda.synchronize(device)
    return 3 * num_bytes / max(time.perf_counter() - start, 1e-9)


class LLMEngine:
    """Add requests, step, read deltas.  Not thread-safe: one thread drives it.

    `build_executor` makes the executor (the PyTorch one by
    default;
    `tokenflow.integrations.executors`
    maps the names `EngineArgs.executor` takes to factories)."""

    def __init__(
        self, args: EngineArgs, build_executor: ExecutorFactory = build_torch_executor
    ) -> None:
        if args.executor != "torch" and build_executor is build_torch_executor:
            raise ValueError(
                f"the {args.executor} executor needs its factory: "
                f"tokenflow.integrations.executors.executor_factory({args.executor!r})"
            )
        self.args = args
        self.device = resolve_device(args.device)
        if args.num_threads is not None:
            torch.set_num_threads(args.num_threads)
        built = build_executor(args, self.device)
        self.executor = built.executor
        self.model_config = built.model_config
        self.tokenizer = built.tokenizer.with_chat_template(args.chat_template)
        self.max_model_len = built.max_model_len
        self.kernels = built.kernels
        self.grammars = built.grammars
        self.model_name = args.model or "SmolLM2-135M-Instruct"
        scheduler_config = SchedulerConfig(
            max_num_seqs=args.max_num_seqs,
            max_prefill_tokens=args.max_prefill_tokens,
            chunk_tokens=args.chunk_tokens,
            max_model_len=self.max_model_len,
            link_bytes_per_s=measure_copy_bytes_per_s(self.device),
            initial_decode_step_s=0.03 if self.device.type == "cpu" else 0.01,
            initial_prefill_token_s=1e-3 if self.device.type == "cpu" else 1e-5,
        )
        num_host_blocks = args.host_kv_tokens // args.block_size
        kv_config = KVConfig(
            built.num_device_blocks,
            num_host_blocks,
            args.block_size,
            built.block_bytes,
            prefix_caching=args.uses_prefix_cache,
            prefix_retention=args.prefix_retention,
        )
        self.core = build_core(
            scheduler_config,
            kv_config,
            args.policy,
            self.executor,
            WallClock(),
            tokenflow=args.tokenflow_for(self.device.type),
            step_budget=StepBudget(args.step_target_ms / 1000, args.max_prefill_tokens),
        )
        self.scheduler = self.core.scheduler
        self.outputs = OutputProcessor(self.tokenizer)
        self._moves = MoveWatch()

    # -- requests ---------------------------------------------------------------------------------
    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """ValueError naming the problem if the request can never be served."""
        n = len(prompt_token_ids)
        if n == 0:
            raise ValueError("the prompt is empty")
        vocab = self.model_config.vocab_size
        if any(not 0 <= t < vocab for t in prompt_token_ids):
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        if n >= self.max_model_len:
            raise ValueError(
                f"the prompt has {n} tokens; the context length is {self.max_model_len}"
            )
        asks_scores = params.logprobs is not None or params.prompt_logprobs is not None
        if self.args.executor != "torch" and (params.has_penalties or asks_scores):
            raise ValueError(
                f"penalties and logprobs need the torch executor, not {self.args.executor!r}"
            )
        if n + params.max_tokens > self.max_model_len:
            raise ValueError(
                f"{n} prompt tokens + max_tokens {params.max_tokens} exceed the context length "
                f"{self.max_model_len}"
            )
        if params.structured_output is not None and self.grammars is None:
            raise ValueError(
                f"structured outputs are not supported by the {self.args.executor} executor"
            )

    def compile_grammar(self, params: SamplingParams) -> CompiledGrammar | None:
        """The request's compiled grammar (None without a structured output), compiled in a
        worker process: blocks the calling thread up to the compile deadline, so the server
        calls it off its event loop and hands the result to `add_request`.  ValueError naming
        what is wrong with the schema; CompilerBusy when no compile worker was free in time."""
        spec = params.structured_output
        if spec is None or self.grammars is None:
            return None
        return self.grammars.compile(spec)

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        rate_tps: float | None = None,
        consumption: Consumption | None = None,
        grammar: CompiledGrammar | None = None,
        *,
        session_key: str | None = None,
    ) -> None:
        """Queue a request (ValueError if it is invalid or can never fit); its class is
        `consumption`, else eager for an infinite rate and reader otherwise.  A structured
        output's `grammar` compiled beforehand (`compile_grammar`), else compiled here.
        `session_key` is the client's session hint (OpenAI's `prompt_cache_key`): the prefix
        cache keeps the blocks of a request that names one for its next turn."""
        self.validate(prompt_token_ids, params)
        consumption, rate_tps = resolve_given(consumption, rate_tps, self.args.default_rate_tps)
        grammar = grammar or self.compile_grammar(params)
        self.outputs.add(request_id, prompt_token_ids, params)
        request = Request(
            request_id=request_id,
            prompt_token_ids=tuple(prompt_token_ids),
            sampling_params=params,
            rate_tps=rate_tps,
            consumption=consumption,
            arrival_s=self.core.clock.now(),
            eos_token_ids=self.model_config.eos_token_ids,
            session_key=session_key,
        )
        try:
            self.core.add_request(request)
        except Exception:
            self.outputs.drop(request_id)
            raise
        if grammar is not None and self.grammars is not None:
            self.grammars.bind(request_id, grammar)

    # -- streams moving between engines (tokenflow/core/migration.py) ---------------------------
    def export_stream(self, request_id: str) -> StreamExport:
        """Take an unfinished request out between steps and return its portable state (times
        relative to now); this engine forgets it (its KV in both tiers and its text state now,
        its executor state on the next step).  ValueError if it is unknown."""
        state = self.scheduler.export_stream(request_id)
        self.outputs.drop(request_id)
        return state.shifted(-self.core.clock.now())

    def import_stream(self, exported: StreamExport, grammar: CompiledGrammar | None = None) -> None:
        """Go on with a stream another engine exported: a started one resumes by recompute, and
        its deltas carry only the tokens and text after those it produced there (a seeded
        stream draws what it would have: tokenflow/model/sampler.py; one held to a grammar has
        its matcher advanced by the tokens it produced: tokenflow/model/grammar.py).  An
        exported state's times are seconds relative to its export, put on this engine's clock
        here (the time the state took to arrive is not counted).  ValueError as
        `add_request`."""
        state = exported.shifted(self.core.clock.now())
        prompt, outputs = list(state.prompt_token_ids), list(state.output_token_ids)
        self.validate(prompt, state.sampling_params)
        self.outputs.resume(state.request_id, prompt, state.sampling_params, outputs)
        try:
            if self.grammars is not None:  # (validate refused a grammar where there is none)
                self.grammars.resume(state.request_id, state.sampling_params, outputs, grammar)
            self.scheduler.import_stream(state)
        except Exception:
            self.outputs.drop(state.request_id)
            if self.grammars is not None:
                self.grammars.release([state.request_id])
            raise

    def abort(self, request_id: str) -> GenerationDelta | None:
        """Abort a request; its closing delta, or None if it had already ended."""
        if not self.core.abort(request_id):
            return None
        return self.outputs.aborted(request_id)

    @property
    def has_work(self) -> bool:
        return self.core.has_work

    def step(self) -> tuple[bool, list[GenerationDelta]]:
        """One engine step: (did anything run, the deltas it produced).

        Raises only when the scheduler itself fails (no plan to blame); a plan whose execution
        raises fails just its own requests.
        """
        self._moves.before_step(self.scheduler)
        try:
            plan, outputs = self.core.step()
        except StepFailed as failed:  # attributed to the plan's requests alone
            return True, self._fail_plan(failed.plan, failed.__cause__)
        self._moves.after_step(self.scheduler, self.core.clock.now())
        processed = self.outputs.process(outputs)  # (failed rows come ended, with `error`)
        for request_id in processed.stopped_request_ids:
            self.scheduler.finish_request(request_id, FinishReason.STOP)
        for request_id in processed.failed_request_ids:
            self.core.abort(request_id)
        return not plan.is_empty, processed.deltas

    def _fail_plan(self, plan: StepPlan, err: Exception) -> list[GenerationDelta]:
        """End every request the failed plan touched (chunks and copies) with an error."""
        logger.error("a step failed; ending only its requests", exc_info=err)
        self.scheduler.kv.end_step()  # the copies of the plan are over, one way or another
        request_ids = [c.request_id for c in plan.chunks]
        request_ids += [c.request_id for c in (*plan.device_to_host, *plan.host_to_device)]
        reason = f"engine step failed: {type(err).__name__}: {err}"
        deltas: list[GenerationDelta] = []
        for request_id in dict.fromkeys(request_ids):
            self.core.abort(request_id)
            delta = self.outputs.failed(request_id, reason)
            if delta is not None:
                deltas.append(delta)
        return deltas

    def stats(self) -> EngineStats:
        """A snapshot of queues, tiers and counters."""
        s = self.scheduler
        now = self.core.clock.now()
        running = list(s.running)
        return EngineStats(
            num_waiting=len(s.waiting),
            num_running=len(running),
            num_preempted=len(s.preempted),
            device_kv_usage=s.kv.device_usage,
            host_kv_usage=s.kv.host_usage,
            num_preemptions_total=s.num_preemptions_total,
            num_loads_total=s.num_loads_total,
            num_recomputes_total=s.num_recomputes_total,
            buffer_slack_s=tuple(
                r.slack_s(now) for r in running if r.state is RequestState.RUNNING
            ),
            prefix_cache_queries_total=s.num_prefix_queried_tokens,
            prefix_cache_hits_total=s.num_prefix_hit_tokens,
            prefix_cache_host_hits_total=s.num_prefix_host_hit_tokens,
            num_cached_device_blocks=s.kv.num_cached_device_blocks,
            num_cached_host_blocks=s.kv.num_cached_host_blocks,
        )

    def streams(self, limit: int) -> StreamsSnapshot:
        """The unfinished streams (the `limit` most urgent) and the scheduler's state, now."""
        now = self.core.clock.now()
        return take_snapshot(self.scheduler, now, limit, self.args.policy, self._moves.last)

    def close(self) -> None:
        """Stop the executor (its copy worker, or llama.cpp's context) and the grammar
        compile workers."""
        self.executor.close()
        if self.grammars is not None:
            self.grammars.close()
