"""Conversations: the prompts of chat sessions and the token identity they share.

Chat is conversations.  Each turn resends the whole history, and apps put one system prompt in
front of every user, so a turn's prompt is made of *segments*:

    system prompt of app A, (user message 0, answer 0), ..., (user message k-1, answer k-1),
    user message k

A `Segment` names its text (`role`, `name`) and gives its length; it never holds the text.
Equal segments have equal token ids (`segment_token_ids`), so the turns of a session share
their history and the sessions of an app share its system prompt, token for token.  Names:
the system prompt is the app's id; a turn's user message and its answer are named by the turn
(`turn_name`: "<session id>/<turn>"), with roles "user" and "assistant".  Turn k + 1's segments
are turn k's, then turn k's answer, then the new user message (`next_turn_segments`).

Answers.  An assistant segment stands for the answer its turn received; whoever replays the
workload repeats the answer *as served* when it has it (`prompt_token_ids(..., answers)`: the
simulator's generated token ids, the HTTP client's received text), so the history matches what
the server computed for the previous turn, as a real chat client's does.  Without it, the
segment's own ids are drawn like any other, at the requested output length.

Token ids are drawn from a generator seeded by the segment's role and name (a str seed is
hashed with SHA-512, never Python's salted `hash()`), so they are the same in every run and on
every platform.  They lie in [1000, 1000 + 2**16), above the simulator's output ids [1, 1000).

Sessions (`generate_sessions`, for `WorkloadSpec(kind="conversation")`, shaped by its
`ConversationSpec`): sessions arrive as a Poisson process at the workload's `request_rate`
sessions/s (the first at t = 0) or all at once (`session_arrivals="burst"`).  Each session
belongs to an app drawn with Zipf weights 1 / (rank + 1) ** `app_zipf_s` (0: uniform), has a
number of turns uniform in [`min_turns`, `max_turns`], one reader (rate and class drawn once),
and per turn a user message, an answer length (the workload's `output`) and, after the first, a
think time drawn exponential with mean `think_mean_s`.  Each of these draws from its own seeded
stream.  A turn after the first is sent `think_s` after its reader has read the previous answer
(closed loop); its `arrival_s` is only the nominal time it would be sent if every answer
streamed at once (`nominal_read_s`), which orders the workload.
"""

from __future__ import annotations

import math
import random
import struct
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, fields

from tokenflow.eval.distributions import (
    ClassMix,
    LengthDist,
    RateMix,
    WorkloadError,
    is_int,
    is_number,
)

ROLES = ("system", "user", "assistant")
SESSION_ARRIVALS = ("poisson", "burst")
FIRST_TEXT_TOKEN_ID = 1000  # above the simulator's output ids, [1, 1000)
NUM_TEXT_TOKEN_IDS = 1 << 16  # (two random bytes per token)


@dataclass(frozen=True)
class Segment:
    """One message of a conversation prompt: who says it, what names its text, its length."""

    role: str  # "system" | "user" | "assistant"
    name: str  # the app's id (system), else the turn's name (`turn_name`)
    num_tokens: int

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"segment role must be one of {', '.join(ROLES)}, got {self.role!r}")
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"segment name must be a non-empty string, got {self.name!r}")
        if not isinstance(self.num_tokens, int) or isinstance(self.num_tokens, bool):
            raise ValueError(f"segment num_tokens must be an integer, got {self.num_tokens!r}")
        if self.num_tokens < 1:
            raise ValueError(f"segment num_tokens must be >= 1, got {self.num_tokens}")


def turn_name(session_id: str, turn: int) -> str:
    """The name of a turn's user message and of its answer."""
    return f"{session_id}/{turn}"


def first_turn_segments(
    app_id: str, num_system_tokens: int, session_id: str, num_user_tokens: int
) -> tuple[Segment, ...]:
    """Turn 0's prompt: the app's system prompt, then the first user message."""
    return (
        Segment("system", app_id, num_system_tokens),
        Segment("user", turn_name(session_id, 0), num_user_tokens),
    )


