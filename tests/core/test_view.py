"""The admission reserve's cycle and the view builder the scheduler and the vLLM bridge share."""

import pytest

from tests.core.helpers import make_core, make_request
from tokenflow.core.config import SchedulerConfig
from tokenflow.core.kv_manager import KVConfig, KVTierManager
from tokenflow.core.policies.base import SchedulingView
from tokenflow.core.request import PreemptMode
from tokenflow.core.view import ReserveRatio


def test_reserve_ratio_decays_evenly_to_the_minimum_and_resets_to_its_start():
    config = SchedulerConfig(min_new_token_ratio=0.1, new_token_ratio_decay_steps=4)
    reserve = ReserveRatio(config, start=0.5)
    assert reserve.value == 0.5
    seen = []
    for _ in range(6):
        reserve.decay()
        seen.append(reserve.value)
    assert seen == pytest.approx([0.4, 0.3, 0.2, 0.1, 0.1, 0.1])  # (0.5 - 0.1) / 4 a step
    reserve.reset()
    assert reserve.value == reserve.start == 0.5


def test_reserved_blocks_round_the_ratio_of_the_remaining_output_up_to_blocks():
    kv = KVTierManager(KVConfig(16, 0, block_size=4, block_bytes=100))
    reserve = ReserveRatio(SchedulerConfig(), start=0.5)
    assert reserve.reserved_blocks(kv, 0) == 0
    assert reserve.reserved_blocks(kv, 9) == 1  # 4.5 tokens, cut to 4: one block
    assert reserve.reserved_blocks(kv, 10) == 2  # 5 tokens: two blocks
    reserve.value = 0.0
    assert reserve.reserved_blocks(kv, 10) == 0


def test_scheduler_decays_its_reserve_each_step_from_the_policys_start():
    config = SchedulerConfig(
        init_new_token_ratio=0.7, min_new_token_ratio=0.1, new_token_ratio_decay_steps=6
    )
    core, _, _ = make_core("fcfs", scheduler_config=config)
    scheduler = core.scheduler
    assert scheduler.new_token_ratio == scheduler.reserve.start == 0.7
    core.add_request(make_request("a"))
    core.step()
    core.step()
    assert scheduler.new_token_ratio == pytest.approx(0.5)  # (0.7 - 0.1) / 6 a step


def test_scheduler_view_is_the_state_the_policy_decides_on():
    config = SchedulerConfig(init_new_token_ratio=0.5, min_new_token_ratio=0.5)
    core, clock, _ = make_core("fcfs", block_size=4, scheduler_config=config)
    scheduler = core.scheduler
    for request_id in ("run", "pause", "next"):
        core.add_request(make_request(request_id, num_prompt=8, max_tokens=9))
    core.step()  # all three start, one token each
    paused = scheduler.requests["pause"]
    scheduler._preempt(paused, PreemptMode.RECOMPUTE)
    core.add_request(make_request("late", num_prompt=8, max_tokens=9))
    running = (scheduler.requests["run"], scheduler.requests["next"])
    assert scheduler.view(clock.t) == SchedulingView(
        now_s=clock.t,
        running=running,
        preempted=(paused,),
        waiting=(scheduler.requests["late"],),
        kv=scheduler.kv,
        estimator=scheduler.estimator,
        config=config,
        new_token_ratio=0.5,
        num_reserved_blocks=2,  # 0.5 x (8 + 8) output tokens left = 8 tokens: two blocks
        num_preemptions_total=1,
        num_requests_seen=4,
    )
