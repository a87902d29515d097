"""FCFS admission shared by the policies (`fcfs_starts`): strict arrival order over the paused
and waiting requests, without sorting the waiting queue when none is paused."""

from dataclasses import replace

from tests.core.helpers import make_core, make_request
from tokenflow.core.policies.base import fcfs_starts


def _requests(count: int):
    requests = [
        make_request(f"r{i}", num_prompt=4, max_tokens=4, arrival=float(i)) for i in range(count)
    ]
    for index, request in enumerate(requests):
        request.arrival_index = index
    return requests


def test_paused_and_waiting_requests_start_by_arrival() -> None:
    core, _, _ = make_core("fcfs", num_device_blocks=64)
    view = core.scheduler.view(0.0)
    r = _requests(6)
    starts = fcfs_starts(replace(view, preempted=[r[1], r[4]], waiting=[r[0], r[2], r[3], r[5]]))
    assert [s.request_id for s in starts] == [f"r{i}" for i in range(6)]


def test_with_none_paused_the_waiting_queue_is_taken_in_its_order_up_to_the_first_misfit() -> None:
    core, _, _ = make_core("fcfs", num_device_blocks=64)
    view = core.scheduler.view(0.0)
    r = _requests(4)
    big = make_request("big", num_prompt=300, max_tokens=4, arrival=1.5)  # 75 blocks: no room
    big.arrival_index = 9
    starts = fcfs_starts(replace(view, preempted=[], waiting=[r[0], r[1], big, r[2], r[3]]))
    assert [s.request_id for s in starts] == ["r0", "r1"]  # no overtaking past `big`
