"""The A B B A rounds helper: the order of the runs, results keyed in the given order, and the
count option every runner takes."""

from __future__ import annotations

import argparse

import pytest

from benchmarks.lib.rounds import count_arg, interleaved, round_order, run_rounds


def test_round_order_reverses_every_other_round() -> None:
    assert round_order(["a", "b", "c"], 0) == ["a", "b", "c"]
    assert round_order(["a", "b", "c"], 1) == ["c", "b", "a"]
    assert round_order(["a", "b", "c"], 2) == ["a", "b", "c"]


def test_interleaved_runs_a_b_b_a() -> None:
    runs = [item for _, item in interleaved(["A", "B"], 4)]
    assert runs == ["A", "B", "B", "A", "A", "B", "B", "A"]


def test_interleaved_numbers_the_rounds() -> None:
    assert [index for index, _ in interleaved(["A", "B", "C"], 2)] == [0, 0, 0, 1, 1, 1]


def test_every_item_runs_as_often_early_as_late_over_two_rounds() -> None:
    items = ["A", "B", "C", "D"]
    runs = list(interleaved(items, 2))
    positions = {item: [] for item in items}
    for position, (_, item) in enumerate(runs[:4]):
        positions[item].append(position)
    for position, (_, item) in enumerate(runs[4:]):
        positions[item].append(position)
    assert all(sum(p) == len(items) - 1 for p in positions.values())


def test_run_rounds_calls_in_interleaved_order_and_keys_in_given_order() -> None:
    calls: list[tuple[int, str]] = []

    def measure(round_index: int, item: str) -> str:
        calls.append((round_index, item))
        return f"{item}{round_index}"

    rounds = run_rounds(["fcfs", "tokenflow"], 3, measure)
    assert calls == [(0, "fcfs"), (0, "tokenflow"), (1, "tokenflow"), (1, "fcfs"),
                     (2, "fcfs"), (2, "tokenflow")]  # fmt: skip
    assert rounds == [
        {"fcfs": "fcfs0", "tokenflow": "tokenflow0"},
        {"fcfs": "fcfs1", "tokenflow": "tokenflow1"},
        {"fcfs": "fcfs2", "tokenflow": "tokenflow2"},
    ]
    assert [list(r) for r in rounds] == [["fcfs", "tokenflow"]] * 3


@pytest.mark.parametrize("num_rounds", [0, -1])
def test_no_rounds_is_an_error(num_rounds: int) -> None:
    with pytest.raises(ValueError, match="num_rounds must be >= 1"):
        list(interleaved(["A"], num_rounds))


def test_a_repeated_item_is_an_error() -> None:
    with pytest.raises(ValueError, match="repeats one"):
        run_rounds(["A", "A"], 1, lambda index, item: item)


def test_a_count_is_an_integer_of_at_least_one() -> None:
    assert count_arg("3") == 3
    for bad in ("0", "-2", "2.5", "two"):
        with pytest.raises(argparse.ArgumentTypeError):
            count_arg(bad)
