"""The device prefix cache through the scheduler, with a fake executor (block size 4)."""

import random

import pytest

from tests.core.helpers import (
    FakeExecutor,
    ManualClock,
    assert_every_request_ended_whole,
    make_request,
    run_to_completion,
    run_with_aborts,
)
from tests.core.test_randomized import TIGHT
from tokenflow.core.config import SchedulerConfig
from tokenflow.core.engine_core import EngineCore
from tokenflow.core.kv_manager import KVConfig
from tokenflow.core.policies import POLICY_NAMES, make_policy
from tokenflow.core.request import Consumption, Request, SamplingParams
from tokenflow.core.scheduler import Scheduler

CONFIG = SchedulerConfig(link_bytes_per_s=1e6, initial_decode_step_s=0.01, chunk_tokens=32)


def make_core(
    policy: str = "fcfs",
    prefix_caching: bool = True,
    num_device_blocks: int = 64,
    num_host_blocks: int = 256,
    config: SchedulerConfig = CONFIG,
) -> tuple[EngineCore, ManualClock, FakeExecutor]:
    """A core whose every step runs `check_integrity` (EngineCore's check_integrity)."""
    clock = ManualClock()
    executor = FakeExecutor(clock, 0.01)
    kv = KVConfig(num_device_blocks, num_host_blocks, 4, 1000, prefix_caching=prefix_caching)
    scheduler = Scheduler(config, kv, make_policy(policy, config))
    return EngineCore(scheduler, executor, clock, check_integrity=True), clock, executor


def first_chunk_of(core: EngineCore, request_id: str):
    """Step until a chunk of `request_id` is planned; that chunk."""
    for _ in range(100):
        plan, _ = core.step()
        for chunk in plan.chunks:
            if chunk.request_id == request_id:
                return chunk
    raise AssertionError(f"{request_id} was never scheduled")


@pytest.mark.parametrize("policy", ["fcfs", "chunked"])
def test_a_second_prompt_with_a_common_prefix_starts_computing_after_it(policy):
    core, clock, _ = make_core(policy)
    a = make_request("a", num_prompt=22, max_tokens=8)  # tokens 3..24: 5 full blocks
    core.add_request(a)
    core.step()  # a's prompt is computed: its 5 full blocks are cached
    b = make_request("b", num_prompt=30, max_tokens=5)  # tokens 3..32: agrees on 22
    core.add_request(b)
    chunk = first_chunk_of(core, "b")
    assert (chunk.start_position, chunk.num_tokens) == (20, 10)
    assert chunk.block_table_start == 0 and len(chunk.new_block_ids) == 8  # its whole table
    assert chunk.new_block_ids[:5] == core.scheduler.kv.device_block_ids("a")[:5]
    assert b.num_cached_tokens == 20 and a.num_cached_tokens == 0
    run_to_completion(core, clock)
    assert b.output_token_ids == [100 + (30 + j) % 50 for j in range(5)]
    kv = core.scheduler.kv
    assert kv.num_free_device_blocks == kv.config.num_device_blocks


def test_an_identical_prompt_leaves_its_last_block_to_compute():
    core, clock, _ = make_core()
    core.add_request(make_request("a", num_prompt=20, max_tokens=2))  # exactly 5 full blocks
    run_to_completion(core, clock)  # a is gone: its cached blocks are cached-free
    b = make_request("b", num_prompt=20, max_tokens=2)
    core.add_request(b)
    chunk = first_chunk_of(core, "b")
    assert (chunk.start_position, chunk.num_tokens) == (16, 4) and chunk.samples_token
    assert b.num_cached_tokens == 16


def test_without_prefix_caching_every_prompt_is_computed_whole():
    core, clock, _ = make_core(prefix_caching=False)
    core.add_request(make_request("a", num_prompt=22, max_tokens=8))
    core.step()
    b = make_request("b", num_prompt=30, max_tokens=5)
    core.add_request(b)
    chunk = first_chunk_of(core, "b")
    assert (chunk.start_position, chunk.num_tokens, b.num_cached_tokens) == (0, 30, 0)


@pytest.mark.parametrize("sampling", [{"prompt_logprobs": 1}, {"repetition_penalty": 1.2}])
def test_a_request_whose_sampling_reads_the_whole_prompt_computes_it(sampling):
    """Prompt logprobs need every position's logits; a repetition penalty, every prompt token
    in the chunks (the executor learns them there)."""
    core, clock, _ = make_core()
    core.add_request(make_request("a", num_prompt=22, max_tokens=8))
    core.step()
    b = make_request("b", num_prompt=30, max_tokens=5, **sampling)
    core.add_request(b)
    chunk = first_chunk_of(core, "b")
    assert (chunk.start_position, b.num_cached_tokens) == (0, 0)


