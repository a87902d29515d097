"""Workloads shared by the simulator and the HTTP benchmark client.

A workload is a list of `WorkloadRequest`s sorted by arrival.  It comes from a `WorkloadSpec`:

- ``burst``: every request arrives at t = 0 (the paper's setups (a) and (b));
- ``poisson``: exponential inter-arrival times at ``request_rate`` req/s (setups (c) and (d));
- ``gamma``: gamma inter-arrival times with shape = ``burstiness`` and scale =
  1 / (request_rate * burstiness), as ``vllm bench serve --burstiness`` (1.0 is Poisson, smaller
  is burstier; the mean stays 1 / request_rate);
- ``trace``: a JSONL file of recorded requests (see `load_trace`);
- ``conversation``: chat sessions whose turns resend their history behind an app's system
  prompt, each turn sent some think time after its reader has read the previous answer
  (closed loop; tokenflow/eval/conversation.py).  `request_rate` is then sessions/s.

As in vLLM's benchmark, the first request arrives at t = 0 and each later one one inter-arrival
time after the previous.  Lengths are normal, rounded and clipped (`LengthDist`); each request's
reader rate is drawn from a weighted mix (`RateMix`).

Determinism: only Python's `random.Random` is used (its Mersenne Twister is the same on every
platform).  Arrivals, prompt lengths, output lengths and rates each draw from their own generator
seeded from (seed, stream name), so changing, say, the rate mix leaves arrivals and lengths as
they were.

Trace files (JSONL, one request per line; `load_trace`, `save_trace`): `arrival_s`,
`prompt_tokens` and `output_tokens`, optionally `rate_tps` and `stream_class`.  A turn of a
conversation adds `session_id`, `turn` (0, 1, ...), `app_id`, `system_tokens` (the app's system
prompt), `user_tokens` (this turn's message), `think_s` (default 0) and, after turn 0,
`after_id`: the `request_id` of the session's previous turn, so such a trace gives every line a
`request_id`.  Its prompt is the system prompt, each earlier turn's message and answer
(`output_tokens`), and its message, so `prompt_tokens` must be their sum.  A replay sends such
a turn `think_s` after its reader has read the previous answer; its `arrival_s` (when it was
sent, or a generated workload's nominal time) only orders the file.
"""

from __future__ import annotations

import math
import os
import random
from dataclasses import dataclass, replace

from tokenflow.core.consumption import CLASS_NAMES
from tokenflow.core.request import reader_rate_error
from tokenflow.eval.conversation import (
    ConversationSpec,
    Segment,
    SessionTurn,
    first_turn_segments,
    generate_sessions,
    next_turn_segments,
    turn_name,
)
from tokenflow.eval.distributions import (
    ClassMix,
    LengthDist,
    RateMix,
    WorkloadError,
    is_int,
    is_number,
    is_positive,
    is_rate,
)
from tokenflow.eval.trace_file import TraceLine, TraceTurn, read_trace, write_trace

KINDS = ("burst", "poisson", "gamma", "trace", "conversation")


