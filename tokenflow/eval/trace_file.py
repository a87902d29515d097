"""The JSONL trace format, line by line: what one line may hold, read and written.

The format is documented in tokenflow/eval/workload.py, which turns lines into requests
(`load_trace`, and the checks that span lines: a session's turns) and requests into lines
(`save_trace`).  Here each line is parsed and validated on its own; every error is one line
naming file:line.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass

from tokenflow.core.consumption import CLASS_NAMES
from tokenflow.core.request import reader_rate_error
from tokenflow.eval.distributions import WorkloadError, is_int, is_number, is_rate

TRACE_REQUIRED_KEYS = ("arrival_s", "prompt_tokens", "output_tokens")
TRACE_OPTIONAL_KEYS = ("rate_tps", "stream_class", "request_id")
# A conversation's turn: all of TRACE_SESSION_KEYS, `think_s` optionally, `after_id` after turn 0.
TRACE_SESSION_KEYS = ("session_id", "turn", "app_id", "system_tokens", "user_tokens")
TRACE_TURN_KEYS = ("after_id", "think_s")
_ALLOWED_KEYS = TRACE_REQUIRED_KEYS + TRACE_OPTIONAL_KEYS + TRACE_SESSION_KEYS + TRACE_TURN_KEYS


@dataclass(frozen=True)
class TraceTurn:
    """The session keys of a line: which turn of which conversation it is."""

    session_id: str
    turn: int
    app_id: str
    num_system_tokens: int
    num_user_tokens: int
    after_id: str | None = None  # the previous turn's request_id (turn > 0)
    think_s: float = 0.0


@dataclass(frozen=True)
class TraceLine:
    """One request as a trace line states it (None: the line does not say)."""

    where: str  # "file:line", for messages
    arrival_s: float
    num_prompt_tokens: int
    num_output_tokens: int
    rate_tps: float | None = None
    stream_class: str | None = None
    request_id: str | None = None
    session: TraceTurn | None = None

    def to_json(self) -> str:
        """The line's JSON text (keys it does not state are left out)."""
        record: dict[str, object] = {
            "arrival_s": self.arrival_s,
            "prompt_tokens": self.num_prompt_tokens,
            "output_tokens": self.num_output_tokens,
            "rate_tps": self.rate_tps,
            "stream_class": self.stream_class,
            "request_id": self.request_id,
        }
        turn = self.session
        if turn is not None:
            record |= {
                "session_id": turn.session_id,
                "turn": turn.turn,
                "after_id": turn.after_id,
                "think_s": turn.think_s,
                "app_id": turn.app_id,
                "system_tokens": turn.num_system_tokens,
                "user_tokens": turn.num_user_tokens,
            }
        return json.dumps({key: value for key, value in record.items() if value is not None})


class _JsonObject(list):
    """The (key, value) pairs of one JSON object, repeated keys kept so they can be reported."""


def read_trace(path: str | os.PathLike[str]) -> list[TraceLine]:
    """Every non-blank line of the file, in file order."""
    try:
        with open(path, encoding="utf-8") as file:
            lines = file.read().splitlines()
    except OSError as error:
        raise WorkloadError(f"{path}: cannot read trace file: {error.strerror or error}") from None
    except UnicodeDecodeError:
        raise WorkloadError(f"{path}: trace file is not UTF-8 text") from None
    rows = [
        parse_trace_line(line, f"{path}:{number}")
        for number, line in enumerate(lines, start=1)
        if line.strip()
    ]
    if not rows:
        raise WorkloadError(f"{path}: trace file has no requests")
    return rows


def write_trace(path: str | os.PathLike[str], lines: list[TraceLine]) -> None:
    """Write `lines` in order, one JSON object each."""
    try:
        with open(path, "w", encoding="utf-8") as file:
            file.write("".join(f"{line.to_json()}\n" for line in lines))
    except OSError as error:
        raise WorkloadError(f"{path}: cannot write trace file: {error.strerror or error}") from None


