"""Workloads shared by the simulator and the HTTP benchmark client.

A workload is a list of `WorkloadRequest`s sorted by arrival.  It comes from a `WorkloadSpec`:

- ``burst``: every request arrives at t = 0 (the paper's setups (a) and (b));
- ``poisson``: exponential inter-arrival times at ``request_rate`` req/s (setups (c) and (d));
- ``gamma``: gamma inter-arrival times with shape = ``burstiness`` and scale =
  1 / (request_rate * burstiness), as ``vllm bench serve --burstiness`` (1.0 is Poisson, smaller
  is burstier; the mean stays 1 / request_rate);
- ``trace``: a JSONL file of recorded requests (see `load_trace`).

As in vLLM's benchmark, the first request arrives at t = 0 and each later one one inter-arrival
time after the previous.  Lengths are normal, rounded and clipped (`LengthDist`); each request's
reader rate is drawn from a weighted mix (`RateMix`).

Determinism: only Python's `random.Random` is used (its Mersenne Twister is the same on every
platform).  Arrivals, prompt lengths, output lengths and rates each draw from their own generator
seeded from (seed, stream name), so changing, say, the rate mix leaves arrivals and lengths as
they were.
"""

from __future__ import annotations

import json
import math
import os
import random
from dataclasses import dataclass, replace

KINDS = ("burst", "poisson", "gamma", "trace")
CLASSES = ("reader", "eager", "batch")  # consumption classes (tokenflow.core.request)
TRACE_REQUIRED_KEYS = ("arrival_s", "prompt_tokens", "output_tokens")
TRACE_OPTIONAL_KEYS = ("rate_tps", "stream_class")
# One trace line: arrival_s, prompt_tokens, output_tokens, rate_tps and stream_class (or None).
TraceRow = tuple[float, int, int, float | None, str | None]


class WorkloadError(ValueError):
    """An invalid workload spec, length or rate text, or trace file; the message is one line."""


# -- small checks -------------------------------------------------------------------------------
def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_positive(value: object) -> bool:
    return _is_number(value) and math.isfinite(value) and value > 0  # type: ignore[arg-type]