@dataclass(frozen=True)
class WorkloadRequest:
    """One request to submit: when, how long its prompt and answer are, how fast it is read."""

    request_id: str  # "req-0", "req-1", ... in arrival order
    arrival_s: float
    num_prompt_tokens: int
    num_output_tokens: int
    rate_tps: float  # a reader's tokens/s (eager and batch requests ignore it)
    consumption: str = "reader"  # one of CLASS_NAMES (tokenflow.core.consumption)
    # A conversation's turn (tokenflow/eval/conversation.py); None and empty otherwise.
    session_id: str | None = None  # its session (sent as OpenAI's prompt_cache_key)
    turn: int = 0  # 0, 1, ... within the session
    # The session's previous turn: this one is sent `think_s` after that one's reader has read
    # its whole answer (closed loop), not at `arrival_s` (then its nominal time).
    after_id: str | None = None
    think_s: float = 0.0
    app_id: str | None = None  # whose system prompt begins the prompt
    segments: tuple[Segment, ...] = ()  # the prompt: system, earlier turns, this message

    def __post_init__(self) -> None:
        where = f"request {self.request_id}"
        if self.consumption not in CLASS_NAMES:
            raise WorkloadError(f"{where}: class must be one of {', '.join(CLASS_NAMES)}")
        if not (is_number(self.arrival_s) and math.isfinite(self.arrival_s)):
            raise WorkloadError(f"{where}: arrival_s must be a finite number")
        for name in ("num_prompt_tokens", "num_output_tokens"):
            value = getattr(self, name)
            if not is_int(value) or value < 1:
                raise WorkloadError(f"{where}: {name} must be an integer >= 1, got {value!r}")
        if not is_rate(self.rate_tps):
            raise WorkloadError(f"{where}: rate_tps: {reader_rate_error(self.rate_tps)}")
        if self.session_id is not None:
            self._check_turn(where)
        elif self.turn or self.after_id or self.think_s or self.app_id or self.segments:
            raise WorkloadError(
                f"{where}: turn, after_id, think_s, app_id and segments belong to a session: "
                "give its session_id"
            )

    def _check_turn(self, where: str) -> None:
        """A conversation's turn: its numbering, think time and prompt segments agree."""
        if not (isinstance(self.session_id, str) and self.session_id):
            raise WorkloadError(f"{where}: session_id must be a non-empty string")
        if not is_int(self.turn) or self.turn < 0:
            raise WorkloadError(f"{where}: turn must be an integer >= 0, got {self.turn!r}")
        if (self.turn == 0) != (self.after_id is None):
            raise WorkloadError(
                f"{where}: turn 0 has no after_id, a later turn names the previous one's request"
            )
        if not (is_number(self.think_s) and math.isfinite(self.think_s) and self.think_s >= 0):
            raise WorkloadError(f"{where}: think_s must be a finite number >= 0")
        segments = self.segments
        if not (segments and all(isinstance(s, Segment) for s in segments)):
            raise WorkloadError(f"{where}: a turn's segments must be a tuple of Segment")
        first, last = segments[0], segments[-1]
        is_user_k = (last.role, last.name) == ("user", turn_name(self.session_id, self.turn))
        if (first.role, first.name) != ("system", self.app_id) or not is_user_k:
            raise WorkloadError(
                f"{where}: segments must begin with app_id's system prompt and end with this "
                "turn's user message"
            )
        total = sum(s.num_tokens for s in segments)
        if total != self.num_prompt_tokens:
            raise WorkloadError(
                f"{where}: num_prompt_tokens {self.num_prompt_tokens} differs from its "
                f"segments' {total}"
            )


@dataclass(frozen=True)
class WorkloadSpec:
    """What to generate.  `num_requests`, lengths and `request_rate` do not apply to traces."""

    kind: str  # "burst" | "poisson" | "gamma" | "trace" | "conversation"
    num_requests: int = 100  # (a conversation's come from its sessions)
    request_rate: float = 1.0  # req/s for poisson/gamma; sessions/s for conversation
    burstiness: float = 1.0  # gamma shape (1.0 = Poisson; smaller = burstier)
    prompt: LengthDist = LengthDist(512, 128)
    output: LengthDist = LengthDist(1024, 256)
    rates: RateMix = RateMix((20.0,), (1.0,))
    seed: int = 0
    classes: ClassMix = ClassMix()  # (drawn from their own stream: readers-only draws none)
    trace_path: str | None = None
    # kind "conversation": its sessions (`prompt` and `num_requests` do not apply)
    conversation: ConversationSpec = ConversationSpec()

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise WorkloadError(f"unknown workload kind {self.kind!r}; choose one of {KINDS}")
        if not is_int(self.num_requests) or self.num_requests < 1:
            raise WorkloadError(f"num_requests must be an integer >= 1, got {self.num_requests!r}")
        if not is_positive(self.request_rate):
            raise WorkloadError(
                f"request_rate must be a finite number > 0 req/s, got {self.request_rate!r}"
            )
        if not is_positive(self.burstiness):
            raise WorkloadError(f"burstiness must be a finite number > 0, got {self.burstiness!r}")
        if self.kind == "poisson" and self.burstiness != 1.0:
            raise WorkloadError("burstiness applies to kind 'gamma' (poisson is burstiness 1.0)")
        if not is_int(self.seed):
            raise WorkloadError(f"seed must be an integer, got {self.seed!r}")
        if not (
            isinstance(self.prompt, LengthDist)
            and isinstance(self.output, LengthDist)
            and isinstance(self.rates, RateMix)
        ):
            raise WorkloadError("prompt and output must be LengthDist, rates a RateMix")
        if (self.kind == "trace") != (self.trace_path is not None):
            raise WorkloadError("trace_path is required for kind 'trace' and only for it")
        if not isinstance(self.conversation, ConversationSpec):
            raise WorkloadError("conversation must be a ConversationSpec")


