"""A stream exported from one serving engine mid-answer goes on in another (tiny model, CPU):
`AsyncEngine.export_streams` ends its deltas with `StreamMoved`, `resume` continues it with the
tokens of an undisturbed run; through two apps with a `MoveBook` (what each fleet replica
runs), the two halves of the answer are the undisturbed answer: same id and created, the text,
the usage, one role chunk and one [DONE]."""

from __future__ import annotations

import asyncio
import json
import threading
from dataclasses import dataclass

import httpx
import pytest

from tests.serving.live_server import serve_in_thread
from tokenflow.core.request import RequestState, SamplingParams, StructuredOutput
from tokenflow.engine.async_engine import AsyncEngine
from tokenflow.engine.client import StreamMoved
from tokenflow.engine.engine_args import EngineArgs
from tokenflow.serving.app import build_app
from tokenflow.serving.moves import MOVE_HEADER, MoveBook

NUM_BEFORE_MOVE = 9  # tokens the stream has on the first engine when it is exported
MAX_TOKENS = 32
PROMPT = "Once upon a time"
COMMON = {"max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True, "stream": True}
COMMON |= {"stream_rate": 4, "stream_options": {"include_usage": True}}
BODIES = {
    "/v1/completions": {"prompt": PROMPT, **COMMON},
    "/v1/chat/completions": {"messages": [{"role": "user", "content": PROMPT}], **COMMON},
}


@dataclass
class Server:
    engine: AsyncEngine
    book: MoveBook
    url: str


@pytest.fixture(scope="module")
def servers(tiny_model_dir):
    """Two servers, each its own engine and book of moves, as two replicas of a fleet."""
    engines = [
        AsyncEngine(EngineArgs(model=tiny_model_dir, device="cpu", max_model_len=256))
        for _ in range(2)
    ]
    books = [MoveBook(), MoveBook()]
    apps = [build_app(e, moves=b) for e, b in zip(engines, books, strict=True)]
    with serve_in_thread(apps[0]) as first, serve_in_thread(apps[1]) as second:
        yield [Server(engines[0], books[0], first), Server(engines[1], books[1], second)]
    for engine in engines:
        engine.close()


def hold_at(engine: AsyncEngine, num_tokens: int) -> tuple[threading.Event, threading.Event]:
    """(reached, release): once a stream has `num_tokens` tokens, the engine thread waits for
    `release` after that step, so whatever the test queues meanwhile is applied before the next
    step, however fast or slow the machine (the timeout only turns a hang into an error)."""
    reached, release = threading.Event(), threading.Event()

    def after_step() -> None:
        streams = engine.engine.streams(8).streams
        if not reached.is_set() and any(s.num_output_tokens >= num_tokens for s in streams):
            reached.set()
            if not release.wait(timeout=120):
                raise RuntimeError("the test never released the engine")

    engine.after_step = after_step
    return reached, release


def post(url: str, body: dict, ticket: str | None = None) -> list[str]:
    """The data of every SSE event of one streamed answer."""
    headers = {MOVE_HEADER: ticket} if ticket else {}
    with httpx.stream("POST", url, json=body, headers=headers, timeout=120) as response:
        assert response.status_code == 200, response.read()
        return [line[6:] for line in response.iter_lines() if line.startswith("data: ")]


def chunks(events: list[str]) -> list[dict]:
    return [json.loads(e) for e in events if e != "[DONE]"]


def text_of(events: list[str]) -> str:
    parts = []
    for chunk in chunks(events):
        for choice in chunk["choices"]:
            parts.append(choice.get("text") or choice.get("delta", {}).get("content") or "")
    return "".join(parts)


def roles(events: list[str]) -> list[str]:
    found = []
    for chunk in chunks(events):
        found += [c["delta"]["role"] for c in chunk["choices"] if c.get("delta", {}).get("role")]
    return found


def usages(events: list[str]) -> list[dict]:
    return [chunk["usage"] for chunk in chunks(events) if chunk.get("usage")]


@pytest.mark.parametrize("path", list(BODIES))
def test_an_answer_moved_mid_stream_is_the_undisturbed_answer(servers, path):
    source, target = servers
    undisturbed = post(target.url + path, BODIES[path])
    reached, release = hold_at(source.engine, NUM_BEFORE_MOVE)
    first: list[list[str]] = []
    reader = threading.Thread(
        target=lambda: first.append(post(source.url + path, BODIES[path], "ticket-1"))
    )
    reader.start()
    try:
        assert reached.wait(timeout=120), "the stream got no tokens"
        exported = source.engine.export_streams(source.book.movable_request_ids())
    finally:
        release.set()
        source.engine.after_step = None
    states = exported.result(timeout=60)
    reader.join(timeout=120)
    handoff = source.book.take_handoff("ticket-1")
    assert len(states) == 1 and handoff is not None and handoff.state == states[0]
    assert handoff.num_sent_tokens == len(states[0].output_token_ids) >= NUM_BEFORE_MOVE
    assert handoff.num_sent_tokens < MAX_TOKENS
    target.book.expect_resume("ticket-1", handoff)
    rest = post(target.url + path, BODIES[path], "ticket-1")

    assert "[DONE]" not in first[0] and rest.count("[DONE]") == 1 and rest[-1] == "[DONE]"
    assert {c["id"] for c in chunks(first[0] + rest)} == {handoff.response_id}
    assert {c["created"] for c in chunks(first[0] + rest)} == {handoff.created_s}
    assert text_of(first[0]) + text_of(rest) == text_of(undisturbed)
    assert usages(first[0]) == [] and usages(rest) == usages(undisturbed)
    assert roles(first[0] + rest) == roles(undisturbed)
    assert source.book.movable_request_ids() == [] == target.book.movable_request_ids()


def test_a_request_without_a_ticket_is_not_movable(servers):
    source = servers[0]
    reached, release = hold_at(source.engine, 2)
    reader = threading.Thread(
        target=post, args=(source.url + "/v1/completions", BODIES["/v1/completions"])
    )
    reader.start()
    try:
        assert reached.wait(timeout=120)
        assert source.book.movable_request_ids() == []  # (no ticket: it finishes here)
    finally:
        release.set()
        source.engine.after_step = None
    reader.join(timeout=120)


def _tokens(deltas) -> list[int]:
    return [t for d in deltas for t in d.token_ids]


def test_export_ends_the_deltas_with_stream_moved_and_resume_goes_on_exactly(servers):
    source, target = servers
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    prompt = source.engine.tokenizer.encode(PROMPT)

    async def run(engine: AsyncEngine, request_id: str) -> list:
        return [d async for d in engine.generate(request_id, prompt, params, 4.0)]

    undisturbed = asyncio.run(run(target.engine, "whole"))
    reached, release = hold_at(source.engine, NUM_BEFORE_MOVE)

    async def moved() -> tuple[list, StreamMoved]:
        deltas = []
        try:
            async for delta in source.engine.generate("moved", prompt, params, 4.0):
                deltas.append(delta)
        except StreamMoved as err:
            return deltas, err
        raise AssertionError("the stream was not moved")

    result: list = []
    runner = threading.Thread(target=lambda: result.append(asyncio.run(moved())))
    runner.start()
    try:
        assert reached.wait(timeout=120)
        exported = source.engine.export_streams(["moved", "unknown"])
    finally:
        release.set()
        source.engine.after_step = None
    runner.join(timeout=120)
    before, err = result[0]
    assert exported.result(timeout=60) == [err.state]
    assert _tokens(before) == list(err.state.output_token_ids)
    assert source.engine.stats().num_running == 0  # the source forgot it

    async def resumed() -> list:
        return [d async for d in target.engine.resume(err.state)]

    after = asyncio.run(resumed())
    assert after[-1].finish_reason == "length" and after[-1].num_output_tokens == MAX_TOKENS
    assert _tokens(before) + _tokens(after) == _tokens(undisturbed)
    assert "".join(d.text for d in before + after) == "".join(d.text for d in undisturbed)


def test_between_steps_reads_the_engine_on_its_thread_and_hands_back_what_it_raised(servers):
    engine = servers[1].engine
    read = engine.between_steps(lambda llm: (threading.current_thread().name, llm.has_work))
    assert read.result(timeout=60) == ("tokenflow-engine", False)  # (while it idles)
    failed = engine.between_steps(lambda llm: llm.scheduler.requests["unknown"])
    with pytest.raises(KeyError):
        failed.result(timeout=60)
    assert engine.health().is_alive  # the loop went on


def test_a_stream_held_to_a_grammar_moves_with_its_grammar(servers):
    source, target = servers
    schema = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
    spec = StructuredOutput(json.dumps(schema))
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, structured_output=spec)
    prompt = source.engine.tokenizer.encode("The user's profile as JSON")
    reached, release = hold_at(source.engine, 2)
    before: list = []
    moved: list[StreamMoved] = []

    async def run() -> None:
        try:
            async for delta in source.engine.generate("held", prompt, params, 4.0):
                before.append(delta)
        except StreamMoved as err:
            moved.append(err)

    runner = threading.Thread(target=lambda: asyncio.run(run()))
    runner.start()
    try:
        assert reached.wait(timeout=120)
        exported = source.engine.export_streams(["held"])
    finally:
        release.set()
        source.engine.after_step = None
    (state,) = exported.result(timeout=60)
    runner.join(timeout=120)
    assert moved and state.sampling_params.structured_output == spec and state.is_started

    async def resumed() -> list:
        return [d async for d in target.engine.resume(state)]

    after = asyncio.run(resumed())
    text = "".join(d.text for d in [*before, *after])
    assert after[-1].finish_reason in ("stop", "length")
    if after[-1].finish_reason == "stop":  # the grammar held across the move: the schema's JSON
        assert set(json.loads(text)) == {"name"}
    else:
        assert text.startswith('{"name": "')


