"""The rules that keep every reader no worse off under TokenFlow than under FCFS, each judged by
the moves it makes (or the figure it prices) on a small hand-built state."""

import math
from dataclasses import replace

import pytest

from tests.core.helpers import make_core, make_request
from tests.core.tokenflow_states import OPTIMISTIC, empty_view, full_view, member, three_streams
from tokenflow.core.config import TokenFlowConfig
from tokenflow.core.estimator import StepTimeEstimator
from tokenflow.core.policies import tokenflow as tokenflow_policy
from tokenflow.core.policies.admission import (
    admit,
    refilled_prefill_budget_s,
    spare_engine_share,
    waiting_within_budget,
)
from tokenflow.core.policies.balance import select
from tokenflow.core.policies.capacity import paced_batch
from tokenflow.core.policies.pricing import (
    Member,
    prefill_added_stall_s,
    prefill_hold_s,
    prefill_price_s,
)
from tokenflow.core.policies.tokenflow import Decision, TokenFlowPolicy
from tokenflow.core.request import Consumption, PreemptMode, RequestState


def _rate(request):
    return request.rate_tps


def _admit(view, members, waiting, margin_s=0.0):
    admission = admit(replace(view, waiting=waiting), members, 100, 1e9, _rate, 10.0, margin_s)
    return [r.request_id for r in admission.requests]


# -- pricing: how long newcomers pin their blocks ----------------------------------------------


def test_the_prefill_hold_counts_steps_of_the_recent_chunk_and_the_prompts_ahead():
    estimator = StepTimeEstimator(0.05, 1e-4)
    for _ in range(4):
        estimator.observe(4, 100, 0.2)  # recent prefill steps: 100 prompt tokens each
    view = replace(empty_view(400), estimator=estimator)
    hold_s = prefill_hold_s(view, 1000)
    # ten chunked steps of the prompt, each with the decodes: longer than one step's price
    prefill_s = estimator.prefill_batch_time_s(1000, 100)
    assert hold_s - prefill_s >= 10 * estimator.decode_time_s(1) - 1e-9
    assert hold_s > prefill_price_s(view, 1000)
    core, clock, _ = make_core("tokenflow", num_device_blocks=200, scheduler_config=OPTIMISTIC)
    core.add_request(make_request("ahead", num_prompt=300, max_tokens=4))
    core.scheduler.schedule(clock.t)  # (admitted, its prompt not computed yet)
    busy = replace(core.scheduler.view(clock.t), estimator=estimator)
    assert prefill_hold_s(busy, 1000) > prefill_hold_s(replace(busy, running=()), 1000)


def _decoding(name: str, rate: float, buffered_tokens: int = 1, **kw: object):
    """A resident stream decoding at time 0 whose reader holds `buffered_tokens` tokens."""
    request = make_request(name, rate=rate, **kw)
    for _ in range(buffered_tokens):
        request.append_token(7, 0.0)
    request.state = RequestState.RUNNING
    request.num_computed_tokens = request.num_tokens - 1
    return request


def _steady_view(*running):
    """Decode steps of 0.1 s whatever the batch, prefill 1 ms a token in one step, at time 0."""
    estimator = StepTimeEstimator(0.1, 1e-3, per_seq_s=0.0)
    return replace(empty_view(400), estimator=estimator, running=running, now_s=0.0)


def test_the_stall_a_prefill_adds_runs_to_the_end_of_its_step():
    # 900 prompt tokens: one step of 0.1 + 0.9 s.  A 4 tok/s reader with one token (0.25 s of
    # slack) gets its next token at the end of that step, 0.75 s after it ran dry, where
    # decodes alone would have given it one every 0.1 s.
    reader = _decoding("r", rate=4.0)
    assert prefill_hold_s(_steady_view(reader), 900) == pytest.approx(1.0)
    assert prefill_added_stall_s(_steady_view(reader), 900) == pytest.approx(0.75)
    # the worst resident counts; buffers that outlast the hold, eager streams and prompts
    # still prefilling add nothing
    slower = _decoding("slower", rate=2.0)  # 0.5 s of slack: 0.5 s later
    assert prefill_added_stall_s(_steady_view(slower, reader), 900) == pytest.approx(0.75)
    buffered = _decoding("buffered", rate=1.0, buffered_tokens=5)  # 5 s of reading
    eager = _decoding("eager", rate=math.inf, consumption=Consumption.EAGER)
    unstarted = make_request("unstarted", num_prompt=40)
    unstarted.state = RequestState.RUNNING
    assert prefill_added_stall_s(_steady_view(buffered, eager, unstarted), 900) == 0.0
    # ... though a prompt ahead lengthens the hold of the tokens behind it
    ahead = _steady_view(reader, unstarted)
    assert prefill_added_stall_s(ahead, 900) == pytest.approx(0.79)