def next_turn_segments(
    previous: Sequence[Segment], previous_output_tokens: int, num_user_tokens: int
) -> tuple[Segment, ...]:
    """Turn k + 1's prompt: turn k's (`previous`, ending with its user message), turn k's
    answer of `previous_output_tokens`, and the new user message."""
    last = previous[-1]
    session_id, _, turn = last.name.rpartition("/")
    return (
        *previous,
        Segment("assistant", last.name, previous_output_tokens),
        Segment("user", turn_name(session_id, int(turn) + 1), num_user_tokens),
    )


# -- token identity -----------------------------------------------------------------------------
def segment_token_ids(segment: Segment) -> tuple[int, ...]:
    """The segment's own token ids: a function of its role, name and length only."""
    rng = random.Random(f"tokenflow.conversation/{segment.role}/{segment.name}")
    count = segment.num_tokens
    draws = struct.unpack(f"<{count}H", rng.randbytes(2 * count))  # (little-endian: any platform)
    return tuple(FIRST_TEXT_TOKEN_ID + draw for draw in draws)


def prompt_token_ids(
    segments: Sequence[Segment], answers: Mapping[str, Sequence[int]] | None = None
) -> tuple[int, ...]:
    """A prompt's token ids, segment after segment.  An assistant segment repeats the answer
    its turn received (`answers[turn name]`, as served) when `answers` has it, else its own ids.
    """
    ids: list[int] = []
    for segment in segments:
        served = answers.get(segment.name) if answers and segment.role == "assistant" else None
        ids.extend(segment_token_ids(segment) if served is None else served)
    return tuple(ids)


def nominal_read_s(num_output_tokens: int, rate_tps: float, consumption: str) -> float:
    """Seconds from an answer's first token to its reader's last, were every token there at
    once (an eager or batch request reads it whole at once)."""
    return (num_output_tokens - 1) / rate_tps if consumption == "reader" else 0.0


# -- generated sessions -------------------------------------------------------------------------
@dataclass(frozen=True)
class ConversationSpec:
    """The sessions of a conversation workload (`WorkloadSpec.conversation`)."""

    num_sessions: int = 100
    min_turns: int = 3  # turns per session: uniform in [min_turns, max_turns]
    max_turns: int = 8
    num_apps: int = 1  # each with its own system prompt
    system_prompt: LengthDist = LengthDist(2000, 0)  # tokens, drawn once per app
    user_message: LengthDist = LengthDist(200, 50)  # tokens, per turn
    think_mean_s: float = 15.0  # mean of the exponential think time before a next turn
    session_arrivals: str = "poisson"  # "poisson" at the workload's request_rate | "burst"
    app_zipf_s: float = 1.0  # an app's weight is 1 / (rank + 1) ** app_zipf_s (0: uniform)

    def __post_init__(self) -> None:
        for name in ("num_sessions", "min_turns", "num_apps"):
            value = getattr(self, name)
            if not is_int(value) or value < 1:
                raise WorkloadError(f"{name} must be an integer >= 1, got {value!r}")
        if not is_int(self.max_turns) or self.max_turns < self.min_turns:
            raise WorkloadError(
                f"max_turns must be an integer >= min_turns={self.min_turns}, got "
                f"{self.max_turns!r}"
            )
        if not all(isinstance(d, LengthDist) for d in (self.system_prompt, self.user_message)):
            raise WorkloadError("system_prompt and user_message must be LengthDist")
        for name in ("think_mean_s", "app_zipf_s"):
            value = getattr(self, name)
            if not (is_number(value) and math.isfinite(value) and value >= 0):
                raise WorkloadError(f"{name} must be a finite number >= 0, got {value!r}")
        if self.session_arrivals not in SESSION_ARRIVALS:
            raise WorkloadError(
                f"session_arrivals must be one of {', '.join(SESSION_ARRIVALS)}, got "
                f"{self.session_arrivals!r}"
            )


@dataclass(frozen=True)
class SessionTurn:
    """One turn of a generated session, before the workload numbers the requests."""

    session_id: str
    turn: int
    app_id: str
    arrival_s: float  # nominal (see the module docstring)
    segments: tuple[Segment, ...]
    num_output_tokens: int
    rate_tps: float
    consumption: str
    think_s: float  # 0 for the first turn


