"""The class and rate rule (core/consumption.py), on hand-built statements."""

from __future__ import annotations

import math

import pytest

from tokenflow.core.consumption import (
    CLASS_NAMES,
    ClassError,
    ClassRule,
    StatedClass,
    parse_class,
    reader_rate_of,
    resolve_class,
    resolve_given,
)
from tokenflow.core.request import MAX_READER_RATE_TPS, MIN_READER_RATE_TPS, Consumption

READER, EAGER, BATCH = Consumption.READER, Consumption.EAGER, Consumption.BATCH
EAGER_DEFAULT = ClassRule(EAGER)
READER_DEFAULT = ClassRule(READER)


def resolve(stated: StatedClass, key_rule: ClassRule | None = None, default=EAGER_DEFAULT):
    return tuple(resolve_class(stated, key_rule, default, 7.0))


def test_class_names_are_the_enums_values():
    assert CLASS_NAMES == ("reader", "eager", "batch")
    assert [parse_class(name) for name in CLASS_NAMES] == [READER, EAGER, BATCH]
    with pytest.raises(ValueError, match="choose one of reader, eager, batch"):
        parse_class("robot")


def test_a_request_that_states_nothing_gets_the_servers_default_class():
    assert resolve(StatedClass(stream=True)) == (EAGER, math.inf)
    assert resolve(StatedClass(stream=True), default=READER_DEFAULT) == (READER, 7.0)
    assert resolve(StatedClass(stream=True), default=ClassRule(READER, 3.0)) == (READER, 3.0)


def test_a_request_not_streamed_is_batch_whatever_it_states_of_a_rate_or_its_key():
    assert resolve(StatedClass(stream=False, body_rate_tps=5.0)) == (BATCH, math.inf)
    assert resolve(StatedClass(stream=False, body_class="batch")) == (BATCH, math.inf)
    binding = ClassRule(READER, 6.0, binds=True)
    assert resolve(StatedClass(stream=False), binding) == (BATCH, math.inf)


def test_a_stated_rate_makes_a_reader_and_the_body_wins_over_the_headers():
    assert resolve(StatedClass(stream=True, header_rate_tps=2.0)) == (READER, 2.0)
    both = StatedClass(stream=True, body_rate_tps=8.0, header_rate_tps=2.0)
    assert resolve(both) == (READER, 8.0)
    classes = StatedClass(stream=True, body_class="reader", header_class="eager")
    assert resolve(classes) == (READER, 7.0)
    assert resolve(StatedClass(stream=True, header_class="eager", body_rate_tps=3.0)) == (
        EAGER,
        math.inf,
    )


def test_a_binding_key_rule_ignores_what_the_request_states():
    reader = ClassRule(READER, 6.0, binds=True)
    stated = StatedClass(stream=True, body_class="eager", body_rate_tps=500.0)
    assert resolve(stated, reader) == (READER, 6.0)
    assert resolve(StatedClass(stream=True, body_class="robot"), reader) == (READER, 6.0)
    assert resolve(stated, ClassRule(READER, binds=True)) == (READER, 7.0)
    assert resolve(stated, ClassRule(READER, binds=True), ClassRule(READER, 3.0)) == (READER, 3.0)
    eager = ClassRule(EAGER, binds=True)
    assert resolve(StatedClass(stream=True, body_rate_tps=2.0), eager) == (EAGER, math.inf)


def test_a_non_binding_key_rule_is_a_default_the_request_may_change():
    soft = ClassRule(READER, 5.0)
    assert resolve(StatedClass(stream=True), soft) == (READER, 5.0)
    assert resolve(StatedClass(stream=True, body_rate_tps=2.0), soft) == (READER, 2.0)
    assert resolve(StatedClass(stream=True, body_class="eager"), soft) == (EAGER, math.inf)
    soft_eager = ClassRule(EAGER)
    assert resolve(StatedClass(stream=True), soft_eager, READER_DEFAULT) == (EAGER, math.inf)
    stated_rate = StatedClass(stream=True, header_rate_tps=3.0)
    assert resolve(stated_rate, soft_eager, READER_DEFAULT) == (READER, 3.0)


def test_a_readers_rate_comes_from_the_first_source_that_gives_one():
    key, default = ClassRule(READER, 5.0), ClassRule(READER, 3.0)
    stated = StatedClass(stream=True, body_class="reader")
    assert resolve(StatedClass(stream=True, body_rate_tps=2.0), key, default) == (READER, 2.0)
    assert resolve(stated, key, default) == (READER, 5.0)
    assert resolve(stated, ClassRule(READER), default) == (READER, 3.0)
    assert resolve(stated, ClassRule(READER), READER_DEFAULT) == (READER, 7.0)


@pytest.mark.parametrize(
    ("stated", "message", "param"),
    [
        (
            StatedClass(stream=True, body_class="robot"),
            "unknown stream class 'robot'",
            "stream_class",
        ),
        (StatedClass(stream=True, header_class="robot"), "unknown stream class", "stream_class"),
        (
            StatedClass(stream=True, body_class="batch"),
            "batch is for stream: false",
            "stream_class",
        ),
        (StatedClass(stream=False, body_class="eager"), "eager needs stream: true", None),
        (StatedClass(stream=True, body_rate_tps=5000.0), "a reader's rate must be", "stream_rate"),
        (StatedClass(stream=True, header_rate_tps=0.0), "a reader's rate must be", "stream_rate"),
    ],
)
def test_what_the_rule_refuses_names_the_field_at_fault(stated, message, param):
    with pytest.raises(ClassError, match=message) as refused:
        resolve(stated)
    assert refused.value.param == param
    assert isinstance(refused.value, ValueError)


def test_a_class_rule_holds_a_rate_only_for_readers_and_only_a_readers_rate():
    with pytest.raises(ValueError, match="only readers have a rate"):
        ClassRule(EAGER, 3.0)
    for rate in (0.0, MAX_READER_RATE_TPS * 2, math.inf, math.nan):
        with pytest.raises(ValueError, match="a class rule's rate"):
            ClassRule(READER, rate)
    assert ClassRule(READER, MIN_READER_RATE_TPS).rate_tps == MIN_READER_RATE_TPS


def test_an_engine_request_is_the_class_given_else_eager_at_an_infinite_rate_else_a_reader():
    assert tuple(resolve_given(None, None, 6.0)) == (READER, 6.0)
    assert tuple(resolve_given(None, 9.0, 6.0)) == (READER, 9.0)
    assert tuple(resolve_given(None, math.inf, 6.0)) == (EAGER, math.inf)
    assert tuple(resolve_given(EAGER, 9.0, 6.0)) == (EAGER, math.inf)
    assert tuple(resolve_given(BATCH, None, 6.0)) == (BATCH, math.inf)
    assert tuple(resolve_given(READER, None, 6.0)) == (READER, 6.0)
    for rate in (math.inf, 0.0, MAX_READER_RATE_TPS * 2):
        with pytest.raises(ValueError, match="a reader's rate must be"):
            resolve_given(READER, rate, 6.0)


def test_a_loosely_typed_rate_counts_only_where_a_reader_may_have_it():
    assert reader_rate_of(8) == 8.0 and reader_rate_of("2.5") == 2.5
    assert reader_rate_of(MAX_READER_RATE_TPS) == MAX_READER_RATE_TPS
    for value in (None, "x", [1], {}, 0, -3, 5000, "1e-9", "inf", "NaN", 10**400):
        assert reader_rate_of(value) is None, value