def test_a_reader_the_decodes_feed_no_faster_than_it_reads_is_not_exposed_to_a_prefill():
    # Decodes of 0.1 s feed a 20 tok/s reader (and one of exactly 10 tok/s) no faster than it
    # reads: a prefill's step delays its tokens, but newcomers held for it would grow no buffer
    # of its, only wait until it finishes.  A 9 tok/s reader's buffer grows: it is exposed.
    for rate in (20.0, 10.0):
        assert prefill_added_stall_s(_steady_view(_decoding("fast", rate=rate)), 900) == 0.0
    assert prefill_added_stall_s(_steady_view(_decoding("r", rate=9.0)), 900) > 0.1
    reader = _decoding("r", rate=4.0)
    fast = _decoding("fast", rate=20.0)
    assert prefill_added_stall_s(_steady_view(fast, reader), 900) == pytest.approx(0.75)
    # so a newcomer is not held for it: without the rule the queue waits for it to finish
    newcomer = make_request("new", num_prompt=899, max_tokens=1)
    view = replace(_steady_view(fast), waiting=(newcomer,))
    resident = member("fast", 0.0, 1, pinned=True)
    admission = admit(view, [resident], 100, 1e9, _rate, 10.0, 0.0, 0.1)
    assert [r.request_id for r in admission.requests] == ["new"]
    assert waiting_within_budget(view, 1e9, 10.0, _rate, True, 0.1) == [newcomer]


def test_a_prompt_already_prefilling_stalls_the_readers_without_the_newcomer():
    # A 900-token prompt already admitted holds the 4 tok/s reader 0.75 s past its slack; a
    # 10-token newcomer behind it adds only its own 0.01 s to that step.
    reader = _decoding("r", rate=4.0)
    ahead = make_request("ahead", num_prompt=900)
    ahead.state = RequestState.RUNNING
    assert prefill_added_stall_s(_steady_view(reader, ahead), 10) == pytest.approx(0.01)
    assert prefill_added_stall_s(_steady_view(reader), 910) == pytest.approx(0.76)


def test_a_reader_stalls_only_until_its_last_token():
    # Three steps of a 300-token chunk (0.1 + 0.3 s each) for 900 prompt tokens.  A 4 tok/s
    # reader with 0.25 s of slack and many tokens to come is late by 0.15 s for the first
    # step's token and by 0.45 s for the third's; one with its last token to come waits for
    # the first step's only.
    estimator = StepTimeEstimator(0.1, 1e-3, per_seq_s=0.0)
    for _ in range(4):
        estimator.observe(1, 300, 0.4)  # recent prefill steps: 300 prompt tokens each
    many = _decoding("many", rate=4.0, max_tokens=20)
    last = _decoding("last", rate=4.0, max_tokens=2)

    def added_s(reader: object) -> float:
        view = replace(empty_view(400), estimator=estimator, running=(reader,), now_s=0.0)
        return prefill_added_stall_s(view, 900)

    assert added_s(many) == pytest.approx(0.45)
    assert added_s(last) == pytest.approx(0.15)


# -- admission ------------------------------------------------------------------------------------


