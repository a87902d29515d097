"""The step plan's derived counts and the executor-side block tables rebuilt from deltas."""

import pytest

from tests.core.helpers import make_core, make_request, run_to_completion
from tokenflow.core.config import SchedulerConfig
from tokenflow.core.plan import BlockTables, ScheduledChunk, StepPlan
from tokenflow.core.request import SamplingParams

PARAMS = SamplingParams()


def _chunk(rid: str, start: int, n: int, new: tuple[int, ...], at: int, outputs: int = 0):
    return ScheduledChunk(
        request_id=rid,
        token_ids=(5,) * n,
        start_position=start,
        new_block_ids=new,
        block_table_start=at,
        samples_token=True,
        sampling_params=PARAMS,
        num_output_tokens=outputs,
    )


def _plan(*chunks: ScheduledChunk, released: tuple[str, ...] = ()) -> StepPlan:
    return StepPlan(0, chunks, (), (), released)


def test_counts_are_derived_from_the_chunks():
    plan = _plan(_chunk("a", 0, 7, (1, 2), 0), _chunk("b", 9, 1, (), 3, outputs=2))
    assert (plan.num_prefill_tokens, plan.num_decode_tokens) == (7, 1)
    assert plan.num_decode_context_tokens == 10


@pytest.mark.parametrize("policy", ["fcfs", "chunked", "tokenflow"])
def test_each_policy_makes_the_step_kinds_it_promises(policy: str):
    """Prefill-first policies make decode-only and prefill-only steps, the chunked one mixed
    steps too, through retractions and recomputes."""
    optimistic = SchedulerConfig(
        init_new_token_ratio=0.01, min_new_token_ratio=0.01, link_bytes_per_s=1e6, chunk_tokens=9
    )
    core, clock, _ = make_core(
        policy, num_device_blocks=24, block_size=4, scheduler_config=optimistic
    )
    for i in range(8):
        core.add_request(make_request(f"r{i}", num_prompt=5 + 3 * i, max_tokens=30, rate=5.0))
    kinds = set()
    steps = 0
    while core.has_work:
        plan, _ = core.step()
        kinds.add((plan.num_decode_tokens > 0, plan.num_prefill_tokens > 0))
        if plan.is_empty:
            clock.t += 0.005
        steps += 1
        assert steps < 20_000
    assert core.scheduler.num_preemptions_total > 0
    assert {(True, False), (False, True)} <= kinds  # decode-only and prefill-only steps
    if policy == "chunked":
        assert (True, True) in kinds  # and mixed ones


def test_tables_grow_by_deltas_and_restart_from_index_zero():
    tables = BlockTables()
    tables.apply(_plan(_chunk("a", 0, 8, (4, 5), 0)))
    tables.apply(_plan(_chunk("a", 8, 1, (), 2, outputs=1)))
    tables.apply(_plan(_chunk("a", 9, 1, (9,), 2, outputs=2)))
    assert tables["a"] == [4, 5, 9]
    # preempted and brought back: the whole new table comes from index 0
    tables.apply(_plan(_chunk("a", 0, 10, (1, 2, 3), 0)))
    assert tables["a"] == [1, 2, 3]
    tables.apply(_plan(released=("a",)))
    assert len(tables) == 0


def test_scheduler_deltas_rebuild_the_managers_tables_every_step():
    core, clock, executor = make_core("tokenflow", num_device_blocks=24, block_size=4)
    for i in range(6):
        core.add_request(make_request(f"r{i}", num_prompt=9, max_tokens=30, rate=5.0))
    tables = BlockTables()
    steps = 0
    while core.has_work:
        plan, _ = core.step()
        tables.apply(plan)
        for chunk in plan.chunks:
            assert (
                tables[chunk.request_id]
                == list(core.scheduler.kv.device_block_ids(chunk.request_id))
                or chunk.request_id not in core.scheduler.requests
            )
        if plan.is_empty:
            clock.t += 0.005
        steps += 1
        assert steps < 20_000
    assert core.scheduler.num_preemptions_total > 0


def test_queues_are_empty_after_aborts_and_finishes():
    core, clock, _ = make_core("tokenflow", num_device_blocks=24, block_size=4)
    for i in range(8):
        core.add_request(make_request(f"r{i}", num_prompt=9, max_tokens=40, rate=5.0))
    queues = core.scheduler.queues
    for _ in range(30):
        core.step()
        clock.t += 0.01
        remaining = [r.sampling_params.max_tokens - r.num_output_tokens for r in queues.running]
        assert queues.remaining_output_tokens == sum(remaining)  # (the admission reserve's)
    for request_id in ("r1", "r4", "r7"):
        core.abort(request_id)
    run_to_completion(core, clock)
    assert queues.remaining_output_tokens == 0
    assert not (queues.running or queues.preempted or queues.waiting or queues.loading)
    assert not queues.write_candidates and not queues.maybe_prefilling
