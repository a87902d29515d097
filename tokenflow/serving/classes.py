"""Which consumption class a request belongs to, and at what reading rate.

Most clients state no rate: the OpenAI SDKs, agent frameworks and benchmark tools do not know
`stream_rate`.  A request's class (`tokenflow.core.request.Consumption`) comes from, in order:

1. `stream: false`: batch (judged by end-to-end latency; a pause would only delay it);
2. a binding rule of the request's API key (`--api-key-class KEY=CLASS[:RATE]`): a tenant's
   key decides its class and rate, and what the request states of them is ignored;
3. the body's `stream_class`, else the `X-Stream-Class` header: `reader`, `eager` or `batch`
   (batch needs `stream: false`);
4. a stated rate (`stream_rate`, else `X-Stream-Rate`): a reader at that rate;
5. a key's rule written `KEY=~CLASS[:RATE]`: a default its requests may change;
6. the server's default (`--default-class`: eager, since a client that states nothing may read
   at once and a pause would serve it worse than FCFS; readers at `--default-rate`).

A reader's rate is its binding rule's, else the stated one, else its key rule's, else the
default rate.  Eager and batch
requests reach the engine with an infinite rate: they read each token the moment it exists.

Whether a reader's stream is *paced* (its tokens released at its rate: serving/pacing.py) comes
from the body's `stream_pacing`, else the `X-Stream-Pacing` header, else the server's
`--stream-pacing`.  A key's binding rule does not bind it: pacing changes when the client gets
each token, never what the scheduler is told.  Eager and batch requests are never paced.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from tokenflow.core.request import Consumption, is_reader_rate, reader_rate_error
from tokenflow.serving.validation import ApiError

CLASS_NAMES = tuple(c.value for c in Consumption)


@dataclass(frozen=True)
class Stated:
    """What a request's headers say of its class (None: not said)."""

    rate_tps: float | None = None  # X-Stream-Rate
    stream_class: str | None = None  # X-Stream-Class
    api_key: str | None = None  # the bearer token
    pacing: bool | None = None  # X-Stream-Pacing


@dataclass(frozen=True)
class ClassRule:
    """A class, and a reader's rate (None: the server's default rate)."""

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
class ClassRules:
    """The server's rules: a default class, one rule per API key, and whether readers that do
    not say are paced."""

    default: ClassRule = ClassRule(Consumption.EAGER)
    by_api_key: Mapping[str, ClassRule] = field(default_factory=dict)
    paces_readers: bool = False  # `--stream-pacing`

    @classmethod
    def parse(
        cls, default_class: str, api_key_classes: tuple[str, ...], paces_readers: bool = False
    ) -> ClassRules:
        """From `--default-class`, `--api-key-class KEY=CLASS[:RATE]` values (ValueError) and
        `--stream-pacing`."""
        rules: dict[str, ClassRule] = {}
        for text in api_key_classes:
            key, sep, spec = text.partition("=")
            if not (key and sep and spec):
                raise ValueError(f"api_key_class must be KEY=CLASS[:RATE], got {text!r}")
            binds = not spec.startswith("~")
            name, _, rate = spec.removeprefix("~").partition(":")
            rules[key] = ClassRule(parse_class(name), float(rate) if rate else None, binds)
        return cls(ClassRule(parse_class(default_class)), rules, paces_readers)

    def resolve(
        self,
        stream: bool,
        body_class: str | None,
        body_rate_tps: float | None,
        headers: Stated,
        default_rate_tps: float,
    ) -> tuple[Consumption, float]:
        """(The class, the engine's rate: the reader's tokens/s, inf otherwise); the body's
        class and rate win over the headers', a binding key rule over both.  ApiError 400 for
        an unknown class or one that contradicts `stream`."""
        stated_class = body_class if body_class is not None else headers.stream_class
        stated_rate_tps = body_rate_tps if body_rate_tps is not None else headers.rate_tps
        api_key = headers.api_key
        bound = self.by_api_key.get(api_key or "")
        if stream and bound is not None and bound.binds:
            if bound.consumption is not Consumption.READER:
                return bound.consumption, math.inf
            return Consumption.READER, bound.rate_tps or self.default.rate_tps or default_rate_tps
        consumption = self._class_of(stream, stated_class, stated_rate_tps, api_key)
        if consumption is not Consumption.READER:
            return consumption, math.inf
        rule = self.by_api_key.get(api_key or "", self.default)
        rate = next(
            (r for r in (stated_rate_tps, rule.rate_tps, self.default.rate_tps) if r is not None),
            default_rate_tps,
        )
        return consumption, rate

    def is_paced(self, consumption: Consumption, body_pacing: bool | None, headers: Stated) -> bool:
        """Whether the stream's tokens are released at its reader's rate: a reader's only, as
        its body's `stream_pacing` says, else its `X-Stream-Pacing`, else the server."""
        if consumption is not Consumption.READER:
            return False
        stated = body_pacing if body_pacing is not None else headers.pacing
        return self.paces_readers if stated is None else stated

    def _class_of(
        self,
        stream: bool,
        stated_class: str | None,
        stated_rate_tps: float | None,
        api_key: str | None,
    ) -> Consumption:
        stated = _stated(stated_class)
        if not stream:
            if stated not in (None, Consumption.BATCH):
                raise ApiError(400, f"stream_class {stated.value} needs stream: true")
            return Consumption.BATCH
        if stated is Consumption.BATCH:
            raise ApiError(400, "stream_class batch is for stream: false", param="stream_class")
        if stated is not None:
            return stated
        if stated_rate_tps is not None:
            return Consumption.READER
        return self.by_api_key.get(api_key or "", self.default).consumption


def parse_class(name: str) -> Consumption:
    """`reader` / `eager` / `batch` -> Consumption; ValueError naming the valid ones."""
    if name not in CLASS_NAMES:
        raise ValueError(f"unknown stream class {name!r}; choose one of {', '.join(CLASS_NAMES)}")
    return Consumption(name)


def _stated(name: str | None) -> Consumption | None:
    if name is None:
        return None
    try:
        return parse_class(name)
    except ValueError as err:
        raise ApiError(400, str(err), param="stream_class") from None