def test_a_newcomer_waits_while_its_prefill_would_stall_a_resident_reader_too_long():
    reader = _decoding("r", rate=4.0)
    view = _steady_view(reader)
    resident = member("r", 0.0, 1, pinned=True)
    newcomer = make_request("new", num_prompt=899, max_tokens=1)  # prefill stalls r 0.75 s

    def admitted(limit_s: float) -> list[str]:
        admission = admit(
            replace(view, waiting=(newcomer,)), [resident], 100, 1e9, _rate, 10.0, 0.0, limit_s
        )
        return [r.request_id for r in admission.requests]

    def between_decisions(limit_s: float) -> list[str]:
        started = waiting_within_budget(
            replace(view, waiting=(newcomer,)), 1e9, 10.0, _rate, True, limit_s
        )
        return [r.request_id for r in started]

    assert admitted(0.25) == [] and between_decisions(0.25) == []
    assert admitted(0.8) == ["new"] and between_decisions(0.8) == ["new"]
    assert admitted(math.inf) == ["new"] and between_decisions(math.inf) == ["new"]
    short = make_request("short", num_prompt=149, max_tokens=1)  # within r's slack: no stall
    assert waiting_within_budget(replace(view, waiting=(short,)), 1e9, 10.0, _rate, True, 0.0)


def test_a_newcomer_does_not_wait_for_readers_once_the_queued_prefills_outlast_their_reading():
    # The 4 tok/s reader has 5 tokens to come (0.25 s of slack + 1.25 s of reading); a
    # 899-token newcomer's prefill (0.9 s) would stall it 0.75 s.  Alone in the queue it waits
    # for the reader's buffer; with a second such prompt behind it the queue's prefills (1.8 s)
    # outlast the reading, the engine's prefill is the bottleneck, and a wait would only delay
    # both prompts: it starts.
    reader = _decoding("r", rate=4.0, max_tokens=6)
    view = _steady_view(reader)
    resident = member("r", 0.0, 1, pinned=True)
    newcomer = make_request("new", num_prompt=899, max_tokens=1)
    behind = make_request("behind", num_prompt=899, max_tokens=1, arrival=1.0)

    def started(*waiting: object) -> tuple[list[str], list[str]]:
        queued = replace(view, waiting=waiting)
        admission = admit(queued, [resident], 100, 1e9, _rate, 10.0, 0.0, 0.1)
        between = waiting_within_budget(queued, 1e9, 10.0, _rate, True, 0.1)
        return [r.request_id for r in admission.requests], [r.request_id for r in between]

    assert started(newcomer) == ([], [])
    assert started(newcomer, behind)[0][:1] == ["new"]
    assert started(newcomer, behind)[1][:1] == ["new"]
    # A 20 tok/s reader with 50 s of reading left is fed no faster than it reads: the limit
    # does not wait for it, so its reading does not keep the queue from counting as the
    # bottleneck either.
    fast = _decoding("fast", rate=20.0, max_tokens=1001)
    view = _steady_view(reader, fast)
    assert started(newcomer, behind)[0][:1] == ["new"]
    assert started(newcomer, behind)[1][:1] == ["new"]


def test_the_queued_prefills_are_timed_as_the_engine_runs_them_in_chunks():
    # Recent prefill steps took 300 prompt tokens in 0.4 s beside one decode (0.1 s).  The 4 tok/s
    # reader has 1.5 s of reading left (0.25 s of slack, 5 tokens).  The queue's 1,200 tokens
    # priced as one batch take 1.2 s, shorter than that reading; the engine runs them as four
    # 300-token steps, each with the decode: 1.6 s, longer.  The prefill is the bottleneck, and
    # the newcomer starts instead of waiting for the reader's buffer (priced as one batch, it
    # waited, and the queue behind it waited as long).
    estimator = StepTimeEstimator(0.1, 1e-3, per_seq_s=0.0)
    for _ in range(4):
        estimator.observe(1, 300, 0.4)
    reader = _decoding("r", rate=4.0, max_tokens=6)
    view = replace(empty_view(400), estimator=estimator, running=(reader,), now_s=0.0)
    newcomer = make_request("new", num_prompt=1199, max_tokens=1)
    queued = replace(view, waiting=(newcomer,))
    assert prefill_price_s(queued, 1200) < 1.5 < prefill_hold_s(queued, 1200)
    assert prefill_added_stall_s(queued, 1200) > 0.1  # (so the limit alone would hold it)
    resident = member("r", 0.0, 1, pinned=True)
    admission = admit(queued, [resident], 100, 1e9, _rate, 10.0, 0.0, 0.1)
    assert [r.request_id for r in admission.requests] == ["new"]
    assert waiting_within_budget(queued, 1e9, 10.0, _rate, True, 0.1) == [newcomer]


