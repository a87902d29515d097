"""TokenFlow's scheduler with vLLM's own `OffloadingConnector`, on the CPU.

vLLM's offloading worker runs on CUDA-alike and XPU GPUs only, but its scheduler side (store
and load planning, the LRU host pool) is plain Python.  These tests run vLLM's real scheduler
side under `TokenFlowScheduler` with a fake worker: every scheduled token is "computed", a load
completes in its step, and a store completes one step after it was planned (as vLLM's worker
submits stores at the start of the next step).  The scheduler's clock is a step clock.
"""

from __future__ import annotations

import types
from dataclasses import dataclass, field

import pytest
import torch
from vllm import SamplingParams
from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
    OffloadingWorkerMetadata,
)
from vllm.engine.arg_utils import EngineArgs
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

from tokenflow.integrations.vllm import scheduler as scheduler_module
from tokenflow.integrations.vllm.offload_pool import OffloadPool
from tokenflow.integrations.vllm.scheduler import TokenFlowScheduler
from tokenflow.integrations.vllm.serve import offloading_transfer_config

from .conftest import SCHEDULER_CLS

BLOCK_SIZE = 16
NUM_BLOCKS = 9  # 8 usable: 128 tokens for every stream together
STEP_S = 0.05  # the step clock
POLICY = {"schedule_interval_s": 0.1, "critical_slack_s": 0.2}
SPEC = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=1, head_size=8, dtype=torch.float32)
CHUNK_BYTES = 4096  # one block (1 KiB) rounded up to the pool's alignment


@dataclass
class StepClock:
    """`time` for the scheduler module: monotonic() is the step count times STEP_S."""

    now_s: float = 0.0

    def monotonic(self) -> float:
        return self.now_s


def make_scheduler(model_dir: str, num_pool_blocks: int, extra: dict | None = None):
    """`TokenFlowScheduler` over a 9-block pool, with vLLM's OffloadingConnector's scheduler
    side and a host pool of `num_pool_blocks` blocks (as `serve` configures it on a GPU)."""
    transfer = offloading_transfer_config()
    transfer["kv_connector_extra_config"] = {
        **transfer["kv_connector_extra_config"],
        "cpu_bytes_to_use": num_pool_blocks * CHUNK_BYTES,
        **(extra or {}),
    }
    config = EngineArgs(
        model=model_dir,
        dtype="float32",
        block_size=BLOCK_SIZE,
        max_model_len=256,
        max_num_seqs=8,
        enforce_eager=True,
        enable_prefix_caching=True,
        num_gpu_blocks_override=NUM_BLOCKS,
        kv_cache_memory_bytes=64 << 20,
        kv_transfer_config=KVTransferConfig(**transfer),
        scheduler_cls=SCHEDULER_CLS,
        additional_config={"tokenflow": {"policy": POLICY}},
    ).create_engine_config()
    config.cache_config.num_gpu_blocks = NUM_BLOCKS
    kv_cache_config = KVCacheConfig(
        num_blocks=NUM_BLOCKS,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["layer.0"], SPEC)],
    )
    return TokenFlowScheduler(
        vllm_config=config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(config),
        block_size=BLOCK_SIZE,
    )


@dataclass
class Run:
    """What a run of the fake engine saw, step by step."""

    loaded_tokens: dict[str, list[int]] = field(default_factory=dict)  # per resume by load
    copies_at_start: list[tuple[str, int, int]] = field(default_factory=list)
    num_resumes: int = 0


def run(scheduler: TokenFlowScheduler, clock: StepClock, num_steps: int) -> Run:
    """Six streams read at 1 tok/s, 32-token prompts, 80 tokens out; returns what happened."""
    init_none_hash(sha256)
    hasher = get_request_block_hasher(BLOCK_SIZE, sha256)
    for i in range(6):
        params = SamplingParams(max_tokens=80, ignore_eos=True, extra_args={"stream_rate": 1.0})
        prompt = list(range(1000 * i, 1000 * i + 32))
        scheduler.add_request(Request(f"r{i}", prompt, params, None, block_hasher=hasher))
    seen = Run()
    pending_stores: dict[int, int] = {}
    for _ in range(num_steps):
        was_paused = {r.request_id for r in scheduler.waiting if r.num_preemptions}
        output = scheduler.schedule()
        _record_resumes(scheduler, output, was_paused, seen)
        meta = output.kv_connector_metadata
        done = {job_id: 1 for job_id in [*meta.load_jobs, *pending_stores]}
        pending_stores = dict.fromkeys(meta.store_jobs, 1)
        ids = list(output.num_scheduled_tokens)
        sampled = [[7] if _is_done_prefilling(scheduler, i) else [] for i in ids]
        worker = OffloadingWorkerMetadata(completed_jobs=done)
        loads = {job.req_id for job in meta.load_jobs.values()}
        result = ModelRunnerOutput(
            req_ids=ids,
            req_id_to_index={request_id: n for n, request_id in enumerate(ids)},
            sampled_token_ids=sampled,
            kv_connector_output=KVConnectorOutput(
                finished_recving=loads, kv_connector_worker_meta=worker
            ),
        )
        scheduler.update_from_output(output, result)
        clock.now_s += STEP_S
    return seen