def parse_trace_line(line: str, where: str) -> TraceLine:
    """One line's request; WorkloadError naming `where` if anything in it is wrong."""
    record = _record(line, where)
    arrival_s = record["arrival_s"]
    if not (is_number(arrival_s) and math.isfinite(arrival_s) and arrival_s >= 0):
        raise WorkloadError(f"{where}: arrival_s must be a finite number >= 0, got {arrival_s!r}")
    for key in ("prompt_tokens", "output_tokens"):
        _check_count(record, key, where)
    rate = record.get("rate_tps")
    if "rate_tps" in record and not is_rate(rate):
        raise WorkloadError(f"{where}: rate_tps: {reader_rate_error(rate)}")
    stream_class = record.get("stream_class")
    if "stream_class" in record and stream_class not in CLASS_NAMES:
        raise WorkloadError(
            f"{where}: stream_class must be one of {', '.join(CLASS_NAMES)}, got {stream_class!r}"
        )
    if "request_id" in record:
        _check_name(record, "request_id", where)
    return TraceLine(
        where=where,
        arrival_s=float(arrival_s),
        num_prompt_tokens=record["prompt_tokens"],
        num_output_tokens=record["output_tokens"],
        rate_tps=rate,
        stream_class=stream_class,
        request_id=record.get("request_id"),
        session=_session(record, where),
    )


def _record(line: str, where: str) -> dict:
    """The line's JSON object, with only known keys, each once, the required ones present."""
    try:
        pairs = json.loads(line, object_pairs_hook=_JsonObject)
    except json.JSONDecodeError as error:
        raise WorkloadError(
            f"{where}: invalid JSON ({error.msg} at column {error.colno})"
        ) from None
    if not isinstance(pairs, _JsonObject):
        raise WorkloadError(f"{where}: expected a JSON object, got {type(pairs).__name__}")
    keys = [key for key, _ in pairs]
    unknown = sorted({key for key in keys if key not in _ALLOWED_KEYS})
    if unknown:
        raise WorkloadError(
            f"{where}: unknown key(s) {unknown}; allowed keys are {list(_ALLOWED_KEYS)}"
        )
    repeated = sorted({key for key in keys if keys.count(key) > 1})
    if repeated:
        raise WorkloadError(f"{where}: repeated key(s) {repeated}")
    record = dict(pairs)
    missing = [key for key in TRACE_REQUIRED_KEYS if key not in record]
    if missing:
        raise WorkloadError(f"{where}: missing key(s) {missing}")
    return record


def _session(record: dict, where: str) -> TraceTurn | None:
    """The line's session keys, all of them or none."""
    given = [key for key in TRACE_SESSION_KEYS + TRACE_TURN_KEYS if key in record]
    if not given:
        return None
    missing = [key for key in TRACE_SESSION_KEYS if key not in record]
    if missing:
        raise WorkloadError(f"{where}: a conversation's turn needs {missing} too (it has {given})")
    for key in ("session_id", "app_id"):
        _check_name(record, key, where)
    turn = record["turn"]
    if not is_int(turn) or turn < 0:
        raise WorkloadError(f"{where}: turn must be an integer >= 0, got {turn!r}")
    for key in ("system_tokens", "user_tokens"):
        _check_count(record, key, where)
    if (turn == 0) == ("after_id" in record):
        raise WorkloadError(
            f"{where}: turn 0 takes no after_id, and a later turn needs one (the request_id of "
            "its session's previous turn)"
        )
    if "after_id" in record:
        _check_name(record, "after_id", where)
    think_s = record.get("think_s", 0.0)
    if not (is_number(think_s) and math.isfinite(think_s) and think_s >= 0):
        raise WorkloadError(f"{where}: think_s must be a finite number >= 0, got {think_s!r}")
    return TraceTurn(
        session_id=record["session_id"],
        turn=turn,
        app_id=record["app_id"],
        num_system_tokens=record["system_tokens"],
        num_user_tokens=record["user_tokens"],
        after_id=record.get("after_id"),
        think_s=float(think_s),
    )


def _check_count(record: dict, key: str, where: str) -> None:
    if not is_int(record[key]) or record[key] < 1:
        raise WorkloadError(f"{where}: {key} must be an integer >= 1, got {record[key]!r}")


def _check_name(record: dict, key: str, where: str) -> None:
    if not (isinstance(record[key], str) and record[key]):
        raise WorkloadError(f"{where}: {key} must be a non-empty string, got {record[key]!r}")
