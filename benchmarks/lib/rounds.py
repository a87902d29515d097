"""Rounds interleaved A B B A: the one order every side-by-side measurement runs in.

A shared machine's speed drifts within minutes, so a comparison of A and B measured one after
the other favours whichever ran in the faster moment. Reversing the order every other round
(A B, B A, A B, ...) gives every item an early and a late run for each pair of rounds, so a
steady drift hits them alike; the figures to read are then ratios within a round or medians
over rounds.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterator, Sequence
from typing import TypeVar

Item = TypeVar("Item")
Result = TypeVar("Result")


def count_arg(text: str) -> int:
    """An argparse type for a count of rounds, repeats or seeds: an integer of at least 1 (a
    run of none measures nothing), refused with the option's error otherwise."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def round_order(items: Sequence[Item], round_index: int) -> list[Item]:
    """`items` in round `round_index`'s order: as given in even rounds, reversed in odd ones."""
    if round_index < 0:
        raise ValueError(f"round_index must be >= 0, got {round_index}")
    return list(items) if round_index % 2 == 0 else list(reversed(items))


def interleaved(items: Sequence[Item], num_rounds: int) -> Iterator[tuple[int, Item]]:
    """(round index, item) for every run of `num_rounds` rounds, A B B A ..."""
    if num_rounds < 1:
        raise ValueError(f"num_rounds must be >= 1, got {num_rounds}")
    for round_index in range(num_rounds):
        for item in round_order(items, round_index):
            yield round_index, item


def run_rounds(
    items: Sequence[Item],
    num_rounds: int,
    measure: Callable[[int, Item], Result],
) -> list[dict[Item, Result]]:
    """Call `measure(round_index, item)` for every item in every round, A B B A; one dict per
    round, its keys in the order of `items` (not the order they ran in), so tables built from
    the rounds read the same way every round."""
    if len(set(items)) != len(items):
        raise ValueError(f"each item runs once a round; {list(items)} repeats one")
    results: list[dict[Item, Result]] = []
    for round_index, item in interleaved(items, num_rounds):
        if round_index == len(results):
            results.append({})
        results[round_index][item] = measure(round_index, item)
    return [{item: one_round[item] for item in items} for one_round in results]
