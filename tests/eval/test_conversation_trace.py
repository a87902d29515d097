"""Trace files with conversations: they round-trip, and a turn that does not follow its
session's previous turn is refused with a one-line message naming file:line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.eval.test_conversation import chat_spec
from tokenflow.eval.workload import (
    LengthDist,
    WorkloadError,
    WorkloadSpec,
    generate,
    load_trace,
    save_trace,
)


def test_a_conversation_trace_round_trips(tmp_path: Path) -> None:
    requests = generate(chat_spec())
    path = tmp_path / "chat.jsonl"
    save_trace(path, requests)
    assert load_trace(path, default_rate_tps=1.0) == requests
    assert generate(WorkloadSpec(kind="trace", trace_path=str(path))) == requests
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert all("request_id" in line and "session_id" in line for line in lines)
    assert {"after_id", "think_s"} <= set(next(line for line in lines if line["turn"] == 1))


def test_an_open_loop_trace_has_no_request_ids(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    save_trace(path, generate(WorkloadSpec(kind="burst", num_requests=3, prompt=LengthDist(8, 0))))
    assert set(json.loads(path.read_text().splitlines()[0])) == {
        "arrival_s", "prompt_tokens", "output_tokens", "rate_tps", "stream_class"
    }  # fmt: skip


# A two-turn session: system 10 + user 4 = 14; then + answer 6 + user 5 = 25.
TURN_0 = {
    "request_id": "a",
    "arrival_s": 0,
    "prompt_tokens": 14,
    "output_tokens": 6,
    "session_id": "s",
    "turn": 0,
    "app_id": "app",
    "system_tokens": 10,
    "user_tokens": 4,
}
TURN_1 = {"request_id": "b", "arrival_s": 5, "prompt_tokens": 25, "output_tokens": 3,
          "session_id": "s", "turn": 1, "app_id": "app", "system_tokens": 10, "user_tokens": 5,
          "after_id": "a", "think_s": 2.5}  # fmt: skip


def write(tmp_path: Path, *records: dict) -> Path:
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return path


def test_a_hand_written_session_loads_with_its_prompt_segments(tmp_path: Path) -> None:
    first, second = load_trace(write(tmp_path, TURN_1, TURN_0), default_rate_tps=4.0)
    assert (first.request_id, second.request_id, second.after_id) == ("a", "b", "a")
    assert [(s.role, s.name, s.num_tokens) for s in second.segments] == [
        ("system", "app", 10), ("user", "s/0", 4), ("assistant", "s/0", 6), ("user", "s/1", 5)
    ]  # fmt: skip
    assert second.think_s == 2.5 and first.think_s == 0.0


def without(record: dict, *keys: str) -> dict:
    return {k: v for k, v in record.items() if k not in keys}


@pytest.mark.parametrize(
    ("records", "line", "match"),
    [
        ((TURN_0, TURN_1 | {"after_id": "zz"}), 2, "after_id 'zz' names no request arriving"),
        ((TURN_0 | {"arrival_s": 9}, TURN_1), 2, "after_id 'a' names no request arriving"),
        ((TURN_0, TURN_1 | {"session_id": "t"}), 2, "must be turn 0 of session 't'"),
        ((TURN_0, TURN_1 | {"turn": 2}), 2, "must be turn 1 of session 's', not turn 0"),
        ((TURN_0, without(TURN_1, "after_id")), 2, "a later turn needs one"),
        ((TURN_0 | {"after_id": "b"}, TURN_1), 1, "turn 0 takes no after_id"),
        ((TURN_0, without(TURN_1, "app_id")), 2, r"needs \['app_id'\] too"),
        ((TURN_0, TURN_1 | {"prompt_tokens": 24}), 2, "prompt_tokens must be .* = 25, got 24"),
        ((TURN_0, TURN_1 | {"system_tokens": 11}), 2, "keeps its app_id and system_tokens"),
        ((TURN_0, without(TURN_1, "request_id")), 2, "request_id on every line or on none"),
        ((without(TURN_0, "request_id"), without(TURN_1, "request_id")), 2, "give one on every"),
        ((TURN_0, TURN_1 | {"request_id": "a"}), 2, "request_id 'a' is given twice"),
        ((TURN_0, TURN_1, TURN_1 | {"request_id": "c"}), 3, "turn 's/1' .* is given twice"),
        ((TURN_0, TURN_1 | {"think_s": -1}), 2, "think_s must be a finite number >= 0"),
        ((TURN_0 | {"turn": -1}), 1, "turn must be an integer >= 0"),
        ((TURN_0 | {"session_id": ""},), 1, "session_id must be a non-empty string"),
        ((TURN_0 | {"user_tokens": 0},), 1, "user_tokens must be an integer >= 1"),
    ],
)
def test_an_invalid_session_names_its_line(
    tmp_path: Path, records: tuple[dict, ...] | dict, line: int, match: str
) -> None:
    records = records if isinstance(records, tuple) else (records,)
    path = write(tmp_path, *records)
    with pytest.raises(WorkloadError, match=match) as caught:
        load_trace(path, default_rate_tps=4.0)
    message = str(caught.value)
    assert message.startswith(f"{path}:{line}: ") and "\n" not in message
