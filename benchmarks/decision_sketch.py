"""How fast could a TokenFlow decision be in CPython?  A lean sketch of it, timed beside it.

The sketch is not a policy.  On the frozen state of `scheduler_overhead` it is told what the
decision decided (how many waiting requests join, how many members start, how many residents
pause) and does, once for each member concerned, the arithmetic that a decision reaching those
figures must do at the least:

- Gamma and the members' demand from the view's sums;
- each paused member priced (its resume time from a cache kept across decisions, its utility);
- the residents sorted by buffer and cut at the least pause threshold by bisection;
- the admission arithmetic of each request that joins (rate, prefill pace, blocks, reserve);
- the members to start sorted by utility and walked under the resume budget;
- the moves built as the seam's objects, the pauses in running order, each start's mode.

It skips all that finds those figures exactly: the exact pause test near the threshold, ties
of equal utility, the memory check, the degraded order, every bound and fallback.  So its time
bounds from below a plain-CPython decision of this design (every paused member priced, every
joining request admitted, the others ordered, every move built) that makes the same moves; a
design that kept the paused members' prices and order on events could skip those two parts.

    python -m benchmarks.decision_sketch [--sizes 400,1000] [--repeats 300]
"""

from __future__ import annotations

import argparse
import math
from bisect import bisect_left
from functools import partial
from operator import attrgetter

from benchmarks.scheduler_overhead import busy_view, interleaved_medians_us
from tokenflow.core.config import TokenFlowConfig
from tokenflow.core.policies.base import Moves, Preemption, SchedulingView, Start
from tokenflow.core.policies.tokenflow import TokenFlowPolicy
from tokenflow.core.request import PreemptMode

_LAST_CONSUME = attrgetter("last_consume_s")