def test_a_stream_is_paused_for_a_newcomer_only_if_its_buffer_outlasts_the_prefill():
    newcomer = make_request("new", num_prompt=40, max_tokens=1)  # 10 blocks
    view, members = full_view(20, 100, {"big": (12, 0)})
    hold_s = prefill_hold_s(view, newcomer.num_tokens)
    short = [replace(m, pause_margin_s=hold_s / 2) for m in members]
    assert _admit(view, short, [newcomer]) == []
    ample = [replace(m, pause_margin_s=hold_s * 2) for m in members]
    assert _admit(view, ample, [newcomer]) == ["new"]


def _paused(name: str, rate: float) -> Member:
    """A paused reader whose 45 tokens need 12 device blocks back; it runs dry in 1 / rate s."""
    request = make_request(name, num_prompt=44, rate=rate)
    request.append_token(7, 0.0)
    request.state = RequestState.PREEMPTED
    return Member(request, 0.0, 12, False, -math.inf, False, False, 0.1)


def test_admission_keeps_the_room_of_paused_readers_that_run_dry_within_the_prefill():
    view = empty_view(20)
    newcomer = make_request("new", num_prompt=36, max_tokens=1)  # 10 blocks
    soon = _paused("soon", rate=1.0)  # dry at 1 s, within the prefill + a 2 s margin
    assert _admit(view, [soon], [newcomer], margin_s=2.0) == []
    later = _paused("later", rate=0.1)  # dry at 10 s: comes back after the newcomer's prefill
    assert _admit(view, [later], [newcomer], margin_s=2.0) == ["new"]


def test_the_prefill_budget_refills_by_the_share_of_the_engine_the_readers_leave():
    share = spare_engine_share(demand_tps=80.0, gamma_tps=100.0)
    assert share == pytest.approx(0.2)
    assert refilled_prefill_budget_s(0.5, 0.0, queue_drained=False, spare_share=share) == (
        pytest.approx(0.1)
    )
    assert spare_engine_share(120.0, 100.0) == 0.0  # over capacity: no new prefill time
    assert refilled_prefill_budget_s(0.5, -0.3, queue_drained=True, spare_share=0.0) == 0.5


def test_between_decisions_the_head_fits_any_prefill_budget_left():
    view = empty_view(4000)
    long_prompt = make_request("long", num_prompt=4000, max_tokens=1)  # ~0.8 s of prefill
    assert prefill_price_s(view, long_prompt.num_tokens) > 0.1
    view = replace(view, waiting=(long_prompt,))

    def heads(budget_s: float, busy: bool = True) -> list[str]:
        started = waiting_within_budget(view, 1e9, budget_s, _rate, has_other_work=busy)
        return [r.request_id for r in started]

    assert heads(0.1) == ["long"]  # as memory frees, as under FCFS
    assert heads(0.0) == []  # the interval's prefill spent: wait for the next decision
    assert heads(0.0, busy=False) == ["long"]  # an idle engine always takes the head


# -- balancing ------------------------------------------------------------------------------------


def _select(members, blocks, max_seqs=256):
    return [m.request.request_id for m in select(members, blocks, max_seqs, False, math.inf)]


def test_a_paused_reader_about_to_run_dry_goes_before_a_newcomer():
    newcomer = member("new", 1.0, 4, resident=False, started=False)
    dry = member("dry", 0.6, 4, resident=False, is_urgent=True)
    assert _select([newcomer, dry], 4) == ["dry"]