@dataclass(frozen=True)
class _Streams:
    """One seeded generator per kind of draw: changing one leaves the others as they were."""

    apps: random.Random
    turns: random.Random
    user: random.Random
    output: random.Random
    think: random.Random
    rates: random.Random
    classes: random.Random

    @classmethod
    def of(cls, stream_rng: Callable[[str], random.Random]) -> _Streams:
        """Each field's generator is the workload's stream of that name."""
        return cls(**{field.name: stream_rng(field.name) for field in fields(cls)})


@dataclass(frozen=True)
class _Readers:
    """What the workload draws a session's reader and answers from."""

    output: LengthDist
    rates: RateMix
    classes: ClassMix


def generate_sessions(
    spec: ConversationSpec,
    *,
    sessions_per_s: float,
    output: LengthDist,
    rates: RateMix,
    classes: ClassMix,
    seed: int,
    stream_rng: Callable[[str], random.Random],
) -> list[SessionTurn]:
    """Every turn of the sessions, session after session, each in turn order: answers of
    `output` tokens, readers from `rates` and `classes`; `stream_rng(name)` gives the
    workload's seeded generator of one stream, `seed` names the apps and sessions."""
    system_rng = stream_rng("system")
    apps = [
        (f"app{seed}-{index}", spec.system_prompt.sample(system_rng))
        for index in range(spec.num_apps)
    ]
    weights = [1.0 / (rank + 1) ** spec.app_zipf_s for rank in range(spec.num_apps)]
    streams = _Streams.of(stream_rng)
    readers = _Readers(output, rates, classes)
    starts_s = _session_starts_s(spec, sessions_per_s, stream_rng("session-arrivals"))
    turns: list[SessionTurn] = []
    for index, start_s in enumerate(starts_s):
        app_id, num_system_tokens = streams.apps.choices(apps, weights=weights)[0]
        session_id = f"s{seed}-{index}"
        turns.extend(
            _session(spec, readers, streams, session_id, start_s, app_id, num_system_tokens)
        )
    return turns


def _session_starts_s(
    spec: ConversationSpec, sessions_per_s: float, rng: random.Random
) -> Iterator[float]:
    now_s = 0.0
    for _ in range(spec.num_sessions):
        yield now_s
        if spec.session_arrivals == "poisson":
            now_s += rng.expovariate(sessions_per_s)


def _session(
    spec: ConversationSpec,
    readers: _Readers,
    streams: _Streams,
    session_id: str,
    start_s: float,
    app_id: str,
    num_system_tokens: int,
) -> list[SessionTurn]:
    """One session's turns (its draws in turn order, each from its own stream)."""
    num_turns = streams.turns.randint(spec.min_turns, spec.max_turns)
    rate_tps = readers.rates.sample(streams.rates)
    is_readers = readers.classes.is_readers_only
    consumption = "reader" if is_readers else readers.classes.sample(streams.classes)
    turns: list[SessionTurn] = []
    for turn in range(num_turns):
        num_user_tokens = spec.user_message.sample(streams.user)
        num_output_tokens = readers.output.sample(streams.output)
        if not turns:
            think_s, arrival_s = 0.0, start_s
            segments = first_turn_segments(app_id, num_system_tokens, session_id, num_user_tokens)
        else:
            last = turns[-1]
            think_s = _think_s(spec.think_mean_s, streams.think)
            read_s = nominal_read_s(last.num_output_tokens, rate_tps, consumption)
            arrival_s = last.arrival_s + read_s + think_s
            segments = next_turn_segments(last.segments, last.num_output_tokens, num_user_tokens)
        turns.append(
            SessionTurn(
                session_id=session_id,
                turn=turn,
                app_id=app_id,
                arrival_s=arrival_s,
                segments=segments,
                num_output_tokens=num_output_tokens,
                rate_tps=rate_tps,
                consumption=consumption,
                think_s=think_s,
            )
        )
    return turns


def _think_s(mean_s: float, rng: random.Random) -> float:
    """Seconds between reading an answer and sending the next message: exponential."""
    return rng.expovariate(1.0 / mean_s) if mean_s > 0 else 0.0