def test_a_next_turn_reuses_the_blocks_of_the_previous_reply():
    """A conversation: turn 2's prompt is turn 1's prompt, its reply and a new message, so it
    reuses the blocks the reply's decodes filled, up to the one its last step filled."""
    core, clock, _ = make_core()
    first = make_request("turn1", num_prompt=10, max_tokens=7)  # 17 tokens, 16 with KV
    core.add_request(first)
    run_to_completion(core, clock)
    prompt = first.prompt_token_ids + tuple(first.output_token_ids) + (5, 6, 7)
    second = Request("turn2", prompt, SamplingParams(max_tokens=3), 20.0, clock.t)
    core.add_request(second)
    chunk = first_chunk_of(core, "turn2")
    assert (chunk.start_position, second.num_cached_tokens) == (16, 16)


def test_a_restart_by_recompute_does_not_look_the_cache_up():
    """Only a request that never started looks up the cache (an imported stream resumes by
    recompute from position 0, as before prefix caching)."""
    core, clock, _ = make_core()
    core.add_request(make_request("a", num_prompt=22, max_tokens=8))
    core.step()
    b = make_request("b", num_prompt=30, max_tokens=8)
    core.add_request(b)
    assert first_chunk_of(core, "b").start_position == 20
    core.step()
    moved = core.scheduler.import_stream(core.scheduler.export_stream("b"))
    chunk = first_chunk_of(core, "b")
    assert (chunk.start_position, moved.num_cached_tokens) == (0, 0)


SYSTEM_PROMPTS = (tuple(range(1000, 1013)), tuple(range(2000, 2006)), ())


def drive(policy: str, seed: int) -> tuple[list, list[Request], EngineCore]:
    """test_randomized's tight setup, with prompts that open with one of a few system prompts
    and aborts; returns the plans, the requests and the core."""
    rng = random.Random(seed)
    core, clock, executor = make_core(
        policy, num_device_blocks=40, num_host_blocks=60, config=TIGHT
    )
    requests = []
    for i in range(30):
        system = rng.choice(SYSTEM_PROMPTS)
        prompt = system + tuple(rng.randrange(3, 9) for _ in range(rng.randint(1, 14)))
        request = Request(
            request_id=f"r{i:02d}",
            prompt_token_ids=prompt,
            sampling_params=SamplingParams(max_tokens=rng.randint(1, 40)),
            rate_tps=rng.choice([2.0, 5.0, 20.0, 200.0]),
            arrival_s=rng.uniform(0, 1.5),
            eos_token_ids=(2,),
        )
        requests.append(request)
    run_with_aborts(core, clock, sorted(requests, key=lambda r: r.arrival_s), rng, policy)
    return executor.plans, requests, core


@pytest.mark.parametrize("policy", POLICY_NAMES)
@pytest.mark.parametrize("seed", [0, 1])
def test_random_workloads_with_shared_prefixes_keep_every_invariant(policy, seed):
    plans, requests, core = drive(policy, seed)
    assert sum(r.num_cached_tokens for r in requests) > 0  # the cache was hit
    assert_every_request_ended_whole(requests, core)


def test_the_shared_prefix_workload_preempts_and_is_deterministic():
    first, _, core = drive("tokenflow", 3)
    assert core.scheduler.num_preemptions_total > 0 and core.scheduler.num_loads_total > 0
    second, _, _ = drive("tokenflow", 3)
    assert first == second


# -- one prefill per prefix, the host tier, and what the policy counts ------------------------
@pytest.mark.parametrize("policy", ["fcfs", "chunked", "tokenflow"])
def test_requests_arriving_together_on_one_prompt_prefill_it_once(policy):
    """n > 1, or users arriving together on one system prompt: the first computes the shared
    blocks, the others wait for them and compute only their own tail."""
    core, clock, executor = make_core(policy)
    requests = [make_request(f"r{i}", num_prompt=30, max_tokens=4) for i in range(4)]
    for request in requests:
        core.add_request(request)
    run_to_completion(core, clock)
    prompt_tokens = sum(
        c.num_tokens for p in executor.plans for c in p.chunks if c.start_position < 30
    )
    assert [r.num_cached_tokens for r in requests] == [0, 28, 28, 28]
    assert prompt_tokens == 30 + 3 * 2  # the prompt once, then each one's last two tokens


def test_a_host_hit_the_policy_loads_starts_loading_and_is_counted():
    """The device lost a finished stream's blocks, the host kept them: a newcomer on the same
    prompt loads them (the link is fast here) instead of computing them."""
    fast_link = SchedulerConfig(link_bytes_per_s=1e9, initial_decode_step_s=0.01, chunk_tokens=32)
    core, clock, executor = make_core(
        "tokenflow", num_device_blocks=16, num_host_blocks=64, config=fast_link
    )  # (a 40-token prompt: 9 full blocks before its last token)
    first = make_request("a", num_prompt=40, max_tokens=2, rate=1000.0)
    core.add_request(first)
    run_to_completion(core, clock)
    kv = core.scheduler.kv
    num_host = min(kv.num_cached_host_blocks, 9)  # written through, kept; the last token computes
    assert num_host >= 2
    assert kv.allocate("other", 16 * 4)  # other work takes the whole device
    kv.drop("other")
    assert kv.num_cached_device_blocks == 0
    second = make_request("b", num_prompt=40, max_tokens=2)
    core.add_request(second)
    plan, _ = core.step()
    assert [c.src_block_id for c in plan.host_to_device] == kv._host_tables["b"][:num_host]
    run_to_completion(core, clock)
    assert second.num_cached_tokens == 4 * num_host
    assert core.scheduler.num_prefix_host_hit_tokens == 4 * num_host
    assert second.output_token_ids == first.output_token_ids


