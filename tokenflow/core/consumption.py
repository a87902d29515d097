"""A request's consumption class and reading rate, from what it states: the one rule that the
server, the fleet's router, the engine's callers and the workloads share.

Most clients state no rate: the OpenAI SDKs, agent frameworks and benchmark tools do not know
`stream_rate`.  A request's class (`Consumption`) comes from, in order:

1. `stream: false`: batch (judged by end-to-end latency; a pause would only delay it);
2. a binding rule of the request's API key (`--api-key-class KEY=CLASS[:RATE]`): a tenant's
   key decides its class and rate, and what the request states of them is ignored;
3. the stated class (the body's `stream_class`, else the `X-Stream-Class` header): `reader`,
   `eager` or `batch` (batch needs `stream: false`);
4. a stated rate (`stream_rate`, else `X-Stream-Rate`): a reader at that rate;
5. a key's rule written `KEY=~CLASS[:RATE]`: a default its requests may change;
6. the server's default (`--default-class`).

A reader's rate is its binding rule's, else the stated one, else its key rule's, else the
default class's, else the default rate (`--default-rate`).  Eager and batch requests have an
infinite rate: they read each token the moment it exists.  Which rates a reader may have at all
is `core/request.py`'s `is_reader_rate`, the one bound every source checks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple, TypeVar

from tokenflow.core.request import Consumption, is_reader_rate, reader_rate_error

CLASS_NAMES = tuple(c.value for c in Consumption)  # "reader", "eager", "batch"
# A reader that states no rate, where nothing else gives one: a person reading (~4 tok/s is
# ~180 words a minute).
DEFAULT_READER_RATE_TPS = 4.0
_T = TypeVar("_T")


class ClassError(ValueError):
    """A request's stated class or rate the rule refuses; `param` names the request field at
    fault (None: the request as a whole), as the server's 400 answer names it."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class ClassRule:
    """A class, and a reader's rate (None: the default's)."""

    consumption: Consumption
    rate_tps: float | None = None
    binds: bool = False  # what a request states of its class and rate is ignored

    def __post_init__(self) -> None:
        rate = self.rate_tps
        if rate is not None and not is_reader_rate(rate):
            raise ValueError(f"a class rule's rate: {reader_rate_error(rate)}")
        if rate is not None and self.consumption is not Consumption.READER:
            raise ValueError(f"only readers have a rate, not {self.consumption.value}")


@dataclass(frozen=True)
class StatedClass:
    """What a request states of its class and rate (None: not stated)."""

    stream: bool
    body_class: str | None = None  # `stream_class`
    body_rate_tps: float | None = None  # `stream_rate`
    header_class: str | None = None  # X-Stream-Class
    header_rate_tps: float | None = None  # X-Stream-Rate


class Resolved(NamedTuple):
    """A request's class and the engine's rate: the reader's tokens/s, inf otherwise."""

    consumption: Consumption
    rate_tps: float


def resolve_class(
    stated: StatedClass,
    key_rule: ClassRule | None,
    default: ClassRule,
    default_rate_tps: float,
) -> Resolved:
    """The class and rate of a request that states `stated`, whose API key has `key_rule`
    (None: no rule), on a server whose default class is `default` and whose readers that find
    no rate read at `default_rate_tps` (the module docstring has the order).  ClassError for
    an unknown class, one that contradicts `stream`, or a reader's rate out of bounds."""
    stated_rate_tps = _first(stated.body_rate_tps, stated.header_rate_tps)
    if stated.stream and key_rule is not None and key_rule.binds:
        if key_rule.consumption is not Consumption.READER:
            return Resolved(key_rule.consumption, math.inf)
        rate = _first(key_rule.rate_tps, default.rate_tps, default_rate_tps)
        return Resolved(Consumption.READER, rate)
    consumption = _class_of(stated, stated_rate_tps, key_rule or default)
    if consumption is not Consumption.READER:
        return Resolved(consumption, math.inf)
    rule = key_rule or default
    rate = _first(stated_rate_tps, rule.rate_tps, default.rate_tps, default_rate_tps)
    if not is_reader_rate(rate):
        raise ClassError(reader_rate_error(rate), param="stream_rate")
    return Resolved(Consumption.READER, rate)


def resolve_given(
    consumption: Consumption | None, rate_tps: float | None, default_rate_tps: float
) -> Resolved:
    """The class and rate of a request handed to an engine with an optional class and rate
    (`LLMEngine.add_request`): the class given, else eager for an infinite rate (as
    `resolve_class` gives eager and batch requests), else a reader; a reader's rate the one
    given, else `default_rate_tps`.  ClassError for a reader's rate out of bounds."""
    if consumption is None and rate_tps == math.inf:
        consumption = Consumption.EAGER
    stated = StatedClass(
        stream=consumption is not Consumption.BATCH,
        body_class=None if consumption is None else consumption.value,
        body_rate_tps=rate_tps,
    )
    return resolve_class(stated, None, ClassRule(Consumption.READER), default_rate_tps)


def parse_class(name: str) -> Consumption:
    """`reader` / `eager` / `batch` -> Consumption; ValueError naming the valid ones."""
    if name not in CLASS_NAMES:
        raise ValueError(f"unknown stream class {name!r}; choose one of {', '.join(CLASS_NAMES)}")
    return Consumption(name)


def reader_rate_of(value: object) -> float | None:
    """The reader's rate a loosely typed value states (a number, or text of one: a header, a
    JSON field, an engine's extra argument), if it is one a reader may have; None otherwise."""
    try:
        rate = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError, OverflowError):  # (OverflowError: an int past 1e308)
        return None
    return rate if is_reader_rate(rate) else None


def _class_of(stated: StatedClass, stated_rate_tps: float | None, rule: ClassRule) -> Consumption:
    """Steps 1 and 3 to 6 of the order (`rule`: the key's, else the server's default)."""
    named = _stated(_first(stated.body_class, stated.header_class))
    if not stated.stream:
        if named not in (None, Consumption.BATCH):
            raise ClassError(f"stream_class {named.value} needs stream: true")
        return Consumption.BATCH
    if named is Consumption.BATCH:
        raise ClassError("stream_class batch is for stream: false", param="stream_class")
    if named is not None:
        return named
    if stated_rate_tps is not None:
        return Consumption.READER
    return rule.consumption


def _stated(name: str | None) -> Consumption | None:
    if name is None:
        return None
    try:
        return parse_class(name)
    except ValueError as err:
        raise ClassError(str(err), param="stream_class") from None


def _first(*values: _T | None) -> _T | None:
    """The first value that is not None (None if all are)."""
    return next((v for v in values if v is not None), None)