def generate(spec: WorkloadSpec) -> list[WorkloadRequest]:
    """The requests of `spec`, sorted by arrival and numbered "req-0", "req-1", ... in that order.

    For a trace, rows without `rate_tps` draw their rate from `spec.rates`, rows without
    `stream_class` their class from `spec.classes`.
    """
    rate_rng = _stream_rng(spec.seed, "rates")
    if spec.kind == "conversation":
        turns = generate_sessions(
            spec.conversation,
            sessions_per_s=spec.request_rate,
            output=spec.output,
            rates=spec.rates,
            classes=spec.classes,
            seed=spec.seed,
            stream_rng=lambda name: _stream_rng(spec.seed, name),
        )
        return _numbered_turns(turns)
    if spec.kind == "trace":
        assert spec.trace_path is not None  # checked by WorkloadSpec
        lines = read_trace(spec.trace_path)
        rates = [spec.rates.sample(rate_rng) if r.rate_tps is None else r.rate_tps for r in lines]
        return _with_stated_classes(_with_classes(_trace_requests(lines, rates), spec), lines)
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


def _numbered_turns(turns: list[SessionTurn]) -> list[WorkloadRequest]:
    """Sessions' turns (each session's in turn order) sorted stably by nominal arrival and
    numbered; a turn's `after_id` is its session's previous turn (numbered before it: its
    nominal arrival is no later)."""
    request_ids: dict[str, str] = {}  # turn name -> request id
    requests = []
    for index, turn in enumerate(sorted(turns, key=lambda t: t.arrival_s)):
        request_id = f"req-{index}"
        request_ids[turn_name(turn.session_id, turn.turn)] = request_id
        previous = turn_name(turn.session_id, turn.turn - 1) if turn.turn else None
        requests.append(
            WorkloadRequest(
                request_id=request_id,
                arrival_s=turn.arrival_s,
                num_prompt_tokens=sum(s.num_tokens for s in turn.segments),
                num_output_tokens=turn.num_output_tokens,
                rate_tps=turn.rate_tps,
                consumption=turn.consumption,
                session_id=turn.session_id,
                turn=turn.turn,
                after_id=None if previous is None else request_ids[previous],
                think_s=turn.think_s,
                app_id=turn.app_id,
                segments=turn.segments,
            )
        )
    return requests


# -- trace files (the line format: tokenflow/eval/trace_file.py) ----------------------------------
def load_trace(path: str | os.PathLike[str], default_rate_tps: float) -> list[WorkloadRequest]:
    """Read a JSONL trace (the module docstring lists its keys); lines without `rate_tps` get
    `default_rate_tps`, without `stream_class` the reader class.

    Blank lines are skipped.  Arrivals are seconds >= 0, token counts integers >= 1, rates a
    reader's (`distributions.is_rate`); anything else (bad JSON, a missing, unknown or repeated
    key, a wrong value, a turn that does not follow its session's previous one) raises
    WorkloadError naming file:line.  Requests are sorted by arrival, stably (equal arrivals
    keep file order), and numbered in that order unless the lines give request ids; arrival
    times are kept as recorded.
    """
    if not is_rate(default_rate_tps):
        raise WorkloadError(f"default_rate_tps: {reader_rate_error(default_rate_tps)}")
    lines = read_trace(path)
    rates = [default_rate_tps if line.rate_tps is None else line.rate_tps for line in lines]
    return _with_stated_classes(_trace_requests(lines, rates), lines)


def _with_stated_classes(requests: list[WorkloadRequest], lines: list[TraceLine]) -> list:
    """Each request's class as its trace line states it, if it does (`requests` made from
    these lines, in the order `_by_arrival` gives both)."""
    stated = [line.stream_class for line in sorted(lines, key=lambda line: line.arrival_s)]
    return [
        r if c is None else replace(r, consumption=c) for r, c in zip(requests, stated, strict=True)
    ]


