"""Conversation workloads: the prompt builder's token identity, determinism, generation."""

from __future__ import annotations

from dataclasses import replace

import pytest

from tokenflow.eval.conversation import (
    FIRST_TEXT_TOKEN_ID,
    NUM_TEXT_TOKEN_IDS,
    ConversationSpec,
    Segment,
    first_turn_segments,
    next_turn_segments,
    nominal_read_s,
    prompt_token_ids,
    segment_token_ids,
)
from tokenflow.eval.workload import (
    LengthDist,
    RateMix,
    WorkloadError,
    WorkloadRequest,
    WorkloadSpec,
    generate,
)


def chat_spec(**overrides: object) -> WorkloadSpec:
    """A small conversation workload; `overrides` of WorkloadSpec or ConversationSpec fields."""
    workload: dict = dict(
        kind="conversation",
        request_rate=0.5,
        output=LengthDist(40, 10, minimum=4),
        rates=RateMix.parse("15:0.4,20:0.6"),
        seed=3,
    )
    sessions: dict = dict(
        num_sessions=12,
        min_turns=2,
        max_turns=4,
        num_apps=3,
        system_prompt=LengthDist(64, 8, minimum=16),
        user_message=LengthDist(20, 5, minimum=4),
        think_mean_s=5.0,
    )
    for name, value in overrides.items():
        (workload if name in WorkloadSpec.__dataclass_fields__ else sessions)[name] = value
    return WorkloadSpec(**workload, conversation=ConversationSpec(**sessions))


