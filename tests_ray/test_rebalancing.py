"""A replica's part in the moves of queued requests and paused streams
(tokenflow/replicas/rebalancer.py), without a cluster or a model: a core scheduler (fake
executor) stands for its engine, a `MoveBoard` for the fleet's.  It offers only the queued
requests and paused streams whose answers can move, counts a moved-in request's wait from its
landing, exports what the board says if it is still as the board saw it, and names each one's
target."""

from concurrent.futures import Future
from dataclasses import replace

from tests.core.helpers import ManualClock, flat_report, make_core, make_request
from tokenflow.core.load_report import LoadReport
from tokenflow.core.migration import StreamExport
from tokenflow.core.rebalance import MigrateMode, ReplicaLoad, StreamKind, movable_of
from tokenflow.core.request import Consumption, RequestState, SamplingParams
from tokenflow.engine.readings import measure_replica_load
from tokenflow.replicas.board import MoveBoard
from tokenflow.replicas.rebalancer import Rebalancer
from tokenflow.serving.moves import MoveBook

PERIOD_S = 1.0


class _Engine:
    """What a `Rebalancer` asks of its `AsyncEngine`, answered at once from a core scheduler
    whose requests all wait (nothing steps)."""

    def __init__(self, now_s: float) -> None:
        core, clock, _ = make_core()
        clock.t = now_s
        self.scheduler = core.scheduler
        self._clock = clock

    def replica_load(self, replica_id, movable_ids, reached_s):
        future = Future()
        now_s = self._clock.now()
        future.set_result(
            measure_replica_load(self.scheduler, now_s, replica_id, movable_ids, reached_s)
        )
        return future

    def export_streams(self, request_ids, only_if=None):
        requests = self.scheduler.requests
        future = Future()
        future.set_result(
            [
                self.scheduler.export_stream(i)
                for i in request_ids
                if i in requests and (only_if is None or only_if(requests[i]))
            ]
        )
        return future


def _idle_report() -> LoadReport:
    """A replica with nothing on it: `flat_report`'s capacity, no stream."""
    return replace(flat_report(), num_running=0, num_lifetime_blocks=0)


def _fleet(
    engine: _Engine, book: MoveBook, clock: ManualClock, mode: MigrateMode = MigrateMode.QUEUED
) -> tuple[Rebalancer, MoveBoard]:
    """A rebalancer for replica "a" and a board on which replica "b" has room."""
    board = MoveBoard(PERIOD_S, mode, clock=clock.now)
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

    def start_then_export(request_ids, only_if=None):  # (a step ran in between)
        engine.scheduler.requests["r0"].state = RequestState.RUNNING
        return _Engine.export_streams(engine, request_ids, only_if)

    engine.export_streams = start_then_export
    assert rebalancer.rebalance() == 0 and "r0" in engine.scheduler.requests
    assert len(board.planned()) == 1 and rebalancer.take_target("r0") is None


def test_a_replica_that_stops_is_no_target_any_more():
    engine, book, clock = _Engine(now_s=5.0), MoveBook(), ManualClock()
    board = MoveBoard(PERIOD_S, MigrateMode.QUEUED, clock=clock.now)
    target = Rebalancer(engine, book, board, "b", PERIOD_S, clock=clock.now)
    target.rebalance()  # (it posts: idle, it has room)
    stuck = movable_of(make_request("q", rate=1.0), 5.0, 0.0)
    source = ReplicaLoad("a", _idle_report(), (stuck,))
    assert [m.target_id for m in board.post(source)] == ["b"]
    target.stop()  # (it drains)
    assert board.post(source) == []


def test_the_target_tells_the_board_when_a_moved_answer_left_its_source_and_reached_it():
    engine, book, clock = _Engine(now_s=5.0), MoveBook(), ManualClock()
    clock.t = 20.0
    board = MoveBoard(PERIOD_S, MigrateMode.QUEUED, clock=clock.now)
    target = Rebalancer(engine, book, board, "b", PERIOD_S, clock=clock.now)
    target.rebalance()  # (it posts: idle, it has room)
    stuck = movable_of(make_request("q", rate=1.0), 5.0, 0.0)
    board.post(ReplicaLoad("a", _idle_report(), (stuck,)))
    clock.t = 20.25
    target.landed("q", 20.125)
    (planned,) = board.planned()
    assert (planned.planned_s, planned.handed_off_s, planned.landed_s) == (20.0, 20.125, 20.25)


def _paused(request_id: str, now_s: float) -> StreamExport:
    """A stream to import as paused: 40 tokens delivered at `now_s` to a reader at 100 tok/s,
    who has 0.4 s of them left to read."""
    return StreamExport(
        request_id=request_id,
        prompt_token_ids=tuple(range(3, 23)),
        output_token_ids=(7,) * 40,
        sampling_params=SamplingParams(max_tokens=140),
        eos_token_ids=(),
        consumption=Consumption.READER,
        arrival_s=0.0,
        rate_tps=100.0,
        token_times_s=(now_s,) * 40,
        last_consume_s=now_s + 39 / 100.0,
        num_preemptions=1,
    )


def _three_paused(mode: MigrateMode) -> tuple[_Engine, Rebalancer, MoveBoard]:
    """Replica "a" holds three paused streams whose readers ask 300 tok/s of its ~180."""
    engine, book, clock = _Engine(now_s=5.0), MoveBook(), ManualClock()
    for i in range(3):
        engine.scheduler.import_stream(_paused(f"p{i}", now_s=5.0))
        book.register(f"ticket-{i}", f"p{i}")
    rebalancer, board = _fleet(engine, book, clock, mode)
    return engine, rebalancer, board


def test_paused_streams_move_in_paused_mode_while_the_replica_reads_over_its_capacity():
    engine, rebalancer, board = _three_paused(MigrateMode.PAUSED)
    assert rebalancer.rebalance() == 2  # (its load is below 1 without two of them)
    assert sorted(engine.scheduler.requests) == ["p2"]
    assert [(p.move.request_id, p.move.kind) for p in board.planned()] == [
        ("p0", StreamKind.PAUSED),
        ("p1", StreamKind.PAUSED),
    ]
    assert rebalancer.take_target("p0") == "b"


def test_paused_streams_stay_in_queued_mode():
    engine, rebalancer, board = _three_paused(MigrateMode.QUEUED)
    assert rebalancer.rebalance() == 0 and len(engine.scheduler.requests) == 3
    assert board.planned() == []


def test_a_paused_stream_that_resumed_before_the_export_stays():
    engine, rebalancer, board = _three_paused(MigrateMode.PAUSED)

    def resume_then_export(request_ids, only_if=None):  # (a step ran in between)
        engine.scheduler.requests["p0"].state = RequestState.RUNNING
        return _Engine.export_streams(engine, request_ids, only_if)

    engine.export_streams = resume_then_export
    assert rebalancer.rebalance() == 1
    assert sorted(engine.scheduler.requests) == ["p0", "p2"]
    assert rebalancer.take_target("p0") is None and rebalancer.take_target("p1") == "b"