def test_a_host_hit_is_computed_when_the_link_is_slower_than_computing():
    slow_link = SchedulerConfig(link_bytes_per_s=1.0, initial_decode_step_s=0.01, chunk_tokens=32)
    core, clock, executor = make_core(
        "tokenflow", num_device_blocks=16, num_host_blocks=64, config=slow_link
    )
    core.add_request(make_request("a", num_prompt=40, max_tokens=2, rate=1000.0))
    run_to_completion(core, clock)
    kv = core.scheduler.kv
    assert kv.allocate("other", 16 * 4)
    kv.drop("other")
    second = make_request("b", num_prompt=40, max_tokens=2)
    core.add_request(second)
    run_to_completion(core, clock)
    assert not any(p.host_to_device for p in executor.plans)
    assert second.num_cached_tokens == 0 and core.scheduler.num_prefix_host_hit_tokens == 0


def test_admission_charges_only_the_prompt_tokens_a_start_computes():
    core, clock, _ = make_core("tokenflow")
    core.add_request(make_request("a", num_prompt=200, max_tokens=2, rate=1000.0))
    run_to_completion(core, clock)
    scheduler = core.scheduler
    b = make_request("b", num_prompt=210, max_tokens=2)
    scheduler.add_request(b)
    view = scheduler.view(clock.t)
    assert view.start_tokens(b) == 210 - 200
    assert view.start_blocks(b) == 53  # its cached-free prefix leaves the free memory too
    no_cache, clock2, _ = make_core("tokenflow", prefix_caching=False)
    no_cache.scheduler.add_request(make_request("b", num_prompt=210, max_tokens=2))
    view2 = no_cache.scheduler.view(clock2.t)
    assert view2.start_tokens(view2.waiting[0]) == 210


def test_a_shared_block_counts_once_in_the_residents_footprints_and_pausing_frees_only_private():
    core, clock, _ = make_core("fcfs")
    for rid in ("a", "b"):
        core.add_request(make_request(rid, num_prompt=41, max_tokens=30))
    for _ in range(6):
        core.step()
        clock.t += 0.01
    kv, view = core.scheduler.kv, core.scheduler.view(clock.t)
    a, b = (core.scheduler.requests[rid] for rid in ("a", "b"))
    shared = 10  # the prompt's 10 full blocks
    assert kv.num_private_device_blocks("a") == kv.num_device_blocks_of("a") - shared
    assert view.shared_blocks(a) == view.shared_blocks(b) == shared / 2
    total = kv.num_device_blocks_of("a") + kv.num_device_blocks_of("b") - shared
    charged = sum(kv.num_charged_device_blocks(r) for r in ("a", "b"))
    assert charged == pytest.approx(total)


def test_a_finished_readers_blocks_outlast_an_abandoned_requests():
    """Reading retention: an eager request without a session is not expected back, a reader is
    (after reading its answer and thinking); the eager one's blocks go first."""
    core, clock, _ = make_core("fcfs", num_device_blocks=24)
    reader = make_request("reader", num_prompt=40, max_tokens=2, rate=2.0)
    eager = Request(
        "eager",
        tuple(range(500, 540)),
        SamplingParams(max_tokens=2),
        20.0,
        0.0,
        eos_token_ids=(2,),
        consumption=Consumption.EAGER,
    )
    for request in (reader, eager):
        core.add_request(request)
    run_to_completion(core, clock)
    kv = core.scheduler.kv
    assert kv.allocate("other", 14 * 4)  # 4 plain blocks, then 10 cached-free ones
    assert kv.find_prefix(reader.prompt_token_ids).num_device_tokens == 36
    assert kv.find_prefix(eager.prompt_token_ids).num_device_tokens == 0


def test_waiting_requests_on_one_cached_free_prefix_count_it_once():
    """The first in the queue pays for the cached-free blocks they share; the others start
    with their own blocks only (so a burst on one warm system prompt is not refused memory
    it does not need)."""
    core, clock, _ = make_core("tokenflow")
    core.add_request(make_request("warm", num_prompt=41, max_tokens=2, rate=1000.0))
    run_to_completion(core, clock)
    waiting = [make_request(f"w{i}", num_prompt=45, max_tokens=2) for i in range(3)]
    for request in waiting:
        core.scheduler.add_request(request)
    view = core.scheduler.view(clock.t)
    assert [view.shared_blocks(r) for r in reversed(waiting)] == [10, 10, 0]
    assert [view.start_blocks(r) for r in waiting] == [12, 2, 2]
