"""A replica's part in the moves of queued requests (tokenflow/replicas/rebalancing.py), without
a cluster or a model: a core scheduler (fake executor) stands for its engine, a `MoveBoard` for
the fleet's.  It offers only the queued requests whose answers can move, counts a moved-in
request's wait from its landing, exports what the board says, and names each one's target."""

from concurrent.futures import Future
from types import SimpleNamespace

from tests.core.helpers import ManualClock, make_core, make_request
from tokenflow.core.rebalance import ReplicaLoad, StreamKind, movable_of
from tokenflow.core.request import RequestState
from tokenflow.core.routing import CapacityPoint, LoadReport
from tokenflow.replicas.board import MoveBoard
from tokenflow.replicas.rebalancing import Rebalancer
from tokenflow.serving.moves import MoveBook

PERIOD_S = 1.0


class _Engine:
    """What a `Rebalancer` asks of its `AsyncEngine`, answered at once from a core scheduler
    whose requests all wait (nothing steps)."""

    def __init__(self, now_s: float) -> None:
        core, clock, _ = make_core()
        clock.t = now_s
        self.scheduler = core.scheduler
        self._engine = SimpleNamespace(core=SimpleNamespace(clock=clock), scheduler=core.scheduler)

    def between_steps(self, fn):
        future = Future()
        future.set_result(fn(self._engine))
        return future

    def export_streams(self, request_ids, waiting_only=False):
        requests = self.scheduler.requests
        future = Future()
        future.set_result(
            [
                self.scheduler.export_stream(i)
                for i in request_ids
                if i in requests and (not waiting_only or requests[i].state is RequestState.WAITING)
            ]
        )
        return future


def _idle_report() -> LoadReport:
    return LoadReport(
        now_s=0.0,
        gamma_tps=1024.0,
        working_demand_tps=0.0,
        waiting_demand_tps=0.0,
        num_running=0,
        num_preempted=0,
        num_waiting=0,
        num_free_device_blocks=10_000,
        num_free_host_blocks=0,
        num_lifetime_blocks=0,
        block_size=16,
        capacity_points=(CapacityPoint(1e9, 1024.0, 64),),
        num_device_blocks=10_000,
        num_host_blocks=0,
    )


def _fleet(engine: _Engine, book: MoveBook, clock: ManualClock) -> tuple[Rebalancer, MoveBoard]:
    """A rebalancer for replica "a" and a board on which replica "b" has room."""
    board = MoveBoard(PERIOD_S, clock=clock.now)
    board.post(ReplicaLoad("b", _idle_report()))
    return Rebalancer(engine, book, board, "a", PERIOD_S, clock=clock.now), board


def test_queued_requests_whose_answers_can_move_go_where_the_board_says():
    engine, book, clock = _Engine(now_s=5.0), MoveBook(), ManualClock()
    for i in range(3):  # (slow readers: the replica's load is far below 1, but none started)
        engine.scheduler.add_request(make_request(f"r{i}", arrival=float(i), rate=1.0))
    book.register("ticket-0", "r0")
    book.register("ticket-1", "r1")  # r2's answer cannot move (e.g. n > 1): it stays
    rebalancer, board = _fleet(engine, book, clock)

    assert rebalancer.rebalance() == 2
    assert sorted(engine.scheduler.requests) == ["r2"]
    assert [(p.move.request_id, p.move.target_id) for p in board.planned()] == [
        ("r0", "b"),
        ("r1", "b"),
    ]
    assert rebalancer.take_target("r0") == "b" and rebalancer.take_target("r0") is None
    assert rebalancer.take_target("r2") is None  # (not moved: a drain's handoff goes anywhere)


def test_a_request_that_moved_here_waits_a_period_from_its_landing_before_it_moves_on():
    engine, book, clock = _Engine(now_s=5.0), MoveBook(), ManualClock()
    clock.t = 50.0
    rebalancer, _ = _fleet(engine, book, clock)
    rebalancer.landed("r0", 49.75)  # its answer's continuation reached this replica now
    engine.scheduler.add_request(make_request("r0", arrival=0.0, rate=1.0))  # (its first arrival)
    book.register("ticket-0", "r0")
    clock.t = 50.5
    assert rebalancer.rebalance() == 0  # waited 0.5 s here, 5 s in the fleet
    clock.t = 51.0
    assert rebalancer.rebalance() == 1


def test_a_request_that_started_before_the_export_stays():
    engine, book, clock = _Engine(now_s=5.0), MoveBook(), ManualClock()
    engine.scheduler.add_request(make_request("r0", arrival=0.0, rate=1.0))
    book.register("ticket-0", "r0")
    rebalancer, board = _fleet(engine, book, clock)

    def start_then_export(request_ids, waiting_only=False):  # (a step ran in between)
        engine.scheduler.requests["r0"].state = RequestState.RUNNING
        return _Engine.export_streams(engine, request_ids, waiting_only)

    engine.export_streams = start_then_export
    assert rebalancer.rebalance() == 0 and "r0" in engine.scheduler.requests
    assert len(board.planned()) == 1 and rebalancer.take_target("r0") is None


def test_a_replica_that_stops_is_no_target_any_more():
    engine, book, clock = _Engine(now_s=5.0), MoveBook(), ManualClock()
    board = MoveBoard(PERIOD_S, clock=clock.now)
    target = Rebalancer(engine, book, board, "b", PERIOD_S, clock=clock.now)
    target.rebalance()  # (it posts: idle, it has room)
    stuck = movable_of(make_request("q", rate=1.0), StreamKind.QUEUED, 5.0, 0.0)
    source = ReplicaLoad("a", _idle_report(), (stuck,))
    assert [m.target_id for m in board.post(source)] == ["b"]
    target.stop()  # (it drains)
    assert board.post(source) == []


def test_the_target_tells_the_board_when_a_moved_answer_left_its_source_and_reached_it():
    engine, book, clock = _Engine(now_s=5.0), MoveBook(), ManualClock()
    clock.t = 20.0
    board = MoveBoard(PERIOD_S, clock=clock.now)
    target = Rebalancer(engine, book, board, "b", PERIOD_S, clock=clock.now)
    target.rebalance()  # (it posts: idle, it has room)
    stuck = movable_of(make_request("q", rate=1.0), StreamKind.QUEUED, 5.0, 0.0)
    board.post(ReplicaLoad("a", _idle_report(), (stuck,)))
    clock.t = 20.25
    target.landed("q", 20.125)
    (planned,) = board.planned()
    assert (planned.planned_s, planned.handed_off_s, planned.landed_s) == (20.0, 20.125, 20.25)
