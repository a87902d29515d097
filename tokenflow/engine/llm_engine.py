"""The synchronous real engine: model + tiered KV cache + the core's step loop, on a wall clock.

`LLM` (offline) and `AsyncEngine` (serving) both drive one `LLMEngine`.
"""

from __future__ import annotations

import time

import torch

from tokenflow.core.config import SchedulerConfig
from tokenflow.core.engine_core import EngineCore
from tokenflow.core.kv_manager import KVConfig
from tokenflow.core.policies import make_policy
from tokenflow.core.request import FinishReason, Request, RequestState, SamplingParams
from tokenflow.core.scheduler import Scheduler
from tokenflow.engine.engine_args import EngineArgs
from tokenflow.engine.executor import ModelExecutor
from tokenflow.engine.kv_cache import TieredKVCache, available_memory_bytes, bytes_per_block
from tokenflow.engine.loader import load_model
from tokenflow.engine.model_config import ModelLoadError
from tokenflow.engine.output_processor import OutputProcessor
from tokenflow.serving.engine_client import EngineStats, GenerationDelta
from tokenflow.sim.clock import WallClock

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    """ "auto" picks CUDA when present; a CUDA device without CUDA is a clear error."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} requested but CUDA is not available")
    return device


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
    """Add requests, step, read deltas.  Not thread-safe: one thread drives it."""

    def __init__(self, args: EngineArgs) -> None:
        self.args = args
        self.device = resolve_device(args.device)
        if args.num_threads is not None:
            torch.set_num_threads(args.num_threads)
        dtype = _DTYPES[args.dtype] if args.dtype else None
        model, config, tokenizer = load_model(args.model, self.device, dtype, args.weights)
        if tokenizer is None:
            raise ModelLoadError(f"model {args.model} has no tokenizer (tokenizer.json) beside it")
        self.model_config = config
        self.tokenizer = tokenizer
        self.model_name = args.model or "SmolLM2-135M-Instruct"
        self.max_model_len = min(args.max_model_len or 8192, config.max_position_embeddings)
        dtype = next(model.parameters()).dtype
        block_bytes = bytes_per_block(config, args.block_size, dtype)
        num_device_blocks = self._num_device_blocks(block_bytes)
        num_host_blocks = args.host_kv_tokens // args.block_size
        kv_cache = TieredKVCache(
            config, num_device_blocks, num_host_blocks, args.block_size, self.device, dtype
        )
        self.executor = ModelExecutor(model, config, kv_cache, self.device, seed=args.seed)
        scheduler_config = SchedulerConfig(
            max_num_seqs=args.max_num_seqs,
            max_prefill_tokens=args.max_prefill_tokens,
            chunk_tokens=args.chunk_tokens,
            max_model_len=self.max_model_len,
            link_bytes_per_s=measure_copy_bytes_per_s(self.device),
            initial_decode_step_s=0.03 if self.device.type == "cpu" else 0.01,
            initial_prefill_token_s=1e-3 if self.device.type == "cpu" else 1e-5,
        )
        kv_config = KVConfig(num_device_blocks, num_host_blocks, args.block_size, block_bytes)
        policy = make_policy(args.policy, scheduler_config, args.tokenflow)
        self.scheduler = Scheduler(scheduler_config, kv_config, policy)
        self.core = EngineCore(self.scheduler, self.executor, WallClock())
        self.outputs = OutputProcessor(tokenizer)

    def _num_device_blocks(self, block_bytes: int) -> int:
        if self.args.device_kv_fraction is not None:
            free = available_memory_bytes(self.device)
            return max(1, int(free * self.args.device_kv_fraction) // block_bytes)
        return max(1, self.args.device_kv_tokens // self.args.block_size)

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
        if n + params.max_tokens > self.max_model_len:
            raise ValueError(
                f"{n} prompt tokens + max_tokens {params.max_tokens} exceed the context length "
                f"{self.max_model_len}"
            )

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        rate_tps: float | None = None,
    ) -> None:
        """Queue a request (ValueError if it is invalid or can never fit)."""
        self.validate(prompt_token_ids, params)
        request = Request(
            request_id=request_id,
            prompt_token_ids=tuple(prompt_token_ids),
            sampling_params=params,
            rate_tps=rate_tps or self.args.default_rate_tps,
            arrival_s=self.core.clock.now(),
            eos_token_ids=self.model_config.eos_token_ids,
        )
        self.core.add_request(request)
        self.outputs.add(request_id, prompt_token_ids, params)

    def abort(self, request_id: str) -> GenerationDelta | None:
        """Abort a request; its closing delta, or None if it had already ended."""
        if not self.core.abort(request_id):
            return None
        return self.outputs.aborted(request_id)

    @property
    def has_work(self) -> bool:
        return self.core.has_work

    def step(self) -> tuple[bool, list[GenerationDelta]]:
        """One engine step: (did anything run, the deltas it produced)."""
        plan, outputs = self.core.step()
        processed = self.outputs.process(outputs)
        for request_id in processed.stopped_request_ids:
            self.scheduler.finish_request(request_id, FinishReason.STOP)
        return not plan.is_empty, processed.deltas

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
        )

    def close(self) -> None:
        """Stop the executor's copy worker."""
        self.executor.close()
