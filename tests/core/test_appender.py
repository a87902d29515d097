"""`update` pairs the executor's tokens with the plan's requests by position (step semantics 4):
only the last plan, once; one token per sampling chunk, in chunk order; through retractions."""

import dataclasses

import pytest

from tests.core.helpers import make_core, make_request
from tokenflow.core.config import SchedulerConfig
from tokenflow.core.plan import SampledToken, StepResult


def _decoding_core(num_streams: int = 4):
    """A core whose next step decodes `num_streams` streams."""
    core, clock, executor = make_core("chunked")
    for i in range(num_streams):
        core.add_request(make_request(f"r{i}", num_prompt=6 + i, max_tokens=20))
    core.step()
    core.step()
    return core, clock, executor


def test_update_takes_the_last_plan_and_only_once():
    core, clock, executor = _decoding_core()
    scheduler = core.scheduler
    plan = scheduler.schedule(clock.t)
    result = executor.execute(plan)
    with pytest.raises(ValueError, match="not the last plan"):
        scheduler.update(dataclasses.replace(plan), result, clock.t)  # equal, but another plan
    scheduler.update(plan, result, clock.t)
    with pytest.raises(ValueError, match="applied already"):
        scheduler.update(plan, result, clock.t)


@pytest.mark.parametrize("change", ["drop", "extra"])
def test_update_rejects_a_token_missing_or_extra(change: str):
    core, clock, executor = _decoding_core()
    scheduler = core.scheduler
    plan = scheduler.schedule(clock.t)
    sampled = executor.execute(plan).sampled
    assert len(sampled) == 4
    sampled = sampled[:-1] if change == "drop" else sampled + (SampledToken("r0", 5),)
    with pytest.raises(ValueError, match="tokens sampled for 4 chunks"):
        scheduler.update(plan, StepResult(sampled), clock.t)


def test_update_rejects_decode_tokens_out_of_chunk_order():
    core, clock, executor = _decoding_core()
    scheduler = core.scheduler
    plan = scheduler.schedule(clock.t)
    assert [c.num_tokens for c in plan.chunks] == [1, 1, 1, 1]
    sampled = executor.execute(plan).sampled
    with pytest.raises(ValueError, match="token 0 is 'r3'"):
        scheduler.update(plan, StepResult(sampled[::-1]), clock.t)


@pytest.mark.parametrize("policy", ["fcfs", "chunked", "tokenflow"])
def test_tokens_reach_their_own_requests_through_retractions(policy: str):
    """The fake executor's token is a function of the position it follows; a token paired with
    the wrong request would break the sequence.  Memory is short (optimistic admission), so
    decoding streams are retracted while their step's chunks are being built."""
    optimistic = SchedulerConfig(
        init_new_token_ratio=0.01, min_new_token_ratio=0.01, link_bytes_per_s=1e6, chunk_tokens=32
    )
    core, clock, _ = make_core(
        policy, num_device_blocks=24, block_size=4, scheduler_config=optimistic
    )
    requests = [make_request(f"r{i}", num_prompt=5 + 3 * i, max_tokens=30) for i in range(8)]
    for request in requests:
        core.add_request(request)
    num_retracted = 0  # streams running before a step and taken off the device in it
    steps = 0
    while core.has_work:
        before = {r: r.num_preemptions for r in core.scheduler.running}
        plan, outputs = core.step()
        num_retracted += sum(r.num_preemptions > n for r, n in before.items())
        for output in outputs:
            request = next(r for r in requests if r.request_id == output.request_id)
            position = request.num_prompt_tokens + output.num_output_tokens - 1
            assert output.new_token_ids == (100 + position % 50,)
        if plan.is_empty:
            clock.t += 0.005
        steps += 1
        assert steps < 20_000
    assert num_retracted > 0
    for request in requests:
        num_prompt = request.num_prompt_tokens
        assert request.output_token_ids == [100 + (num_prompt + j) % 50 for j in range(30)]
