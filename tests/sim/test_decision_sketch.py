"""The decision sketch (benchmarks/decision_sketch.py) makes the decision's moves, so its time
bounds the decision's work for the same changes."""

from benchmarks.decision_sketch import Sketch, compare
from benchmarks.scheduler_overhead import busy_view
from tokenflow.core.config import TokenFlowConfig
from tokenflow.core.policies.tokenflow import TokenFlowPolicy


def test_the_sketch_told_the_counts_makes_as_many_moves_of_each_kind() -> None:
    view = busy_view(400)
    policy = TokenFlowPolicy(TokenFlowConfig())
    moves = policy.decide(view)
    waiting = {r.request_id for r in view.waiting}
    num_joins = sum(s.request_id in waiting for s in moves.starts)
    assert moves.preemptions and num_joins and len(moves.starts) > num_joins
    sketch = Sketch(policy.config, num_joins, len(moves.starts), len(moves.preemptions))
    sketched = sketch.decide(view)
    assert len(sketched.preemptions) == len(moves.preemptions)
    assert len(sketched.starts) == len(moves.starts)
    # Nearly the same members move (on this state, all of them): the residents with the most
    # reading buffered pause, the members first in utility order start.
    for mine, theirs in (
        (sketched.preemptions, moves.preemptions),
        (sketched.starts, moves.starts),
    ):
        ids = {m.request_id for m in theirs}
        assert len(ids & {m.request_id for m in mine}) >= 0.9 * len(ids)


def test_the_comparison_runs(capsys) -> None:
    assert compare([100], repeats=3) == 0
    assert "sketch us" in capsys.readouterr().out