def test_a_newcomer_never_takes_the_room_a_paused_reader_about_to_run_dry_waits_for():
    pinned = member("pinned", 0.0, 6, pinned=True)
    newcomer = member("new", 1.0, 4, resident=False, started=False)
    dry = member("dry", 0.6, 6, resident=False, is_urgent=True)  # no room beside `pinned`
    assert _select([pinned, dry, newcomer], 10) == ["pinned"]
    calm = member("calm", 2.0, 6, resident=False)  # ranks first, no room, not about to run dry
    assert _select([pinned, calm, newcomer], 10) == ["pinned", "new"]


def test_the_batch_limit_never_leaves_a_pinned_member_out():
    a, b = member("a", 0.0, 1, pinned=True), member("b", 0.0, 1, pinned=True, arrival=1.0)
    free = member("free", 5.0, 1)
    assert _select([a, b, free], 100, max_seqs=1) == ["a", "b"]


# -- capacity: the batch that keeps up with the fastest reader -----------------------------------


def test_the_paced_batch_keeps_up_with_the_fastest_started_reader_unless_short_of_demand():
    estimator = StepTimeEstimator(0.05, 1e-4, per_seq_s=0.01)  # a step: 0.04 + 0.01 x batch
    view = replace(empty_view(400), estimator=estimator)

    def reader(name: str, rate: float, started: bool = True, **kw: object):
        request = make_request(name, rate=rate, **kw)
        if started:
            request.append_token(7, 0.0)
        return request

    fast, slow = reader("fast", 10.0), reader("slow", 2.0)
    unstarted = reader("new", 100.0, started=False)
    eager = reader("eager", math.inf, consumption=Consumption.EAGER)
    assert paced_batch(view, [slow, fast, unstarted, eager], 0.0) == 6  # 0.04 + 0.06 <= 1 / 10
    assert paced_batch(view, [slow], 0.0) == 46  # 0.04 + 0.46 <= 1 / 2
    assert paced_batch(view, [unstarted, eager], 0.0) == view.config.max_num_seqs
    # readers asking 40 tok/s in all: 3 streams make it, at 0.07 s a step `fast` still keeps up
    assert paced_batch(view, [slow, fast], 40.0) == 6
    # 80 tok/s: 16 streams make 16 / (0.04 + 0.16) = 80, at 0.2 s a step, which feeds `fast` 5
    # tok/s of its 10 at best: the pace is `slow`'s
    assert paced_batch(view, [slow, fast], 80.0) == 46


def test_a_reader_no_pace_that_meets_the_demand_feeds_does_not_set_the_pace():
    estimator = StepTimeEstimator(0.05, 1e-4, per_seq_s=0.01)  # a step: 0.04 + 0.01 x batch
    view = replace(empty_view(400), estimator=estimator)
    readers = [make_request(f"r{i}", rate=rate) for i, rate in enumerate((2.0, 2.0, 16.0))]
    for request in readers:
        request.append_token(7, 0.0)
    # 40 tok/s: at the 3 streams that make it a step is 0.07 s, too slow for 16 tok/s
    assert paced_batch(view, readers, 40.0) == 46
    assert paced_batch(view, readers[2:], 0.0) == 2  # alone, it sets the pace: 0.06 <= 1 / 16


def test_the_decided_pace_counts_the_demand_of_the_newcomers_it_admits():
    # A step of about 0.04 + 0.01 x batch s.  Alone, the started 10 tok/s reader sets the pace
    # at about 6 streams; the eight 8 tok/s newcomers admitted beside it ask 74 tok/s in all,
    # which takes about 12: the pace of one reader would keep them out of the batch admission
    # made them room in.
    core, clock, _ = make_core("tokenflow", num_device_blocks=400, block_size=4)
    for batch in range(1, 33):
        for _ in range(4):
            core.scheduler.estimator.observe(batch, 0, 0.04 + 0.01 * batch)
    fast = make_request("fast", num_prompt=4, max_tokens=40, rate=10.0)
    core.add_request(fast)
    core.step()
    assert fast.output_token_ids
    for i in range(8):
        core.add_request(make_request(f"n{i}", num_prompt=4, max_tokens=40, rate=8.0))
    view = core.scheduler.view(clock.t)
    assert paced_batch(view, [fast], 10.0) < 9
    decision = core.scheduler.policy.decide(view)
    assert len(decision.starts) == 8
    assert decision.max_batch == paced_batch(view, [fast], 74.0) >= 9


