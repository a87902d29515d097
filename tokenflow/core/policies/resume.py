"""Resume mode (paper section 4.2, step 3): reload a paused stream's KV, or recompute it."""

from __future__ import annotations

from tokenflow.core.policies.base import SchedulingView, Start
from tokenflow.core.request import Request, RequestState


def resume_start(view: SchedulingView, request: Request, queued_blocks: int) -> Start:
    """Reload when t_IO (the `queued_blocks` ahead of it plus its own) is at most the recompute
    time, or when the load lands before the reader runs dry (beyond the paper, whose rule is
    the first clause: a recompute takes the whole batch's compute, a load only this stream's
    time); recompute when the host holds no copy.  A newcomer starts as `view.start_for` says
    (its cached prefix's host part loaded by the first clause's rule)."""
    if request.state is RequestState.WAITING:
        return view.start_for(request)
    kv, computed = view.kv, request.num_computed_tokens
    if not kv.has_host_copy(request.request_id, computed):
        return Start(request.request_id, by_load=False)
    blocks = kv.blocks_for(computed)
    in_time = (queued_blocks + blocks) * view.seconds_per_block < request.slack_s(view.now_s)
    by_load = view.loads_faster(blocks, request.num_tokens, queued_blocks) or in_time
    return Start(request.request_id, by_load=by_load)