def _trace_requests(lines: list[TraceLine], rates_tps: list[float]) -> list[WorkloadRequest]:
    """The lines' requests (line i at `rates_tps[i]`), in arrival order, with their ids."""
    order = sorted(range(len(lines)), key=lambda i: lines[i].arrival_s)
    has_ids = [line.request_id is not None for line in lines]
    if any(has_ids) and not all(has_ids):
        where = lines[has_ids.index(False)].where
        raise WorkloadError(f"{where}: give request_id on every line or on none")
    if not any(has_ids) and any(line.session and line.session.turn for line in lines):
        where = next(line.where for line in lines if line.session and line.session.turn)
        raise WorkloadError(f"{where}: after_id names a request_id: give one on every line")
    requests: dict[str, WorkloadRequest] = {}
    turns_seen: set[str] = set()  # turn names
    for position, i in enumerate(order):
        line = lines[i]
        request_id = line.request_id or f"req-{position}"
        if request_id in requests:
            raise WorkloadError(f"{line.where}: request_id {request_id!r} is given twice")
        turn_fields = {}
        if line.session is not None:
            name = turn_name(line.session.session_id, line.session.turn)
            if name in turns_seen:
                raise WorkloadError(f"{line.where}: turn {name!r} (session/turn) is given twice")
            turns_seen.add(name)
            turn_fields = _turn_fields(line, line.session, requests)
        requests[request_id] = WorkloadRequest(
            request_id=request_id,
            arrival_s=line.arrival_s,
            num_prompt_tokens=line.num_prompt_tokens,
            num_output_tokens=line.num_output_tokens,
            rate_tps=float(rates_tps[i]),
            **turn_fields,
        )
    return list(requests.values())


def _turn_fields(line: TraceLine, turn: TraceTurn, earlier: dict[str, WorkloadRequest]) -> dict:
    """A turn's WorkloadRequest fields; WorkloadError unless it follows its session's previous
    turn (`earlier`: the requests before it in arrival order)."""
    where, session_id = line.where, turn.session_id
    if turn.after_id is None:
        segments = first_turn_segments(
            turn.app_id, turn.num_system_tokens, session_id, turn.num_user_tokens
        )
    else:
        previous = earlier.get(turn.after_id)
        if previous is None:
            raise WorkloadError(
                f"{where}: after_id {turn.after_id!r} names no request arriving before this one"
            )
        if previous.session_id != session_id or previous.turn != turn.turn - 1:
            raise WorkloadError(
                f"{where}: after_id {turn.after_id!r} must be turn {turn.turn - 1} of session "
                f"{session_id!r}, not turn {previous.turn} of session {previous.session_id!r}"
            )
        system = previous.segments[0]
        if (system.name, system.num_tokens) != (turn.app_id, turn.num_system_tokens):
            raise WorkloadError(f"{where}: a session keeps its app_id and system_tokens")
        segments = next_turn_segments(
            previous.segments, previous.num_output_tokens, turn.num_user_tokens
        )
    expected = sum(s.num_tokens for s in segments)
    if line.num_prompt_tokens != expected:
        raise WorkloadError(
            f"{where}: prompt_tokens must be system_tokens + the earlier turns' user and output "
            f"tokens + user_tokens = {expected}, got {line.num_prompt_tokens}"
        )
    return dict(
        session_id=session_id,
        turn=turn.turn,
        after_id=turn.after_id,
        think_s=turn.think_s,
        app_id=turn.app_id,
        segments=segments,
    )


def save_trace(path: str | os.PathLike[str], requests: list[WorkloadRequest]) -> None:
    """Write `requests` as a JSONL trace that `load_trace` (and `--workload trace`) reads back
    to the same requests: one object per line, in arrival order, every key of the format
    (request ids only if some request is a conversation's turn: `after_id` names them)."""
    has_sessions = any(r.session_id is not None for r in requests)
    lines = [
        TraceLine(
            where=str(path),
            arrival_s=r.arrival_s,
            num_prompt_tokens=r.num_prompt_tokens,
            num_output_tokens=r.num_output_tokens,
            rate_tps=r.rate_tps,
            stream_class=r.consumption,
            request_id=r.request_id if has_sessions else None,
            session=_trace_turn(r),
        )
        for r in sorted(requests, key=lambda r: r.arrival_s)
    ]
    write_trace(path, lines)


def _trace_turn(request: WorkloadRequest) -> TraceTurn | None:
    if request.session_id is None or request.app_id is None:
        return None
    return TraceTurn(
        session_id=request.session_id,
        turn=request.turn,
        app_id=request.app_id,
        num_system_tokens=request.segments[0].num_tokens,
        num_user_tokens=request.segments[-1].num_tokens,
        after_id=request.after_id,
        think_s=request.think_s,
    )
