"""Which answers may move, what a handoff says, and the book a replica keeps of its moves
(tokenflow/serving/moves.py), on hand-built requests; and which answers in flight an app with
a book lists as movable (a fake engine held mid-answer)."""

from __future__ import annotations

import json
import threading
from dataclasses import replace

import httpx
import pytest

from tests.serving.fake_engine import FakeEngine
from tests.serving.live_server import serve_in_thread
from tests.serving.test_tool_choice import ASK, AUTO, WEATHER, WORDS, ToolsTokenizer
from tokenflow.core.migration import StreamExport
from tokenflow.core.request import Consumption, SamplingParams, StructuredOutput
from tokenflow.serving.app import build_app
from tokenflow.serving.moves import (
    MOVE_HEADER,
    MoveBook,
    StreamHandoff,
    handoff_of,
    is_movable,
    resumed_progress,
    resumed_request,
)
from tokenflow.serving.prepared import PreparedChoice, PreparedRequest, Progress

PARAMS = SamplingParams(max_tokens=8, temperature=0)


def _choice(index: int, params: SamplingParams = PARAMS) -> PreparedChoice:
    return PreparedChoice(index, f"cmpl-a-{index}", (1, 2, 3), "", params, index == 0)


def _request(num_choices: int = 1, stream: bool = True, **choice) -> PreparedRequest:
    return PreparedRequest(
        request_id="cmpl-a",
        model="m",
        created_s=1700000000,
        received_s=5.0,
        choices=tuple(_choice(i, **choice) for i in range(num_choices)),
        rate_tps=4.0,
        consumption=Consumption.READER,
        stream=stream,
        include_usage=True,
        continuous_usage=False,
    )


def _state(request_id: str, num_tokens: int) -> StreamExport:
    return StreamExport(
        request_id=request_id,
        prompt_token_ids=(1, 2, 3),
        output_token_ids=tuple(range(num_tokens)),
        sampling_params=PARAMS,
        eos_token_ids=(0,),
        consumption=Consumption.READER,
        arrival_s=-2.0,
        rate_tps=4.0,
        token_times_s=tuple(-1.0 for _ in range(num_tokens)),
        last_consume_s=-1.0,
        num_preemptions=0,
    )


def test_only_a_streamed_answer_with_one_choice_moves():
    grammar = replace(PARAMS, structured_output=StructuredOutput(json.dumps({"type": "object"})))
    assert is_movable(_request())
    assert not is_movable(_request(stream=False))  # the whole body is sent at the end
    assert not is_movable(_request(num_choices=2))  # n > 1: several engine requests
    assert is_movable(_request(params=grammar))  # the target rebuilds its matcher's state


def test_a_handoff_carries_what_the_client_holds_and_the_continuation_starts_there():
    prepared = _request()
    progress = Progress(num_output_tokens=5, num_deltas=3, num_sent_chars=21)
    handoff = handoff_of(prepared, progress, _state("cmpl-a-0", 5))
    assert (handoff.response_id, handoff.created_s) == ("cmpl-a", 1700000000)
    assert (handoff.num_sent_tokens, handoff.num_sent_chars, handoff.num_sent_deltas) == (5, 21, 3)

    fresh = replace(_request(), request_id="cmpl-b", created_s=1700000099)
    resumed = resumed_request(fresh, handoff)
    assert (resumed.request_id, resumed.created_s) == ("cmpl-a", 1700000000)
    assert resumed.choices[0].engine_request_id == "cmpl-a-0"  # (an unseeded stream's draws)
    after = resumed_progress(handoff, now_s=9.0)
    assert (after.num_output_tokens, after.num_deltas, after.num_sent_chars) == (5, 3, 21)
    assert after.last_delta_s == 9.0  # no second TTFT
    assert resumed_progress(replace(handoff, num_sent_tokens=0), 9.0).last_delta_s is None


def test_the_book_lists_movable_answers_and_hands_each_handoff_out_once():
    book = MoveBook()
    book.register("t2", "r2")
    book.register("t1", "r1")
    assert book.movable_request_ids() == ["r1", "r2"]  # in ticket order
    handoff = StreamHandoff(_state("r1", 2), "cmpl-1", 1, 2, 7, 2)
    book.handed_off("t1", handoff)
    book.forget("t1")  # (the answer's stream ends after its handoff: the handoff stays)
    assert book.movable_request_ids() == ["r2"]
    assert book.take_handoff("t1") == handoff and book.take_handoff("t1") is None
    assert book.take_handoff("t2") is None  # it did not move
    book.expect_resume("t3", handoff)
    assert book.take_resume("t3") == handoff and book.take_resume("t3") is None


CHAT = {"model": "fake-model", "messages": ASK, "max_tokens": 16, "stream": True}


@pytest.mark.parametrize(
    ("body", "ticket", "is_listed"),
    [
        (CHAT, "t", True),
        (CHAT, None, False),  # not through the fleet's ingress
        ({**CHAT, "n": 2}, "t", False),  # two engine requests
        ({**CHAT, "tools": [WEATHER], "tool_choice": "auto"}, "t", False),  # its parser's state
        ({**CHAT, "tools": [WEATHER], "tool_choice": "required"}, "t", False),  # ... the call's
        ({**CHAT, "response_format": {"type": "json_object"}}, "t", True),  # a grammar moves
    ],
    ids=["plain", "no-ticket", "n2", "auto-tools", "forced-tool", "json-object"],
)
def test_the_app_lists_only_movable_answers_while_they_stream(body, ticket, is_listed):
    gate = threading.Event()
    engine = FakeEngine(words=WORDS, tokenizer=ToolsTokenizer(), gate=gate, gate_at_token=2)
    book = MoveBook()
    headers = {MOVE_HEADER: ticket} if ticket else {}
    with serve_in_thread(build_app(engine, AUTO, moves=book)) as url:
        url += "/v1/chat/completions"
        with httpx.stream("POST", url, json=body, headers=headers, timeout=60) as response:
            lines = response.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))  # (mid-answer)
            listed = book.movable_request_ids()
            gate.set()
            assert [line for line in lines if line.startswith("data: ")][-1] == "data: [DONE]"
    assert bool(listed) is is_listed
    assert book.movable_request_ids() == []  # forgotten once the answer ended
