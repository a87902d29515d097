"""The order in which cached blocks no request holds are reused (retention.py), on hand-built
states: which block `pick` gives up first."""

import pytest

from tokenflow.core.retention import (
    NOT_EXPECTED,
    LruRetention,
    ReadingRetention,
    expected_return_s,
)

PATIENCE_S = 10.0


def released(retention, block: int, *returns_s: float, now_s: float = 0.0) -> None:
    """Owners of `block` let go, each expecting it back at one of `returns_s`."""
    for return_s in returns_s:
        retention.expect(block, return_s)
    retention.release(block, now_s)


def test_lru_gives_up_the_least_recently_released_block_first():
    lru = LruRetention()
    for block in (3, 1, 2):
        released(lru, block, 100.0)
    lru.take(1)
    assert [lru.pick(0.0), lru.pick(0.0)] == [3, 2]


def test_reading_gives_up_an_abandoned_block_before_any_expected_one():
    reading = ReadingRetention(PATIENCE_S)
    released(reading, 1, 500.0)  # expected back, late
    released(reading, 2, NOT_EXPECTED)  # an eager request without a session
    assert reading.pick(0.0) == 2


def test_reading_gives_up_the_block_expected_back_latest_first():
    reading = ReadingRetention(PATIENCE_S)
    released(reading, 1, 20.0)
    released(reading, 2, 90.0)
    released(reading, 3, 40.0)
    assert [reading.pick(0.0) for _ in range(3)] == [2, 3, 1]


def test_a_block_many_readers_expect_is_kept_by_the_soonest():
    """A system prompt's block: each conversation on it expects it back; the soonest counts."""
    reading = ReadingRetention(PATIENCE_S)
    released(reading, 1, 80.0, 15.0, 60.0)  # the shared system prompt
    released(reading, 2, 30.0)  # one conversation's tail
    assert reading.pick(0.0) == 2


def test_a_reader_overdue_by_more_than_the_patience_no_longer_keeps_its_block():
    reading = ReadingRetention(PATIENCE_S)
    released(reading, 1, 20.0)  # overdue after t = 30
    released(reading, 2, 50.0)
    assert reading.pick(5.0) == 2  # both live: the later one goes
    released(reading, 2, 50.0, now_s=5.0)
    assert reading.pick(31.0) == 1  # 1 is abandoned now: it goes before 2


def test_an_overdue_expectation_gives_way_to_the_next():
    reading = ReadingRetention(PATIENCE_S)
    released(reading, 1, 20.0, 200.0)
    released(reading, 2, 100.0)
    assert reading.pick(0.0) == 2  # 1's next use is 20
    released(reading, 2, 100.0)
    assert reading.pick(31.0) == 1  # 1's next use moved to 200 once 20 fell overdue


def test_sharing_a_block_again_fulfils_its_soonest_expectation():
    reading = ReadingRetention(PATIENCE_S)
    released(reading, 1, 10.0, 300.0)
    reading.take(1)  # the reader expected at 10 came back
    released(reading, 1)
    released(reading, 2, 100.0)
    assert reading.pick(0.0) == 1  # expected at 300 now


def test_picking_from_an_empty_set_is_an_error():
    with pytest.raises(LookupError):
        ReadingRetention(PATIENCE_S).pick(0.0)


def test_expected_return_is_after_reading_and_thinking_unless_no_next_turn():
    assert expected_return_s(12.0, expects_next_turn=True, think_s=10.0) == 22.0
    assert expected_return_s(12.0, expects_next_turn=False, think_s=10.0) == NOT_EXPECTED