def _never_started(request) -> bool:
    return request.state is RequestState.WAITING


def test_a_request_still_queued_moves_and_starts_on_the_other_engine(servers, tiny_model_dir):
    target = servers[1]
    args = EngineArgs(
        model=tiny_model_dir, device="cpu", max_model_len=256, max_num_seqs=1, policy="fcfs"
    )
    source = AsyncEngine(args)  # one stream at a time, never preempted: the second one queues
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    prompt = source.tokenizer.encode(PROMPT)
    reached, release = threading.Event(), threading.Event()

    def after_step() -> None:  # hold the engine once "queued" waits behind "first"
        if reached.is_set():
            return
        states = {s.request_id: s.state for s in source.engine.streams(8).streams}
        if states.get("queued") == "waiting" and states.get("first") == "running":
            reached.set()
            release.wait(timeout=120)

    source.after_step = after_step
    outcomes: dict[str, object] = {}

    async def run(request_id: str) -> None:
        try:
            outcomes[request_id] = [
                d async for d in source.generate(request_id, prompt, params, 4.0)
            ]
        except StreamMoved as err:
            outcomes[request_id] = err

    async def both() -> None:
        await asyncio.gather(run("first"), run("queued"))

    runner = threading.Thread(target=lambda: asyncio.run(both()))
    runner.start()
    try:
        assert reached.wait(timeout=120)
        exported = source.export_streams(["first", "queued"], only_if=_never_started)
    finally:
        release.set()
    (state,) = exported.result(timeout=60)
    runner.join(timeout=120)
    source.close()
    assert state.request_id == "queued" and not state.is_started
    assert isinstance(outcomes["queued"], StreamMoved)
    assert outcomes["first"][-1].finish_reason == "length"  # (started: it stayed)

    async def resumed() -> list:
        return [d async for d in target.engine.resume(state)]

    after = asyncio.run(resumed())
    assert _tokens(after) == _tokens(outcomes["first"])  # the same prompt, greedy: the same answer