class Sketch:
    """The sketch of one decision: told the decision's counts, it does their arithmetic."""

    def __init__(self, config: TokenFlowConfig, num_joins: int, num_starts: int, num_pauses: int):
        self.config = config
        self.num_joins, self.num_starts, self.num_pauses = num_joins, num_starts, num_pauses
        self._fixed: dict[str, tuple] = {}  # paused member -> (its key, resume s, footprint)

    def decide(self, view: SchedulingView) -> Moves:
        growth, capacity, rate_cap, demand = self._capacity(view)
        others, queue_s = self._price_paused(view, growth)
        pausable = self._pausable(view, queue_s)
        self._admit(view, rate_cap, capacity - demand, others)
        picked = self._pick(others)
        return self._moves(view, pausable, picked)

    def _capacity(self, view: SchedulingView) -> tuple[int, float, float, float]:
        est, kv, dt = view.estimator, view.kv, self.config.schedule_interval_s
        growth = int(dt / est.decode_time_s(len(view.running) or 1))
        beta = max(view.started_lifetime_blocks / (len(view.running) + len(view.preempted)), 1.0)
        batch = max(1, min(view.config.max_num_seqs, int(kv.config.num_device_blocks / beta)))
        capacity = est.capacity_tps(batch, beta * kv.block_size)
        rate_cap = capacity / batch
        demand = sum(min(rate, rate_cap) * n for rate, n in view.started_rates.items())
        return growth, capacity, rate_cap, demand

    def _price_paused(self, view: SchedulingView, growth: int) -> tuple[list[tuple], float]:
        """(A sortable row per paused member, their resume times summed)."""
        cfg, kv, est, now = self.config, view.kv, view.estimator, view.now_s
        bs, synced_of = kv.block_size, kv.synced_tokens_of
        per_block_s = kv.config.block_bytes / view.config.link_bytes_per_s
        dt, inv_horizon = cfg.schedule_interval_s, 1.0 / cfg.value_horizon_s
        inv_dt, stall_dt, switch = 1.0 / dt, cfg.stall_penalty * dt, cfg.switch_penalty * dt
        exp = math.exp
        step_s, token_s, fixed = est.prefill_step_s, est.prefill_token_s, self._fixed
        rows, queue_s = [], 0.0
        for r in view.preempted:
            rid = r.request_id
            key = (r.num_tokens, r.num_computed_tokens, synced_of(rid, 0))
            entry = fixed.get(rid)
            if entry is None or entry[0] != key:
                num_tokens, computed, synced = key
                resume = step_s + num_tokens * token_s
                if computed > 0 and synced >= computed:
                    load = -(-computed // bs) * per_block_s
                    resume = load if load < resume else resume
                entry = fixed[rid] = (key, resume, -(-(num_tokens + growth) // bs))
            queue_s += entry[1]
            buffered = r.last_consume_s - now
            if buffered < 0.0:
                buffered = 0.0
            value = 1.0 - buffered * inv_horizon
            utility = (value if value > 0.0 else 0.0) * dt + stall_dt * exp(-buffered * inv_dt)
            utility -= switch
            rows.append((-utility, -r.rate_tps, r.arrival_s, r.arrival_index, entry[1], r))
        return rows, queue_s

    def _pausable(self, view: SchedulingView, queue_s: float) -> list:
        """The residents with buffer over the least pause threshold, largest buffer first."""
        cfg, now = self.config, view.now_s
        least = cfg.buffer_conservativeness * (queue_s + cfg.schedule_interval_s)
        least += cfg.critical_slack_s
        order = sorted(view.running, key=_LAST_CONSUME, reverse=True)
        return order[: bisect_left(order, True, key=lambda r: r.last_consume_s - now < least)]

    def _admit(self, view: SchedulingView, rate_cap: float, spare: float, rows: list) -> None:
        """The admission arithmetic of the `num_joins` requests that join; a row for each."""
        est, kv, bs, ratio = view.estimator, view.kv, view.kv.block_size, view.new_token_ratio
        step_s, token_s = est.prefill_step_s, est.prefill_token_s
        max_step = max(view.config.max_prefill_tokens, 1)
        free = kv.num_free_device_blocks - view.running_reserve_blocks()
        cfg, budget_s = self.config, self.config.schedule_interval_s
        utility = budget_s + cfg.stall_penalty * budget_s - cfg.switch_penalty * budget_s
        rate_sum, tokens, num_over = 0.0, 0, 0
        for r in view.waiting[: self.num_joins]:
            rate = r.rate_tps if r.rate_tps <= rate_cap else rate_cap
            tokens += r.num_tokens
            paced = -(-tokens // max_step) * step_s + tokens * token_s
            need = -(-r.num_tokens // bs)
            reserve = -(-int(r.sampling_params.max_tokens * ratio) // bs)
            if rate_sum + rate > spare or paced > budget_s or need > free:
                num_over += 1  # (the decision stops there; the sketch is told how many join)
            free -= need + reserve
            rate_sum += rate
            rows.append((-utility, 0.0, r.arrival_s, r.arrival_index, 0.0, r))

    def _pick(self, rows: list) -> list:
        """The rows in utility order, walked under the resume budget, up to `num_starts`."""
        rows.sort()
        budget_s, spent, picked = self.config.schedule_interval_s, 0.0, []
        for row in rows:
            resume = row[4]
            if resume > 0.0 and spent > 0.0 and spent + resume > budget_s * 100:
                continue  # (the budget is widened: the sketch is told how many start)
            spent += resume
            picked.append(row[-1])
            if len(picked) == self.num_starts:
                break
        return picked

    def _moves(self, view: SchedulingView, pausable: list, picked: list) -> Moves:
        kv, now, bs = view.kv, view.now_s, view.kv.block_size
        synced_of, per_block_s = (
            kv.synced_tokens_of,
            kv.config.block_bytes / view.config.link_bytes_per_s,
        )
        left_out = set(pausable[: self.num_pauses])
        offload = PreemptMode.OFFLOAD
        pauses = [Preemption(r.request_id, offload) for r in view.running if r in left_out]
        queued = kv.num_evicting_blocks + kv.num_queued_load_blocks
        prefill_s, starts = view.estimator.prefill_time_s, []
        for r in picked:
            computed = r.num_computed_tokens
            if not (computed > 0 and synced_of(r.request_id, 0) >= computed):
                starts.append(Start(r.request_id, False))
                continue
            io_s = (queued + -(-computed // bs)) * per_block_s
            by_load = io_s <= prefill_s(r.num_tokens) or io_s < r.dry_s - now
            starts.append(Start(r.request_id, by_load))
        return Moves(tuple(pauses), tuple(starts))


def compare(sizes: list[int], repeats: int) -> int:
    """TokenFlow's decision and the sketch told its counts, timed in turn (medians, us)."""
    print(f"{'active':>6s} {'moves':>6s} {'decision us':>12s} {'sketch us':>10s} {'ratio':>6s}")
    for size in sizes:
        view = busy_view(size)
        policy = TokenFlowPolicy(TokenFlowConfig())
        policy.decide(view)  # (the first decision carries a budget into the timed ones)
        moves = policy.decide(view)
        waiting = {r.request_id for r in view.waiting}
        num_joins = sum(s.request_id in waiting for s in moves.starts)
        sketch = Sketch(policy.config, num_joins, len(moves.starts), len(moves.preemptions))
        sketched = sketch.decide(view)
        counts = (len(sketched.preemptions), len(sketched.starts))
        if counts != (len(moves.preemptions), len(moves.starts)):
            raise SystemExit(f"the sketch made {counts} moves, the decision {moves}")
        runs = [partial(policy.decide, view), partial(sketch.decide, view)]
        decided, sketched_us = interleaved_medians_us(runs, repeats)
        num_moves = sum(counts)
        print(
            f"{size:6d} {num_moves:6d} {decided:12.1f} {sketched_us:10.1f} "
            f"{sketched_us / decided:6.2f}",
            flush=True,
        )
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="400,1000", help="active requests, comma-separated")
    parser.add_argument("--repeats", type=int, default=300)
    args = parser.parse_args(argv)
    return compare([int(s) for s in args.sizes.split(",")], args.repeats)


if __name__ == "__main__":
    raise SystemExit(main())
