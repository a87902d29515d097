"""What a policy is shown: the `SchedulingView`, and the admission reserve it carries.

Both owners of requests that a core policy decides for build their views here: the core's
`Scheduler`, and the vLLM plugin's `PolicyBridge` (tokenflow/integrations/vllm/bridge.py),
which mirrors vLLM's requests.  Each keeps the same pieces (`ViewSource`), so a field of the
view is filled in one place.

The reserve (`ReserveRatio`) keeps device blocks free for the residents' future tokens: a
share of their remaining output, the new-token ratio (SGLang's schedule).  It starts where the
policy says (`Policy.init_new_token_ratio`), decays every step to
`SchedulerConfig.min_new_token_ratio`, and returns to its start after an out-of-memory
retraction: admission was too eager.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from tokenflow.core.config import SchedulerConfig
from tokenflow.core.estimator import StepTimeEstimator
from tokenflow.core.kv_manager import KVTierManager
from tokenflow.core.policies.base import SchedulingView
from tokenflow.core.request import Request


class ReserveRatio:
    """The admission reserve's new-token ratio through its cycle: start, decay, reset."""

    def __init__(self, config: SchedulerConfig, start: float) -> None:
        self.config = config
        self.start = start  # where it begins, and returns to after an out-of-memory retraction
        self.value = start

    def decay(self) -> None:
        """One step later: down to the minimum (`SchedulerConfig.decayed_new_token_ratio`)."""
        self.value = self.config.decayed_new_token_ratio(self.value, self.start)

    def reset(self) -> None:
        """Decoding ran out of blocks: reserve as much as at the start again."""
        self.value = self.start

    def reserved_blocks(self, kv: KVTierManager, remaining_output_tokens: int) -> int:
        """Device blocks admission keeps free: the ratio of the output the residents may
        still generate (summed in tokens, then rounded up to blocks, as SGLang does)."""
        return kv.blocks_for(int(remaining_output_tokens * self.value))


class ViewSource(Protocol):
    """What an owner of requests keeps for its policy's views."""

    kv: KVTierManager
    estimator: StepTimeEstimator
    config: SchedulerConfig
    reserve: ReserveRatio
    num_preemptions_total: int

    @property
    def num_requests_seen(self) -> int: ...


def build_view(
    source: ViewSource,
    now_s: float,
    running: Sequence[Request],
    preempted: Sequence[Request],
    waiting: Sequence[Request],
    remaining_output_tokens: int,
) -> SchedulingView:
    """The view at `now_s` of requests by state (each in first-come-first-served order);
    `remaining_output_tokens`: summed over `running`, what the reserve is a share of."""
    reserve = source.reserve
    return SchedulingView(
        now_s=now_s,
        running=running,
        preempted=preempted,
        waiting=waiting,
        kv=source.kv,
        estimator=source.estimator,
        config=source.config,
        new_token_ratio=reserve.value,
        num_reserved_blocks=reserve.reserved_blocks(source.kv, remaining_output_tokens),
        num_preemptions_total=source.num_preemptions_total,
        num_requests_seen=source.num_requests_seen,
    )
