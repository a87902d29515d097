"""The fleet's board of moves (tokenflow/replicas/board.py), on hand-built loads and a manual
clock: each replica gets its own moves, planned by the core rule against the others' latest
reports and what the board sent them since; a silent or withdrawn replica is no target.

Gammas and rates are powers of two so every load is exact: 1024 tok/s of Gamma, readers at
8 tok/s, one stream's share of Gamma 16 tok/s (64 streams)."""

import pytest

from tests.core.helpers import FLAT_GAMMA_TPS, flat_report
from tokenflow.core.load_report import RouteRequest
from tokenflow.core.rebalance import MigrateMode, Movable, ReplicaLoad, StreamKind
from tokenflow.replicas.board import STALE_PERIODS, MoveBoard

GAMMA = FLAT_GAMMA_TPS
RATE = 8.0
PERIOD_S = 1.0


class _Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def _queued(index: int, queued_s: float = 0.0) -> Movable:
    route = RouteRequest(f"r{index}", RATE, lifetime_tokens=100, end_tokens=200)
    return Movable(route, StreamKind.QUEUED, 100, 100, 0.0, float(index), queued_s)


def _overloaded(name: str, indexes: range, excess_tps: float = 32.0) -> ReplicaLoad:
    """A replica whose readers ask Gamma + `excess_tps`, with these queued requests."""
    queued = tuple(_queued(i) for i in indexes)
    return ReplicaLoad(name, flat_report(GAMMA + excess_tps, len(queued)), queued)


def _idle(name: str, demand_tps: float = 0.0) -> ReplicaLoad:
    return ReplicaLoad(name, flat_report(demand_tps))


def _ids(moves) -> list[tuple[str, str, str]]:
    return [(m.request_id, m.source_id, m.target_id) for m in moves]


def test_a_replica_alone_moves_nothing_until_one_with_room_posts():
    board = MoveBoard(PERIOD_S, MigrateMode.QUEUED, clock=_Clock())
    assert board.post(_overloaded("a", range(4))) == []
    assert board.post(_idle("b")) == []  # (the idle one has nothing to give)
    moves = board.post(_overloaded("a", range(4)))
    # 32 tok/s over Gamma: four readers at 8 tok/s, oldest first, all to the one with room
    assert _ids(moves) == [(f"r{i}", "a", "b") for i in range(4)]


def test_a_request_not_started_in_a_period_moves_even_where_the_load_reads_within_capacity():
    board = MoveBoard(PERIOD_S, MigrateMode.QUEUED, clock=_Clock())
    board.post(_idle("b"))
    fresh, stuck = _queued(1, queued_s=0.5), _queued(2, queued_s=PERIOD_S)
    within = ReplicaLoad("a", flat_report(GAMMA / 2, num_waiting=2), (fresh, stuck))
    assert _ids(board.post(within)) == [("r2", "a", "b")]


def test_what_the_board_sent_a_target_counts_until_it_posts_again():
    board = MoveBoard(PERIOD_S, MigrateMode.QUEUED, clock=_Clock())
    board.post(_idle("c", demand_tps=GAMMA - 3 * RATE))  # room for three readers
    assert len(board.post(_overloaded("a", range(2)))) == 2
    # another source, in the same period: only the room left
    assert _ids(board.post(_overloaded("b", range(10, 12)))) == [("r10", "b", "c")]
    board.post(_idle("c", demand_tps=GAMMA - 3 * RATE))  # its report counts what it holds now
    assert len(board.post(_overloaded("b", range(10, 12)))) == 2


def test_a_target_with_a_queue_of_its_own_takes_nothing():
    board = MoveBoard(PERIOD_S, MigrateMode.QUEUED, clock=_Clock())
    board.post(ReplicaLoad("b", flat_report(num_waiting=1)))
    assert board.post(_overloaded("a", range(2))) == []


def test_a_silent_replica_is_no_target_and_one_that_withdrew_neither():
    clock = _Clock()
    board = MoveBoard(PERIOD_S, MigrateMode.QUEUED, clock=clock)
    board.post(_idle("b"))
    clock.t += STALE_PERIODS * PERIOD_S + 0.1  # (it died, or Serve stopped it)
    assert board.post(_overloaded("a", range(2))) == []
    board.post(_idle("b"))
    board.withdraw("b")  # (it drains)
    assert board.post(_overloaded("a", range(2))) == []
    board.post(_idle("b"))
    assert len(board.post(_overloaded("a", range(2)))) == 2


def test_the_board_tells_when_each_replica_joined_and_which_moves_it_planned():
    clock = _Clock()
    board = MoveBoard(PERIOD_S, MigrateMode.QUEUED, clock=clock)
    board.post(_overloaded("a", range(1)))
    clock.t += 0.5
    board.post(_idle("b"))
    clock.t += 0.25
    board.post(_idle("b"))
    moves = board.post(_overloaded("a", range(1)))
    assert board.first_posted_s() == {"a": 100.0, "b": 100.5}
    assert [(p.move, p.planned_s) for p in board.planned()] == [(moves[0], 100.75)]


def test_a_landing_completes_the_latest_planned_move_of_its_request_only():
    clock = _Clock()
    board = MoveBoard(PERIOD_S, MigrateMode.QUEUED, clock=clock)
    board.post(_idle("b"))
    board.post(_overloaded("a", range(1)))  # r0 to b, planned at 100.0
    board.landed("r7", 100.1, 100.2)  # (a move the board did not plan: a drain's)
    board.landed("r0", 100.3, 100.4)
    clock.t += 2.0
    board.post(_idle("a"))
    board.post(_overloaded("b", range(1)))  # r0 back to a, planned at 102.0
    board.landed("r0", 102.3, 102.5)
    first, second = board.planned()
    assert (first.planned_s, first.handed_off_s, first.landed_s) == (100.0, 100.3, 100.4)
    assert (second.planned_s, second.handed_off_s, second.landed_s) == (102.0, 102.3, 102.5)
    assert second.move.target_id == "a"


def test_the_period_must_be_positive():
    with pytest.raises(ValueError):
        MoveBoard(0.0, MigrateMode.QUEUED)
