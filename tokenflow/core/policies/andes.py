"""Andes (arXiv 2404.16283): QoE-aware preemption by a greedy knapsack, as re-implemented in the
TokenFlow paper (recompute-based preemption).

Only when device KV use exceeds `kv_usage_threshold` and someone is off the device, it predicts
each stream's QoE gain from being served for the next `horizon_s` versus waiting, ranks streams
by gain per context token, and packs them into device memory for each candidate batch size B,
keeping the B with the largest total gain.  Anti-thrashing: no preemption once preemptions reach
`max_preemptions_per_request` per request seen.
"""

from __future__ import annotations

from tokenflow.core.config import AndesConfig
from tokenflow.core.policies.base import (
    Moves,
    Policy,
    Preemption,
    SchedulingView,
    Start,
    fcfs_starts,
)
from tokenflow.core.request import PreemptMode, Request, RequestState


class AndesPolicy(Policy):
    """Greedy QoE knapsack under memory pressure; FCFS otherwise."""

    name = "andes"

    def __init__(self, config: AndesConfig) -> None:
        self.config = config
        self._next_decision_s = 0.0

    def plan_moves(self, view: SchedulingView) -> Moves:
        """Knapsack when memory is tight and preemption budget remains, else FCFS."""
        cfg = self.config
        pressured = view.kv.device_usage >= cfg.kv_usage_threshold
        budget_left = view.num_preemptions_total < cfg.max_preemptions_per_request * max(
            view.num_requests_seen, 1
        )
        due = view.now_s >= self._next_decision_s
        if not (pressured and budget_left and due and (view.waiting or view.preempted)):
            return Moves(starts=tuple(fcfs_starts(view)))
        self._next_decision_s = view.now_s + cfg.decision_interval_s
        return self.knapsack(view)

    def wanted_tps(self, view: SchedulingView, request: Request) -> float:
        """Tokens/s the stream's consumer takes: a reader's rate; an eager or batch request
        (infinite rate) takes what one stream alone is given, so it waits for any slower pace."""
        if request.is_reader:
            return request.rate_tps
        return 1.0 / view.estimator.decode_time_s(1)

    def stall_s(self, view: SchedulingView, request: Request, tokens_per_s: float) -> float:
        """Predicted seconds of reader delay over the horizon if served at `tokens_per_s`
        (0 = not served); before the first token, delay past the TTFT target counts."""
        horizon = self.config.horizon_s
        now = view.now_s
        if not request.output_token_ids:
            due = request.arrival_s + self.config.ttft_target_s
            if tokens_per_s > 0:
                return 0.0
            return min(horizon, max(0.0, now + horizon - due))
        slack = max(request.slack_s(now), 0.0)
        exposed = max(0.0, horizon - slack)
        if tokens_per_s <= 0:
            return exposed
        return exposed * max(0.0, 1.0 - tokens_per_s / self.wanted_tps(view, request))

    def gain(self, view: SchedulingView, request: Request, tokens_per_s: float) -> float:
        """QoE(served) - QoE(waits): avoided delay relative to the stream's whole duration."""
        whole_s = request.sampling_params.max_tokens / self.wanted_tps(view, request)
        avoided = self.stall_s(view, request, 0.0) - self.stall_s(view, request, tokens_per_s)
        return avoided / whole_s

    def batch_candidates(self, view: SchedulingView, members: list[Request]) -> list[int]:
        """Batch sizes from the largest meeting the strictest rate up to the largest that fits."""
        mean_blocks = sum(view.kv.blocks_for(r.num_tokens + 1) for r in members) / len(members)
        fit = int(view.kv.config.num_device_blocks / max(mean_blocks, 1.0))
        high = max(1, min(view.config.max_num_seqs, fit, len(members)))
        strictest = max(r.rate_tps for r in members)
        low = 1
        while low < high and view.estimator.decode_time_s(low + 1) <= 1.0 / strictest:
            low += 1
        n = self.config.num_batch_candidates
        return sorted({low + (high - low) * k // max(n - 1, 1) for k in range(n)})

    def knapsack(self, view: SchedulingView) -> Moves:
        """Pick the device set maximising total predicted QoE gain; preempt the rest."""
        members = [r for r in view.running if r.state is RequestState.RUNNING]
        members += list(view.preempted) + list(view.waiting)
        capacity = view.kv.config.num_device_blocks
        best: tuple[float, list[Request]] = (-1.0, [])
        for batch in self.batch_candidates(view, members):
            rate = 1.0 / view.estimator.decode_time_s(batch)
            scored = sorted(
                ((self.gain(view, r, rate), r) for r in members),
                key=lambda pair: (-pair[0] / pair[1].num_tokens, pair[1].sort_key),
            )
            chosen: list[Request] = []
            used = 0
            total = 0.0
            for gain, request in scored:
                need = view.kv.blocks_for(request.num_tokens + 1)
                if len(chosen) < batch and used + need <= capacity:
                    chosen.append(request)
                    used += need
                    total += gain
            if total > best[0]:
                best = (total, chosen)
        chosen_ids = {r.request_id for r in best[1]}
        preemptions = tuple(
            Preemption(r.request_id, PreemptMode.RECOMPUTE)
            for r in view.running
            if r.state is RequestState.RUNNING and r.request_id not in chosen_ids
        )
        starts = tuple(
            Start(r.request_id, by_load=False)
            for r in best[1]
            if r.state in (RequestState.WAITING, RequestState.PREEMPTED)
        )
        return Moves(preemptions=preemptions, starts=starts)
