"""Small hand-built states for TokenFlow's decision tests."""

from __future__ import annotations

import math
from dataclasses import replace

from tests.core.helpers import make_core, make_request
from tokenflow.core.config import SchedulerConfig, TokenFlowConfig
from tokenflow.core.kv_manager import KVConfig, KVTierManager
from tokenflow.core.policies.base import SchedulingView
from tokenflow.core.policies.pricing import Member
from tokenflow.core.request import Consumption, RequestState

OPTIMISTIC = SchedulerConfig(
    init_new_token_ratio=0.01,
    min_new_token_ratio=0.01,
    link_bytes_per_s=1e6,
    initial_decode_step_s=0.05,
)


def three_streams(
    tokenflow_config: TokenFlowConfig | None = None,
    consumption: Consumption = Consumption.READER,
):
    """R1 reads slowly (big buffer; or is consumed as `consumption` says), R2 about as fast as
    it is generated, R3 arrives at 1 s.  The device holds 24 blocks of 4 tokens: R1 and R2
    fill 20, R3 needs 5 more."""
    core, clock, _ = make_core(
        "tokenflow",
        num_device_blocks=24,
        step_s=0.05,
        scheduler_config=OPTIMISTIC,
        tokenflow_config=tokenflow_config,
    )
    r1 = make_request("R1", num_prompt=20, max_tokens=60, rate=2.0, consumption=consumption)
    r2 = make_request("R2", num_prompt=20, max_tokens=60, rate=15.0)
    core.add_request(r1)
    core.add_request(r2)
    while clock.t < 0.99:
        core.step()
    r3 = make_request("R3", num_prompt=20, max_tokens=60, rate=2.0, arrival=clock.t)
    core.add_request(r3)
    return core, clock, (r1, r2, r3)


def member(
    name: str,
    utility: float,
    blocks: int,
    pinned: bool = False,
    resident: bool = True,
    arrival: float = 0.0,
    rate: float = 20.0,
    started: bool = True,
    consumption: Consumption = Consumption.READER,
    **fields: object,
) -> Member:
    """A member record with the given priority fields (pausable, with any margin, unless
    pinned or given a `pause_margin_s`)."""
    request = make_request(name, arrival=arrival, rate=rate, consumption=consumption)
    request.arrival_index = int(arrival * 1000)
    if started:
        request.append_token(7, arrival)
    if resident and started:  # (decoding on the device)
        request.state = RequestState.RUNNING
        request.num_computed_tokens = request.num_tokens - 1
    values: dict = dict(is_urgent=False, is_overdue=False, resume_s=0.0)
    values.update(fields)
    pausable = resident and not pinned
    values.setdefault("pause_margin_s", math.inf if pausable else -math.inf)
    return Member(request, utility, blocks, resident, **values)


def empty_view(num_device_blocks: int, num_host_blocks: int = 0) -> SchedulingView:
    """A view with no requests over fresh KV tiers of blocks of 4 tokens."""
    core, clock, _ = make_core("tokenflow", scheduler_config=OPTIMISTIC)
    view = core.scheduler.view(clock.t)
    kv = KVTierManager(KVConfig(num_device_blocks, num_host_blocks, 4, block_bytes=1000))
    return replace(view, kv=kv)


def full_view(
    num_device_blocks: int, num_host_blocks: int, pausable: dict[str, tuple[int, int]]
) -> tuple[SchedulingView, list[Member]]:
    """A view whose device tier is all owned: by pausable members (name -> (device blocks,
    blocks of them not yet on the host)) and by someone the policy does not see."""
    view = empty_view(num_device_blocks, num_host_blocks)
    kv = view.kv
    assert isinstance(kv, KVTierManager)
    members = []
    for name, (blocks, unsynced) in pausable.items():
        m = member(name, 0.0, blocks)
        m.request.num_computed_tokens = blocks * 4
        assert kv.allocate(name, blocks * 4)
        kv.plan_write_through([(name, (blocks - unsynced) * 4)], blocks)
        members.append(m)
    kv.allocate("owner", kv.num_free_device_blocks * 4)
    return view, members
