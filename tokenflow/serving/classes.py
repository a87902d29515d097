"""Which consumption class a request belongs to, and at what reading rate: the server's side of
the rule in `tokenflow/core/consumption.py` (the order it follows is written there).

This module reads the server's rules from its flags (`--default-class`, `--api-key-class
KEY=CLASS[:RATE]`, a `~` before the class making a key's rule a default its requests may
change, and `--stream-pacing`), hands the core rule what a request states, and answers a class
the rule refuses with a 400.

Whether a reader's stream is *paced* (its tokens released at its rate: serving/pacing.py) comes
from the body's `stream_pacing`, else the `X-Stream-Pacing` header, else the server's
`--stream-pacing`.  A key's binding rule does not bind it: pacing changes when the client gets
each token, never what the scheduler is told.  Eager and batch requests are never paced.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from tokenflow.core.consumption import (
    CLASS_NAMES,
    ClassError,
    ClassRule,
    Resolved,
    StatedClass,
    parse_class,
    resolve_class,
)
from tokenflow.core.request import Consumption
from tokenflow.serving.validation import ApiError

__all__ = ["CLASS_NAMES", "ClassRules", "Stated"]  # (CLASS_NAMES: the --default-class choices)


@dataclass(frozen=True)
class Stated:
    """What a request's headers say of its class (None: not said)."""

    rate_tps: float | None = None  # X-Stream-Rate
    stream_class: str | None = None  # X-Stream-Class
    api_key: str | None = None  # the bearer token
    pacing: bool | None = None  # X-Stream-Pacing


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
    ) -> Resolved:
        """The class and the engine's rate (the reader's tokens/s, inf otherwise); the body's
        class and rate win over the headers', a binding key rule over both.  ApiError 400 for
        an unknown class or one that contradicts `stream`."""
        stated = StatedClass(
            stream, body_class, body_rate_tps, headers.stream_class, headers.rate_tps
        )
        key_rule = self.by_api_key.get(headers.api_key or "")
        try:
            return resolve_class(stated, key_rule, self.default, default_rate_tps)
        except ClassError as err:
            raise ApiError(400, str(err), param=err.param) from None

    def is_paced(self, consumption: Consumption, body_pacing: bool | None, headers: Stated) -> bool:
        """Whether the stream's tokens are released at its reader's rate: a reader's only, as
        its body's `stream_pacing` says, else its `X-Stream-Pacing`, else the server."""
        if consumption is not Consumption.READER:
            return False
        stated = body_pacing if body_pacing is not None else headers.pacing
        return self.paces_readers if stated is None else stated