def test_between_decisions_starts_stop_at_the_decided_batch():
    core, clock, _ = make_core("tokenflow", scheduler_config=OPTIMISTIC)
    core.add_request(make_request("R1", max_tokens=50))
    core.step()
    core.add_request(make_request("R2", max_tokens=50, arrival=clock.t))
    core.add_request(make_request("R3", num_prompt=240, max_tokens=4, arrival=clock.t))  # no room
    policy = core.scheduler.policy
    assert isinstance(policy, TokenFlowPolicy)
    view = core.scheduler.view(clock.t)
    later = Decision(next_decision_s=1e9, spare_rate_tps=1e9, prefill_budget_s=10.0)
    policy.last_decision = replace(later, max_batch=1)
    assert policy.plan_moves(view).starts == ()
    policy.last_decision = replace(later, max_batch=2)
    assert [s.request_id for s in policy.plan_moves(view).starts] == ["R2"]


# -- the decision and the out-of-memory victim ----------------------------------------------------


def test_room_for_everyone_starts_everyone_at_once_as_fcfs():
    def starts(rate: float) -> int:
        core, clock, _ = make_core("tokenflow", scheduler_config=OPTIMISTIC)
        for i in range(8):  # (one block each, and a small reserve: all fit)
            core.add_request(make_request(f"n{i}", num_prompt=4, max_tokens=200, rate=rate))
        policy = core.scheduler.policy
        assert isinstance(policy, TokenFlowPolicy)
        policy.last_decision = Decision(next_decision_s=1e9, prefill_budget_s=-1.0)  # pace spent
        return len(policy.plan_moves(core.scheduler.view(clock.t)).starts)

    assert starts(rate=0.1) == 8
    # readers asking more than Gamma (at 2 streams of 104 tokens' footprint): the pace decides
    assert starts(rate=1e3) == 1


def test_room_for_everyone_takes_the_place_of_a_due_decision_only():
    def next_decision_after(due_in_s: float) -> float:
        core, clock, _ = make_core("tokenflow", scheduler_config=OPTIMISTIC)
        core.add_request(make_request("a", num_prompt=4, max_tokens=200, rate=0.1))
        policy = core.scheduler.policy
        assert isinstance(policy, TokenFlowPolicy)
        policy.last_decision = Decision(next_decision_s=clock.t + due_in_s)
        assert policy.plan_moves(core.scheduler.view(clock.t)).starts  # room for a
        return policy.last_decision.next_decision_s - clock.t

    assert next_decision_after(0.3) == pytest.approx(0.3)  # not postponed by arrivals that fit
    assert next_decision_after(-0.1) == pytest.approx(TokenFlowConfig().schedule_interval_s)


def test_a_decision_pauses_no_resident_whose_buffer_is_shorter_than_the_newcomers_prefill(
    monkeypatch,
):
    core, clock, (r1, r2, r3) = three_streams()
    view = core.scheduler.view(clock.t)
    assert [p.request_id for p in TokenFlowPolicy(TokenFlowConfig()).decide(view).preemptions] == [
        "R1"
    ]  # R1's buffer covers R3's short prefill
    # (admission still counts on R1's pause; the decision then keeps R1 and leaves R3 waiting)
    monkeypatch.setattr(tokenflow_policy, "prefill_hold_s", lambda view, tokens: 1e6)
    decision = TokenFlowPolicy(TokenFlowConfig()).decide(view)
    assert decision.preemptions == () and decision.starts == ()


def test_out_of_memory_with_none_pausable_offloads_the_stream_with_most_reading_buffered():
    core, clock, (r1, r2, r3) = three_streams()
    view = core.scheduler.view(clock.t)
    cautious = TokenFlowPolicy(TokenFlowConfig(buffer_conservativeness=1000.0))  # none pausable
    victim = cautious.choose_oom_victim([r2, r1], view)
    assert (victim.request_id, victim.mode) == ("R1", PreemptMode.OFFLOAD)