def _parse_float(text: str, where: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise WorkloadError(f"invalid {where}: {text.strip()!r} is not a number") from None


@dataclass(frozen=True)
class WorkloadRequest:
    """One request to submit: when, how long its prompt and answer are, how fast it is read."""

    request_id: str  # "req-0", "req-1", ... in arrival order
    arrival_s: float
    num_prompt_tokens: int
    num_output_tokens: int
    rate_tps: float  # a reader's tokens/s (eager and batch requests ignore it)
    consumption: str = "reader"  # "reader" | "eager" | "batch" (tokenflow.core.request)

    def __post_init__(self) -> None:
        where = f"request {self.request_id}"
        if self.consumption not in CLASSES:
            raise WorkloadError(f"{where}: class must be one of {', '.join(CLASSES)}")
        if not (_is_number(self.arrival_s) and math.isfinite(self.arrival_s)):
            raise WorkloadError(f"{where}: arrival_s must be a finite number")
        for name in ("num_prompt_tokens", "num_output_tokens"):
            value = getattr(self, name)
            if not _is_int(value) or value < 1:
                raise WorkloadError(f"{where}: {name} must be an integer >= 1, got {value!r}")
        if not _is_positive(self.rate_tps):
            raise WorkloadError(f"{where}: rate_tps must be a finite number > 0")


@dataclass(frozen=True)
class LengthDist:
    """Token lengths ~ round(Normal(mean, std)), clipped to [minimum, maximum]."""

    mean: float
    std: float
    minimum: int = 1
    maximum: int | None = None

    def __post_init__(self) -> None:
        if not _is_positive(self.mean):
            raise WorkloadError(f"length mean must be a finite number > 0, got {self.mean!r}")
        if not (_is_number(self.std) and math.isfinite(self.std) and self.std >= 0):
            raise WorkloadError(f"length std must be a finite number >= 0, got {self.std!r}")
        if not _is_int(self.minimum) or self.minimum < 1:
            raise WorkloadError(f"length minimum must be an integer >= 1, got {self.minimum!r}")
        if self.maximum is not None and (not _is_int(self.maximum) or self.maximum < self.minimum):
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
        mean = _parse_float(parts[0], f"length {text!r}")
        std = _parse_float(parts[1], f"length {text!r}") if len(parts) == 2 else 0.0
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
            if not _is_positive(rate):
                raise WorkloadError(f"rate must be a finite number > 0 tokens/s, got {rate!r}")
        for weight in weights:
            if not (_is_number(weight) and math.isfinite(weight) and weight >= 0):
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
        rates = tuple(_parse_float(p[0], where) for p in pairs)
        weights = tuple(_parse_float(p[1], where) if len(p) == 2 else 1.0 for p in pairs)
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
            if name not in CLASSES:
                raise WorkloadError(f"unknown class {name!r}; choose from {', '.join(CLASSES)}")
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
        weights = tuple(_parse_float(p[1], where) if len(p) == 2 else 1.0 for p in pairs)
        return cls(tuple(p[0] for p in pairs), weights)


@dataclass(frozen=True)
class WorkloadSpec:
    """What to generate.  `num_requests`, lengths and `request_rate` do not apply to traces."""

    kind: str  # "burst" | "poisson" | "gamma" | "trace"
    num_requests: int = 100
    request_rate: float = 1.0  # req/s for poisson/gamma
    burstiness: float = 1.0  # gamma shape (1.0 = Poisson; smaller = burstier)
    prompt: LengthDist = LengthDist(512, 128)
    output: LengthDist = LengthDist(1024, 256)
    rates: RateMix = RateMix((20.0,), (1.0,))
    seed: int = 0
    classes: ClassMix = ClassMix()  # (drawn from their own stream: readers-only draws none)
    trace_path: str | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise WorkloadError(f"unknown workload kind {self.kind!r}; choose one of {KINDS}")
        if not _is_int(self.num_requests) or self.num_requests < 1:
            raise WorkloadError(f"num_requests must be an integer >= 1, got {self.num_requests!r}")
        if not _is_positive(self.request_rate):
            raise WorkloadError(
                f"request_rate must be a finite number > 0 req/s, got {self.request_rate!r}"
            )
        if not _is_positive(self.burstiness):
            raise WorkloadError(f"burstiness must be a finite number > 0, got {self.burstiness!r}")
        if self.kind == "poisson" and self.burstiness != 1.0:
            raise WorkloadError("burstiness applies to kind 'gamma' (poisson is burstiness 1.0)")
        if not _is_int(self.seed):
            raise WorkloadError(f"seed must be an integer, got {self.seed!r}")
        if not (
            isinstance(self.prompt, LengthDist)
            and isinstance(self.output, LengthDist)
            and isinstance(self.rates, RateMix)
        ):
            raise WorkloadError("prompt and output must be LengthDist, rates a RateMix")
        if (self.kind == "trace") != (self.trace_path is not None):
            raise WorkloadError("trace_path is required for kind 'trace' and only for it")


def generate(spec: WorkloadSpec) -> list[WorkloadRequest]:
    """The requests of `spec`, sorted by arrival and numbered "req-0", "req-1", ... in that order.

    For a trace, rows without `rate_tps` draw their rate from `spec.rates`, rows without
    `stream_class` their class from `spec.classes`.
    """
    rate_rng = _stream_rng(spec.seed, "rates")
    if spec.kind == "trace":
        assert spec.trace_path is not None  # checked by WorkloadSpec
        rows = _read_trace(spec.trace_path)
        requests = _numbered(
            [(a, p, o, spec.rates.sample(rate_rng) if r is None else r) for a, p, o, r, _ in rows]
        )
        return _with_stated_classes(_with_classes(requests, spec), rows)
    prompt_rng = _stream_rng(spec.seed, "prompt")
    output_rng = _stream_rng(spec.seed, "output")
    rows = [
        (
            arrival_s,
            spec.prompt.sample(prompt_rng),
            spec.output.sample(output_rng),
            spec.rates.sample(rate_rng),
        )
        for arrival_s in _arrival_times_s(spec)
    ]
    return _with_classes(_numbered(rows), spec)


def _with_classes(requests: list[WorkloadRequest], spec: WorkloadSpec) -> list[WorkloadRequest]:
    """Each request's class, drawn in arrival order from the spec's mix."""
    if spec.classes.is_readers_only:
        return requests
    class_rng = _stream_rng(spec.seed, "classes")
    return [replace(r, consumption=spec.classes.sample(class_rng)) for r in requests]


def load_trace(path: str | os.PathLike[str], default_rate_tps: float) -> list[WorkloadRequest]:
    """Read a JSONL trace: one object per line with `arrival_s`, `prompt_tokens`,
    `output_tokens` and optionally `rate_tps` (else `default_rate_tps`) and `stream_class`
    (reader, eager or batch; else reader).

    Blank lines are skipped.  Arrivals are seconds >= 0, token counts integers >= 1, rates
    finite numbers > 0; anything else (bad JSON, a missing, unknown or repeated key, a wrong
    value) raises WorkloadError naming file:line.  Requests are sorted by arrival, stably (equal
    arrivals keep file order), and numbered in that order; arrival times are kept as recorded.
    """
    if not _is_positive(default_rate_tps):
        raise WorkloadError(
            f"default_rate_tps must be a finite number > 0, got {default_rate_tps!r}"
        )
    rows = _read_trace(path)
    requests = _numbered(
        [(a, p, o, default_rate_tps if r is None else r) for a, p, o, r, _ in rows]
    )
    return _with_stated_classes(requests, rows)


def _with_stated_classes(requests: list[WorkloadRequest], rows: list[TraceRow]) -> list:
    """Each request's class as its trace row states it, if it does (`requests` numbered from
    these rows, in the order `_by_arrival` gives both)."""
    stated = [row[4] for row in _by_arrival(rows)]
    return [
        r if c is None else replace(r, consumption=c) for r, c in zip(requests, stated, strict=True)
    ]


# -- generation ---------------------------------------------------------------------------------
def _stream_rng(seed: int, stream: str) -> random.Random:
    """An independent generator per stream; str seeds are hashed with SHA-512, not hash()."""
    return random.Random(f"tokenflow.workload/{stream}/{seed}")  # (a fixed name: the seeds)


def _arrival_times_s(spec: WorkloadSpec) -> list[float]:
    if spec.kind == "burst":
        return [0.0] * spec.num_requests
    shape = spec.burstiness  # 1.0 for poisson (checked by WorkloadSpec)
    scale_s = 1.0 / (spec.request_rate * shape)
    rng = _stream_rng(spec.seed, "arrivals")
    arrivals, now_s = [], 0.0
    for _ in range(spec.num_requests):
        arrivals.append(now_s)
        now_s += rng.gammavariate(shape, scale_s)
    return arrivals


def _numbered(rows: list[tuple[float, int, int, float]]) -> list[WorkloadRequest]:
    """Sort (arrival_s, prompt, output, rate) rows stably by arrival and give them ids."""
    return [
        WorkloadRequest(f"req-{i}", float(arrival), num_prompt, num_output, float(rate))
        for i, (arrival, num_prompt, num_output, rate) in enumerate(_by_arrival(rows))
    ]


def _by_arrival(rows: list) -> list:
    """Rows (arrival_s first) in arrival order, equal arrivals as given: the requests' order."""
    return sorted(rows, key=lambda row: row[0])


# -- trace files --------------------------------------------------------------------------------
class _JsonObject(list):
    """The (key, value) pairs of one JSON object, repeated keys kept so they can be reported."""


def _read_trace(path: str | os.PathLike[str]) -> list[TraceRow]:
    """(arrival_s, prompt_tokens, output_tokens, rate_tps or None, stream_class or None) per
    non-blank line."""
    try:
        with open(path, encoding="utf-8") as file:
            lines = file.read().splitlines()
    except OSError as error:
        raise WorkloadError(f"{path}: cannot read trace file: {error.strerror or error}") from None
    except UnicodeDecodeError:
        raise WorkloadError(f"{path}: trace file is not UTF-8 text") from None
    rows = [
        _parse_trace_line(line, f"{path}:{number}")
        for number, line in enumerate(lines, start=1)
        if line.strip()
    ]
    if not rows:
        raise WorkloadError(f"{path}: trace file has no requests")
    return rows


def _parse_trace_line(line: str, where: str) -> TraceRow:
    try:
        pairs = json.loads(line, object_pairs_hook=_JsonObject)
    except json.JSONDecodeError as error:
        raise WorkloadError(
            f"{where}: invalid JSON ({error.msg} at column {error.colno})"
        ) from None
    if not isinstance(pairs, _JsonObject):
        raise WorkloadError(f"{where}: expected a JSON object, got {type(pairs).__name__}")
    keys = [key for key, _ in pairs]
    allowed = TRACE_REQUIRED_KEYS + TRACE_OPTIONAL_KEYS
    unknown = sorted({key for key in keys if key not in allowed})
    if unknown:
        raise WorkloadError(f"{where}: unknown key(s) {unknown}; allowed keys are {list(allowed)}")
    repeated = sorted({key for key in keys if keys.count(key) > 1})
    if repeated:
        raise WorkloadError(f"{where}: repeated key(s) {repeated}")
    record = dict(pairs)
    missing = [key for key in TRACE_REQUIRED_KEYS if key not in record]
    if missing:
        raise WorkloadError(f"{where}: missing key(s) {missing}")
    arrival_s = record["arrival_s"]
    if not (_is_number(arrival_s) and math.isfinite(arrival_s) and arrival_s >= 0):
        raise WorkloadError(f"{where}: arrival_s must be a finite number >= 0, got {arrival_s!r}")
    for key in ("prompt_tokens", "output_tokens"):
        if not _is_int(record[key]) or record[key] < 1:
            raise WorkloadError(f"{where}: {key} must be an integer >= 1, got {record[key]!r}")
    rate = record.get("rate_tps")
    if "rate_tps" in record and not _is_positive(rate):
        raise WorkloadError(f"{where}: rate_tps must be a finite number > 0, got {rate!r}")
    stream_class = record.get("stream_class")
    if "stream_class" in record and stream_class not in CLASSES:
        raise WorkloadError(
            f"{where}: stream_class must be one of {', '.join(CLASSES)}, got {stream_class!r}"
        )
    return float(arrival_s), record["prompt_tokens"], record["output_tokens"], rate, stream_class


def save_trace(path: str | os.PathLike[str], requests: list[WorkloadRequest]) -> None:
    """Write `requests` as a JSONL trace that `load_trace` (and `--workload trace`) reads back
    to the same requests: one object per line, in arrival order, every key of the format."""
    lines = [
        json.dumps(
            {
                "arrival_s": r.arrival_s,
                "prompt_tokens": r.num_prompt_tokens,
                "output_tokens": r.num_output_tokens,
                "rate_tps": r.rate_tps,
                "stream_class": r.consumption,
            }
        )
        for r in sorted(requests, key=lambda r: r.arrival_s)
    ]
    try:
        with open(path, "w", encoding="utf-8") as file:
            file.write("".join(f"{line}\n" for line in lines))
    except OSError as error:
        raise WorkloadError(f"{path}: cannot write trace file: {error.strerror or error}") from None
