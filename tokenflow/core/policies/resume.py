"""Resume mode (paper section 4.2, step 3): reload a paused stream's KV, or recompute it."""

from __future__ import annotations

from tokenflow.core.policies.base import SchedulingView, Start
from tokenflow.core.policies.pricing import recompute_price_s, seconds_per_block
from tokenflow.core.request import Request


def queued_io_blocks(view: SchedulingView) -> int:
    """Blocks the link must move before a new load starts: the eviction queue and the blocks
    of loads in flight not yet copied."""
    return view.kv.num_evicting_blocks + view.kv.num_queued_load_blocks


def resume_start(view: SchedulingView, request: Request, queued_blocks: int) -> Start:
    """Reload when t_IO (the `queued_blocks` ahead of it plus its own) is at most the recompute
    time, or when the load lands before the reader runs dry (beyond the paper, whose rule is
    the first clause: a recompute takes the whole batch's compute, a load only this stream's
    time); recompute when the host holds no copy."""
    kv, computed = view.kv, request.num_computed_tokens
    if not kv.has_host_copy(request.request_id, computed):
        return Start(request.request_id, by_load=False)
    io_s = (queued_blocks + kv.blocks_for(computed)) * seconds_per_block(view)
    in_time = io_s < request.slack_s(view.now_s)
    by_load = io_s <= recompute_price_s(view.estimator, request) or in_time
    return Start(request.request_id, by_load=by_load)