def first_difference(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    return next(
        (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )


# -- token identity -----------------------------------------------------------------------------
def test_equal_segments_have_equal_ids_and_other_names_other_ids() -> None:
    segment = Segment("user", "s0-1/0", 50)
    ids = segment_token_ids(segment)
    assert ids == segment_token_ids(Segment("user", "s0-1/0", 50)) and len(ids) == 50
    assert all(FIRST_TEXT_TOKEN_ID <= i < FIRST_TEXT_TOKEN_ID + NUM_TEXT_TOKEN_IDS for i in ids)
    assert ids != segment_token_ids(Segment("user", "s0-2/0", 50))
    assert ids != segment_token_ids(Segment("assistant", "s0-1/0", 50))  # (role counts too)


def test_sessions_of_one_app_share_exactly_the_system_prompt() -> None:
    first = prompt_token_ids(first_turn_segments("app0-0", 48, "s0-0", 10))
    second = prompt_token_ids(first_turn_segments("app0-0", 48, "s0-1", 10))
    other_app = prompt_token_ids(first_turn_segments("app0-1", 48, "s0-2", 10))
    assert first_difference(first, second) == 48
    assert first_difference(first, other_app) == 0


def test_a_next_turn_begins_with_the_previous_prompt_and_its_answer() -> None:
    turn_0 = first_turn_segments("app0-0", 32, "s0-0", 8)
    turn_1 = next_turn_segments(turn_0, 12, 9)
    assert [(s.role, s.name) for s in turn_1[2:]] == [("assistant", "s0-0/0"), ("user", "s0-0/1")]
    prompt_0 = prompt_token_ids(turn_0)
    drawn_answer = segment_token_ids(Segment("assistant", "s0-0/0", 12))
    assert prompt_token_ids(turn_1)[: len(prompt_0) + 12] == prompt_0 + drawn_answer
    # The answer as served, when given, stands for the drawn one.
    served = (7,) * 12
    with_served = prompt_token_ids(turn_1, {"s0-0/0": served})
    assert with_served[: len(prompt_0) + 12] == prompt_0 + served
    assert len(with_served) == 32 + 8 + 12 + 9


# -- generation ---------------------------------------------------------------------------------
def test_same_seed_same_workload_and_token_ids_other_seed_other() -> None:
    requests = generate(chat_spec())
    assert requests == generate(chat_spec())
    ids = [prompt_token_ids(r.segments) for r in requests]
    assert ids == [prompt_token_ids(r.segments) for r in generate(chat_spec())]
    other = generate(chat_spec(seed=4))
    assert [prompt_token_ids(r.segments) for r in other] != ids


def test_sessions_are_chains_of_turns_each_sent_after_the_last_is_read() -> None:
    spec = chat_spec()
    requests = generate(spec)
    by_id = {r.request_id: r for r in requests}
    assert [r.request_id for r in requests] == [f"req-{i}" for i in range(len(requests))]
    sessions: dict[str, list[WorkloadRequest]] = {}
    for request in requests:
        sessions.setdefault(str(request.session_id), []).append(request)
    assert len(sessions) == spec.conversation.num_sessions
    for turns in sessions.values():
        assert 2 <= len(turns) <= 4 and [t.turn for t in turns] == list(range(len(turns)))
        assert len({(t.app_id, t.rate_tps, t.consumption) for t in turns}) == 1
        assert turns[0].after_id is None and turns[0].think_s == 0.0
        for previous, turn in zip(turns, turns[1:], strict=False):
            assert by_id[str(turn.after_id)] is previous and turn.think_s > 0
            assert turn.segments[: len(previous.segments)] == previous.segments
            assert turn.segments[len(previous.segments)] == Segment(
                "assistant", f"{turn.session_id}/{previous.turn}", previous.num_output_tokens
            )
            read_s = nominal_read_s(previous.num_output_tokens, previous.rate_tps, "reader")
            assert turn.arrival_s == pytest.approx(previous.arrival_s + read_s + turn.think_s)
    assert {r.app_id for r in requests} <= {"app3-0", "app3-1", "app3-2"}


def test_apps_are_drawn_with_zipf_weights_and_uniform_at_zero() -> None:
    def app_counts(zipf_s: float) -> list[int]:
        spec = chat_spec(num_sessions=600, min_turns=1, max_turns=1, app_zipf_s=zipf_s)
        apps = [r.app_id for r in generate(spec)]
        return [apps.count(f"app3-{a}") for a in range(3)]

    zipf = app_counts(1.0)  # weights 1, 1/2, 1/3: shares 6/11, 3/11, 2/11
    assert zipf[0] > zipf[1] > zipf[2] and abs(zipf[0] / 600 - 6 / 11) < 0.06
    assert max(app_counts(0.0)) - min(app_counts(0.0)) < 60


def test_burst_sessions_all_start_at_zero() -> None:
    requests = generate(chat_spec(session_arrivals="burst"))
    assert all(r.arrival_s == 0.0 for r in requests if r.turn == 0)


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"num_sessions": 0}, "num_sessions"),
        ({"min_turns": 0}, "min_turns"),
        ({"min_turns": 3, "max_turns": 2}, "max_turns"),
        ({"num_apps": 1.5}, "num_apps"),
        ({"think_mean_s": -1.0}, "think_mean_s"),
        ({"app_zipf_s": float("nan")}, "app_zipf_s"),
        ({"session_arrivals": "gamma"}, "session_arrivals"),
        ({"user_message": 20}, "user_message"),
    ],
)
def test_spec_validation(overrides: dict, match: str) -> None:
    with pytest.raises(WorkloadError, match=match):
        chat_spec(**overrides)


def test_request_validation_of_turns() -> None:
    turn = generate(chat_spec())[0]
    with pytest.raises(WorkloadError, match="give its session_id"):
        WorkloadRequest("x", 0.0, 4, 4, 20.0, turn=1)
    with pytest.raises(WorkloadError, match="turn 0 has no after_id"):
        replace(turn, after_id="req-9")
    with pytest.raises(WorkloadError, match="differs from its segments"):
        replace(turn, num_prompt_tokens=turn.num_prompt_tokens + 1)
    with pytest.raises(WorkloadError, match="begin with app_id's system prompt"):
        replace(turn, app_id="other")
