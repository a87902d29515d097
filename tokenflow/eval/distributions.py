"""Distributions a workload draws from: token lengths, reader rates, consumption classes.

Each is a small frozen dataclass, validated on construction, with `parse` for its command-line
text and `sample(rng)` for one draw from a `random.Random` the workload seeds
(tokenflow/eval/workload.py).  `WorkloadError` is every workload error, here and there.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from tokenflow.core.consumption import CLASS_NAMES
from tokenflow.core.request import is_reader_rate, reader_rate_error


class WorkloadError(ValueError):
    """An invalid workload spec, length or rate text, or trace file; the message is one line."""


# -- small checks -------------------------------------------------------------------------------
def is_number(value: object) -> bool:
    """An int or float (not a bool)."""
    return isinstance(value, int | float) and not isinstance(value, bool)


def is_int(value: object) -> bool:
    """An int (not a bool)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_positive(value: object) -> bool:
    """A finite number > 0."""
    return is_number(value) and math.isfinite(value) and value > 0  # type: ignore[arg-type]


def is_rate(value: object) -> bool:
    """A number that is a reader's rate (`is_reader_rate`: the bound the server and the engine
    check, so a workload the simulator or a server would refuse never loads)."""
    return is_number(value) and is_reader_rate(value)  # type: ignore[arg-type]


def parse_float(text: str, where: str) -> float:
    """`text` as a float; WorkloadError naming `where` if it is none."""
    try:
        return float(text)
    except ValueError:
        raise WorkloadError(f"invalid {where}: {text.strip()!r} is not a number") from None


@dataclass(frozen=True)
class LengthDist:
    """Token lengths ~ round(Normal(mean, std)), clipped to [minimum, maximum]."""

    mean: float
    std: float
    minimum: int = 1
    maximum: int | None = None

    def __post_init__(self) -> None:
        if not is_positive(self.mean):
            raise WorkloadError(f"length mean must be a finite number > 0, got {self.mean!r}")
        if not (is_number(self.std) and math.isfinite(self.std) and self.std >= 0):
            raise WorkloadError(f"length std must be a finite number >= 0, got {self.std!r}")
        if not is_int(self.minimum) or self.minimum < 1:
            raise WorkloadError(f"length minimum must be an integer >= 1, got {self.minimum!r}")
        if self.maximum is not None and (not is_int(self.maximum) or self.maximum < self.minimum):
            raise WorkloadError(
                f"length maximum must be an integer >= minimum={self.minimum}, got {self.maximum!r}"
            )

    def sample(self, rng: random.Random) -> int:
        """One length: a normal draw, rounded to the nearest integer, clipped to the bounds."""
        value = max(round(rng.gauss(self.mean, self.std)), self.minimum)
        return value if self.maximum is None else min(value, self.maximum)

    @classmethod
    def parse(cls, text: str, *, minimum: int = 1, maximum: int | None = None) -> LengthDist:
        """Parse "MEAN" (a fixed length) or "MEAN:STD", e.g. "512:128"."""
        parts = text.strip().split(":")
        if len(parts) > 2 or not all(p.strip() for p in parts):
            raise WorkloadError(f"invalid length {text!r}: expected MEAN or MEAN:STD, e.g. 512:128")
        mean = parse_float(parts[0], f"length {text!r}")
        std = parse_float(parts[1], f"length {text!r}") if len(parts) == 2 else 0.0
        return cls(mean, std, minimum, maximum)


@dataclass(frozen=True)
class RateMix:
    """Reader rates (tokens/s) and their probabilities; weights are normalised to sum to 1."""

    rates_tps: tuple[float, ...]
    weights: tuple[float, ...]

    def __post_init__(self) -> None:
        rates, weights = tuple(self.rates_tps), tuple(self.weights)
        if not rates or len(rates) != len(weights):
            raise WorkloadError("a rate mix needs one weight per rate and at least one rate")
        for rate in rates:
            if not is_rate(rate):
                raise WorkloadError(f"rate: {reader_rate_error(rate)}")
        for weight in weights:
            if not (is_number(weight) and math.isfinite(weight) and weight >= 0):
                raise WorkloadError(f"rate weight must be a finite number >= 0, got {weight!r}")
        total = math.fsum(weights)
        if total <= 0:
            raise WorkloadError("rate weights must not all be 0")
        object.__setattr__(self, "rates_tps", tuple(float(r) for r in rates))
        object.__setattr__(self, "weights", tuple(w / total for w in weights))

    def sample(self, rng: random.Random) -> float:
        """One rate, chosen with the mix's probabilities (one `rng.random()` per call)."""
        draw, cumulative = rng.random(), 0.0
        for rate, weight in zip(self.rates_tps, self.weights, strict=True):
            cumulative += weight
            if draw < cumulative:
                return rate
        return self.rates_tps[-1]  # draw within rounding of 1.0

    @classmethod
    def parse(cls, text: str) -> RateMix:
        """Parse "20", "15,20" (equal weights) or "15:0.4,20:0.6" (RATE:WEIGHT pairs)."""
        items = [item.strip() for item in text.split(",")]
        pairs = [item.split(":") for item in items]
        if not all(item for item in items) or any(len(p) > 2 for p in pairs):
            raise WorkloadError(
                f"invalid rate mix {text!r}: expected RATE[,RATE...] or RATE:WEIGHT[,...], "
                "e.g. 15:0.4,20:0.6"
            )
        has_weight = {len(p) == 2 for p in pairs}
        if len(has_weight) > 1:
            raise WorkloadError(f"invalid rate mix {text!r}: give a weight to every rate or none")
        where = f"rate mix {text!r}"
        rates = tuple(parse_float(p[0], where) for p in pairs)
        weights = tuple(parse_float(p[1], where) if len(p) == 2 else 1.0 for p in pairs)
        return cls(rates, weights)


@dataclass(frozen=True)
class ClassMix:
    """Consumption classes and their shares: readers, eager streams, batch requests."""

    classes: tuple[str, ...] = ("reader",)
    weights: tuple[float, ...] = (1.0,)

    def __post_init__(self) -> None:
        if not self.classes or len(self.classes) != len(self.weights):
            raise WorkloadError("a class mix needs one weight per class and at least one class")
        for name in self.classes:
            if name not in CLASS_NAMES:
                raise WorkloadError(f"unknown class {name!r}; choose from {', '.join(CLASS_NAMES)}")
        if any(not (math.isfinite(w) and w >= 0) for w in self.weights) or sum(self.weights) <= 0:
            raise WorkloadError("class weights must be finite, >= 0, and not all 0")

    @property
    def is_readers_only(self) -> bool:
        return all(c == "reader" or w == 0 for c, w in zip(self.classes, self.weights, strict=True))

    def sample(self, rng: random.Random) -> str:
        """One class, drawn by weight."""
        return rng.choices(self.classes, weights=self.weights)[0]

    @classmethod
    def parse(cls, text: str) -> ClassMix:
        """Parse "reader:0.6,eager:0.3,batch:0.1" (CLASS:WEIGHT pairs; "eager" alone: all)."""
        pairs = [item.strip().split(":") for item in text.split(",")]
        if any(len(p) > 2 or not p[0] for p in pairs):
            raise WorkloadError(f"invalid class mix {text!r}: expected CLASS[:WEIGHT],...")
        where = f"class mix {text!r}"
        weights = tuple(parse_float(p[1], where) if len(p) == 2 else 1.0 for p in pairs)
        return cls(tuple(p[0] for p in pairs), weights)
