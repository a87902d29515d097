"""The decode-path rule, its cache and its measurement's call pattern (no timing asserted)."""

from __future__ import annotations

from pathlib import Path

from tokenflow.model.decode_path import (
    ALL_ROWS,
    NUM_ROUNDS,
    STEPS_PER_ROUND,
    DecodePathCache,
    DecodePathChoice,
    DecodePathSettings,
    DecodePathTiming,
    choose_decode_path,
    compiled_max_rows,
    measure_decode_paths,
)


def _timings(*pairs: tuple[int, float, float]) -> tuple[DecodePathTiming, ...]:
    return tuple(DecodePathTiming(rows, eager, compiled) for rows, eager, compiled in pairs)


def test_compiled_up_to_the_last_size_where_it_won_at_every_size():
    assert compiled_max_rows(_timings((1, 10, 8), (8, 20, 18), (32, 40, 41))) == 8
    assert compiled_max_rows(_timings((1, 10, 8), (8, 20, 18), (32, 40, 30))) == 32
    # A loss at one stream keeps every size eager, even where compiled won later.
    assert compiled_max_rows(_timings((1, 10, 11), (8, 20, 10))) == 0
    # A near tie (within WIN_FACTOR) counts as a loss: eager needs no compiler at start.
    assert compiled_max_rows(_timings((1, 10, 9.9))) == 0
    assert compiled_max_rows(_timings((8, 20, 10), (1, 10, 8))) == 8  # any order


def test_choice_says_which_steps_compile():
    choice = DecodePathChoice(8, "probe", _timings((1, 10, 8)))
    assert choice.uses_compiled(1) and choice.uses_compiled(8) and not choice.uses_compiled(9)
    assert "compiled up to 8 streams" in choice.describe()
    assert "1 streams 10000.00 ms eager / 8000.00 ms compiled" in choice.describe()
    assert DecodePathChoice(ALL_ROWS, "flags").describe() == "decode steps (flags): compiled"
    assert not DecodePathChoice(0, "flags").uses_compiled(1)


def test_measurement_alternates_the_paths_at_every_size():
    calls: list[tuple[int, bool]] = []
    timings = measure_decode_paths(lambda rows, compiled: calls.append((rows, compiled)), (1, 8))
    assert [t.rows for t in timings] == [1, 8]
    per_size = 2 * (1 + NUM_ROUNDS * STEPS_PER_ROUND)
    assert len(calls) == 2 * per_size
    first = calls[:per_size]
    assert {rows for rows, _ in first} == {1}
    # warm-ups, then round 0 eager first and round 1 compiled first
    order = [compiled for _, compiled in first[2::STEPS_PER_ROUND]]
    assert order == [False, True, True, False]


def test_choice_is_cached_and_a_later_start_does_not_measure(tmp_path: Path):
    settings = DecodePathSettings({"machine": "m", "model": "x"}, cache=DecodePathCache(tmp_path))
    prepared: list[bool] = []

    def prepare():
        prepared.append(True)
        return lambda rows, compiled: None

    first = choose_decode_path(settings, prepare)
    assert first.source == "probe" and len(first.timings) == 3 and prepared == [True]
    second = choose_decode_path(settings, prepare)
    assert second.source == "cache" and prepared == [True]
    assert second.timings == first.timings
    assert second.compiled_max_rows == first.compiled_max_rows
    other = DecodePathSettings({"machine": "m", "model": "y"}, cache=DecodePathCache(tmp_path))
    assert choose_decode_path(other, prepare).source == "probe" and len(prepared) == 2


def test_a_failed_compile_is_eager_and_not_stored(tmp_path: Path):
    settings = DecodePathSettings({"k": 1}, cache=DecodePathCache(tmp_path))
    assert choose_decode_path(settings, lambda: None) == DecodePathChoice(0, "flags")
    assert DecodePathCache(tmp_path).load({"k": 1}) is None


def test_without_the_cache_every_start_measures(tmp_path: Path):
    settings = DecodePathSettings({"k": 2}, use_cache=False, cache=DecodePathCache(tmp_path))
    choose_decode_path(settings, lambda: lambda rows, compiled: None)
    assert DecodePathCache(tmp_path).load({"k": 2}) is None