def test_an_answer_still_queued_moves_whole_to_the_other_server(servers, tiny_model_dir):
    """Through two apps: a queued answer is listed as movable once its response opened; its
    body ends with no event at all, and the other server sends the whole answer, opening
    chunk included."""
    target, path = servers[1], "/v1/chat/completions"
    body = {**BODIES[path], "max_tokens": 160}  # (long: the other is listed while one runs)
    undisturbed = post(target.url + path, body)
    args = EngineArgs(
        model=tiny_model_dir, device="cpu", max_model_len=256, max_num_seqs=1, policy="fcfs"
    )
    engine, book = AsyncEngine(args), MoveBook()  # one stream at a time: the second one queues
    reached, release = threading.Event(), threading.Event()

    def after_step() -> None:  # hold the engine once a listed answer waits behind the other
        if reached.is_set():
            return
        states = {s.request_id: s.state for s in engine.engine.streams(8).streams}
        listed = sorted(str(states.get(i)) for i in book.movable_request_ids())
        if listed == ["running", "waiting"]:
            reached.set()
            release.wait(timeout=120)

    engine.after_step = after_step
    bodies: dict[str, list[str]] = {}
    with serve_in_thread(build_app(engine, moves=book)) as url:

        def read(ticket: str) -> None:
            bodies[ticket] = post(url + path, body, ticket)

        readers = [threading.Thread(target=read, args=(t,)) for t in ("ticket-a", "ticket-b")]
        for reader in readers:
            reader.start()
        try:
            assert reached.wait(timeout=120), "no answer queued behind the other"
            exported = engine.export_streams(book.movable_request_ids(), only_if=_never_started)
        finally:
            release.set()
        (state,) = exported.result(timeout=60)
        for reader in readers:
            reader.join(timeout=120)
    engine.close()
    handoffs = {t: book.take_handoff(t) for t in ("ticket-a", "ticket-b")}
    (ticket,) = [t for t, h in handoffs.items() if h is not None]
    handoff = handoffs[ticket]
    assert handoff.state == state and not state.is_started
    assert (handoff.num_sent_tokens, handoff.num_sent_chars, handoff.num_sent_deltas) == (0, 0, 0)
    assert bodies[ticket] == []  # (not even the role chunk: the continuation sends it)
    target.book.expect_resume(ticket, handoff)
    rest = post(target.url + path, body, ticket)
    assert text_of(rest) == text_of(undisturbed) and roles(rest) == ["assistant"]
    assert usages(rest) == usages(undisturbed) and rest.count("[DONE]") == 1
    assert {c["id"] for c in chunks(rest)} == {handoff.response_id}