def _is_done_prefilling(scheduler: TokenFlowScheduler, request_id: str) -> bool:
    request = scheduler.requests[request_id]
    return request.num_computed_tokens >= request.num_tokens


def _record_resumes(scheduler, output, was_paused: set[str], seen: Run) -> None:
    """For each paused stream vLLM took up this step: the mirror's copy when the policy started
    it (the bridge changes it only at the next view), and the tokens vLLM did not compute (its
    GPU prefix-cache hit plus what the pool loads)."""
    still_waiting = {r.request_id for r in scheduler.waiting}
    for request_id in sorted(was_paused - still_waiting):
        request = scheduler.requests.get(request_id)
        if request is None:
            continue
        seen.num_resumes += 1
        reused = request.num_computed_tokens - output.num_scheduled_tokens.get(request_id, 0)
        copy_tokens = scheduler.bridge.kv.synced_tokens(request_id)
        seen.copies_at_start.append((request_id, copy_tokens, reused))
    for job in output.kv_connector_metadata.load_jobs.values():
        seen.loaded_tokens.setdefault(job.req_id, []).append(
            len(job.dst_spec.block_ids) * BLOCK_SIZE
        )


@pytest.fixture
def clock(monkeypatch) -> StepClock:
    clock = StepClock()
    monkeypatch.setattr(scheduler_module, "time", types.SimpleNamespace(monotonic=clock.monotonic))
    return clock


def test_the_scheduler_prices_with_vllms_pool_when_it_runs_vllms_connector(model_dir, clock):
    scheduler = make_scheduler(model_dir, num_pool_blocks=40)
    pool = scheduler.offload_pool
    assert isinstance(pool, OffloadPool) and scheduler.host_kv is None
    assert pool.num_blocks == 40 and pool.block_bytes == SPEC.page_size_bytes
    assert pool.offloads_decode_blocks
    bridge = scheduler.bridge
    assert bridge.can_offload and bridge.write_through
    assert bridge.kv.config.num_host_blocks == 40 and bridge.kv.config.block_bytes == 1024


def test_paused_streams_resume_from_the_pool_and_every_copy_priced_as_a_load_is_loaded(
    model_dir, clock
):
    scheduler = make_scheduler(model_dir, num_pool_blocks=64)
    seen = run(scheduler, clock, num_steps=160)
    bridge = scheduler.bridge
    assert bridge.num_offloads >= 2 and seen.num_resumes >= 2
    assert seen.loaded_tokens, "no paused stream came back from the pool"
    assert bridge.num_copies_lost == 0  # a pool of 64 blocks holds every copy here
    for request_id, copy_tokens, reused_tokens in seen.copies_at_start:
        assert reused_tokens >= copy_tokens, (request_id, copy_tokens, reused_tokens)
    bridge.kv.check_integrity()


def test_copies_a_small_pool_evicts_are_dropped_before_they_are_priced_as_loads(model_dir, clock):
    # 10 pool blocks for six streams of up to 7 blocks each: the LRU pool evicts paused
    # streams' oldest (prompt) chunks, so their copies are lost from the front.
    scheduler = make_scheduler(model_dir, num_pool_blocks=10)
    seen = run(scheduler, clock, num_steps=160)
    assert scheduler.bridge.num_copies_lost >= 1
    for request_id, copy_tokens, reused_tokens in seen.copies_at_start:
        assert reused_tokens >= copy_tokens, (request_id, copy_tokens, reused_tokens)
    scheduler.bridge.kv.check_integrity()


def test_a_prompt_only_pool_is_not_mirrored_as_write_through(model_dir, clock):
    scheduler = make_scheduler(model_dir, 64, extra={"offload_prompt_only": True})
    assert not scheduler.offload_pool.offloads_decode_blocks
    assert scheduler.bridge.can_offload and not scheduler.bridge.write_through
    seen = run(scheduler, clock, num_steps=120)
    for request_id, copy_tokens, reused_tokens in seen.copies_at_start:
        assert reused_tokens >= copy_tokens, (request_id, copy_tokens, reused_tokens)
