"""The Hermes tool-call parser on its own: content and calls out of the text however it is cut
into pieces, blocks that are not calls kept as the model wrote them."""

from __future__ import annotations

import json
from itertools import count

from hypothesis import given
from hypothesis import strategies as st

from tokenflow.serving.tool_calls import HermesToolCalls

CALL = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
OFFERED = ("get_weather", "now")  # the request's tools
TEXT = f'Let me check.\n<tool_call>\n{CALL}\n</tool_call>\n<tool_call>{{"name": "now"}}</tool_call>'


def _parse(
    pieces: list[str], finish_reason: str = "stop", offered: tuple[str, ...] = OFFERED
) -> tuple[str, list, HermesToolCalls]:
    ids = count()
    parser = HermesToolCalls(lambda: f"call_{next(ids)}", offered)
    content, deltas = "", []
    for i, piece in enumerate(pieces):
        parsed = parser.feed(piece, finish_reason if i == len(pieces) - 1 else None)
        content += parsed.content
        deltas += parsed.tool_calls
    return content, deltas, parser


def test_calls_and_content_of_a_whole_answer():
    content, deltas, parser = _parse([TEXT])
    assert content == "Let me check.\n\n"
    assert [(d.index, d.id, d.function.name) for d in deltas] == [
        (0, "call_0", "get_weather"),
        (1, "call_1", "now"),
    ]
    assert json.loads(deltas[0].function.arguments) == {"city": "Paris", "unit": "celsius"}
    assert deltas[1].function.arguments == "{}"  # a call without arguments
    assert [(c.id, c.function.name, c.function.arguments) for c in parser.calls] == [
        (d.id, d.function.name, d.function.arguments) for d in deltas
    ]
    assert parser.finish_reason("stop") == "tool_calls"
    assert parser.finish_reason("length") == "length"


@given(st.lists(st.integers(min_value=0, max_value=len(TEXT)), max_size=12))
def test_the_same_content_and_calls_however_the_text_is_cut(cuts):
    bounds = [0, *sorted(cuts), len(TEXT)]
    pieces = [TEXT[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
    assert _parse(pieces)[:2] == _parse([TEXT])[:2]


def test_no_part_of_an_opening_tag_is_sent_as_content():
    ids = count()
    parser = HermesToolCalls(lambda: f"call_{next(ids)}", OFFERED)
    assert parser.feed("Sure <tool_", None).content == "Sure "
    parsed = parser.feed(f"call>{CALL}</tool_call>", "stop")
    assert parsed.content == "" and parsed.tool_calls[0].function.name == "get_weather"
    assert parser.feed("", None).content == ""


def test_a_tag_like_tail_that_is_not_a_tag_is_content_at_the_finish():
    content, deltas, parser = _parse(["a < b and <tool"])
    assert content == "a < b and <tool" and not deltas
    assert parser.finish_reason("stop") == "stop"


def test_a_block_that_is_no_call_stays_as_written():
    text = "x <tool_call>not json</tool_call> y <tool_call>[1]</tool_call>"
    content, deltas, _ = _parse([text])
    assert content == text and not deltas


def test_a_block_cut_off_by_the_finish_is_content():
    content, deltas, parser = _parse(['ok <tool_call>{"name": "get_'], "length")
    assert content == 'ok <tool_call>{"name": "get_' and not deltas and not parser.calls


def test_a_call_of_a_function_not_offered_stays_as_written():
    content, deltas, parser = _parse([TEXT], offered=("now",))
    assert content == f"Let me check.\n<tool_call>\n{CALL}\n</tool_call>\n"
    assert [(d.index, d.id, d.function.name) for d in deltas] == [(0, "call_0", "now")]
    content, deltas, parser = _parse([TEXT], offered=())
    assert content == TEXT and not deltas and not parser.calls
    assert parser.finish_reason("stop") == "stop"
    unhashable = '<tool_call>{"name": ["now"]}</tool_call>'
    assert _parse([unhashable])[0] == unhashable
