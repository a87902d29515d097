"""The ingress's forwarding, without a cluster: a scripted `DeploymentHandle` stands for the
replicas.  A full replica's refusal is offered to another replica, a bounded number of times,
a per-key limit's never; each key's limits hold at the ingress, fleet-wide; the replica call is
cancelled whenever the client leaves before the replica's last chunk; an answer a replica hands
off goes on from another replica in the same response, covered by its first admission."""

import asyncio
import json
from dataclasses import replace

from starlette.requests import Request

from tests_ray.fakes import engine_full_429, key_limit_429
from tokenflow.core.migration import StreamExport
from tokenflow.core.request import Consumption, SamplingParams
from tokenflow.replicas.guards import MAX_TRIES
from tokenflow.replicas.ingress import REPLICA_HEADER, Forwarder
from tokenflow.serving.config import ServerConfig
from tokenflow.serving.moves import MOVE_HEADER, StreamHandoff

BODY = b'{"prompt": "hi", "max_tokens": 4, "stream": true}'
KEY = "a-key"
FULL = engine_full_429()  # a replica's 429 when its engine is full


class _Stream:
    """One replica call's answer: its first item, then its chunks (`block`: not before
    `unblocked` is set)."""

    def __init__(self, status=200, replica="a", chunks=(), headers=(), block=False):
        start = {"status": status, "headers": list(headers), "replica": replica}
        self.items: list = [{**start, "replica_id": f"id-{replica}"}, *chunks]
        self.block = block
        self.waited = asyncio.Event()  # set once a read waits on a blocked stream
        self.unblocked = asyncio.Event()
        self.cancelled = False
        self.num_read = 0

    def __aiter__(self):
        return self

    async def __anext__(self):
        if self.block:
            self.waited.set()
            await self.unblocked.wait()
            self.block = False
        if isinstance(self.items[0] if self.items else None, Exception):
            raise self.items.pop(0)
        if not self.items:
            raise StopAsyncIteration
        self.num_read += 1
        return self.items.pop(0)

    def cancel(self):
        self.cancelled = True


class _Handle:
    """A DeploymentHandle whose calls (of `serve_http`, or of `resume_http` with a handoff)
    get the scripted streams in turn."""

    def __init__(self, *streams):
        self.streams = list(streams)
        self.routes: list[dict] = []
        self.headers: list[list[tuple[str, str]]] = []
        self.handoffs: list[StreamHandoff | None] = []

    def options(self, stream):
        assert stream
        return self

    @property
    def serve_http(self):
        return self

    @property
    def resume_http(self):
        return self

    def remote(self, route, method, path, headers, body, handoff=None):
        self.routes.append(route)
        self.headers.append(headers)
        self.handoffs.append(handoff)
        return self.streams.pop(0)


def _handoff(num_sent_tokens: int) -> StreamHandoff:
    """What a replica hands the ingress when its answer moves (the ingress only passes it on)."""
    state = StreamExport(
        request_id="cmpl-1",
        prompt_token_ids=(1, 2),
        output_token_ids=tuple(range(num_sent_tokens)),
        sampling_params=SamplingParams(max_tokens=4, temperature=0),
        eos_token_ids=(0,),
        consumption=Consumption.READER,
        arrival_s=-1.0,
        rate_tps=4.0,
        token_times_s=tuple(-0.1 for _ in range(num_sent_tokens)),
        last_consume_s=-0.1,
        num_preemptions=0,
    )
    return StreamHandoff(state, "cmpl-1", 1700000000, num_sent_tokens, num_sent_tokens, 1)


def _request(headers: tuple[tuple[bytes, bytes], ...] = (), body: bytes = BODY) -> Request:
    sent = False

    async def receive():
        nonlocal sent
        if sent:
            await asyncio.Event().wait()
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.4"},
        "method": "POST",
        "path": "/v1/completions",
        "query_string": b"",
        "headers": [(b"content-type", b"application/json"), *headers],
    }
    return Request(scope, receive)


async def _answer(
    handle: _Handle, request: Request | None = None, forwarder: Forwarder | None = None
):
    """The ingress's answer to one request: status, headers and body."""
    request = request or _request()
    forwarder = forwarder or Forwarder(handle, 4.0)
    return await _read(await forwarder.forward(request, "v1/completions"))


async def _read(response):
    """A response sent to a client that reads it to its end: status, headers and body."""
    messages: list[dict] = []

    async def send(message):
        messages.append(message)

    await response(_request().scope, _request().receive, send)
    start = messages[0]
    headers = {k.decode().lower(): v.decode() for k, v in start["headers"]}
    body = b"".join(m.get("body", b"") for m in messages[1:])
    return start["status"], headers, body


def test_a_429_is_offered_to_a_replica_that_has_not_refused_it():
    busy = _Stream(429, "a", [FULL], [("retry-after", "2")])
    free = _Stream(200, "b", [b"data: 1\n\n", b"data: [DONE]\n\n"])
    handle = _Handle(busy, free)
    status, headers, body = asyncio.run(_answer(handle))
    assert status == 200 and headers[REPLICA_HEADER.lower()] == "b"
    assert body == b"data: 1\n\ndata: [DONE]\n\n"
    assert handle.routes[0]["avoid"] == [] and handle.routes[1]["avoid"] == ["id-a"]
    assert busy.cancelled and not free.cancelled


def test_when_every_try_is_refused_the_last_429_passes_through_with_retry_after():
    refusals = [_Stream(429, r, [FULL[:10], FULL[10:]]) for r in ("a", "b", "a", "b")]
    handle = _Handle(*refusals)
    status, headers, body = asyncio.run(_answer(handle))
    assert status == 429 and headers["retry-after"] == "1"  # added where the replica gave none
    assert body == FULL  # (read to tell what it means, then passed on whole)
    assert len(handle.routes) == MAX_TRIES
    assert handle.routes[-1]["avoid"] == ["id-a", "id-b"]


def test_a_draining_replicas_503_is_offered_to_another():
    draining = _Stream(503, "a", [b"{}"], [("retry-after", "1")])
    handle = _Handle(draining, _Stream(200, "b", [b"ok"]))
    assert asyncio.run(_answer(handle))[0] == 200


def test_a_replica_that_fails_before_answering_is_tried_again():
    dead = _Stream(200, "a")
    dead.items = [RuntimeError("the actor died")]
    handle = _Handle(dead, _Stream(200, "b", [b"ok"]))
    status, headers, _ = asyncio.run(_answer(handle))
    assert status == 200 and headers[REPLICA_HEADER.lower()] == "b"


def test_the_replica_call_is_cancelled_when_the_client_leaves_mid_stream():
    stream = _Stream(200, "a", [b"data: %d\n\n" % i for i in range(100)])

    async def leave_after_two_chunks():
        response = await Forwarder(_Handle(stream), 4.0).forward(_request(), "v1/completions")
        num_sent = 0
        gone = asyncio.Event()

        async def send(message):
            nonlocal num_sent
            num_sent += 1
            if num_sent > 2:
                gone.set()
                await asyncio.Event().wait()  # the client stopped reading; then it left

        task = asyncio.ensure_future(response(_request().scope, _request().receive, send))
        await gone.wait()
        task.cancel()  # (what Serve does to the ingress's request when its client left)
        await asyncio.gather(task, return_exceptions=True)

    asyncio.run(leave_after_two_chunks())
    assert stream.cancelled and stream.num_read < 10


def test_the_replica_call_is_cancelled_when_the_client_leaves_before_it_answers():
    stream = _Stream(block=True)

    async def leave_at_once():
        task = asyncio.ensure_future(
            Forwarder(_Handle(stream), 4.0).forward(_request(), "v1/completions")
        )
        await asyncio.sleep(0.05)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    asyncio.run(leave_at_once())
    assert stream.cancelled


def test_a_stream_read_to_its_end_is_not_cancelled():
    stream = _Stream(200, "a", [b"data: [DONE]\n\n"])
    asyncio.run(_answer(_Handle(stream)))
    assert not stream.cancelled


# One answer's SSE frames: the replica that serves it whole sends them all; a replica that
# hands it off after two sends those two, and the replica that continues it the rest.
FRAMES = [b'data: {"id": "cmpl-1", "n": %d}\n\n' % i for i in range(4)] + [b"data: [DONE]\n\n"]


def _ticket(headers: list[tuple[str, str]]) -> list[str]:
    return [v for k, v in headers if k.lower() == MOVE_HEADER.lower()]


def test_an_answer_handed_off_mid_stream_reaches_the_client_whole_from_the_next_replica():
    unmoved = asyncio.run(_answer(_Handle(_Stream(200, "a", FRAMES))))
    handoff = _handoff(2)
    leaving = _Stream(200, "a", [*FRAMES[:2], handoff])
    taking = _Stream(200, "b", FRAMES[2:])
    handle = _Handle(leaving, taking)
    status, headers, body = asyncio.run(_answer(handle))
    assert (status, body) == (200, unmoved[2])  # every frame once, one [DONE]
    assert headers[REPLICA_HEADER.lower()] == "a"  # (the headers went out before the move)
    assert handle.handoffs == [None, handoff]  # the continuation is a `resume_http` call
    assert handle.routes[1]["avoid"] == ["id-a"]  # never offered back to the replica leaving
    assert _ticket(handle.headers[0]) == _ticket(handle.headers[1]) and _ticket(handle.headers[0])
    assert not leaving.cancelled and not taking.cancelled


def test_a_continuation_planned_for_a_replica_asks_the_router_for_it():
    planned = replace(_handoff(0), target_replica_id="id-b")  # a queued answer the board moved
    handle = _Handle(_Stream(200, "a", [planned]), _Stream(200, "b", FRAMES))
    forwarder = Forwarder(handle, 4.0)
    assert asyncio.run(_answer(handle, forwarder=forwarder))[2] == b"".join(FRAMES)
    assert "prefer" not in handle.routes[0]  # (a new request: the rule chooses)
    assert handle.routes[1]["prefer"] == "id-b" and handle.routes[1]["avoid"] == ["id-a"]
    assert json.loads(asyncio.run(forwarder.moves()).body) == {"b": 1}  # (GET /replicas/moves)


def test_an_answer_moves_again_when_its_next_replica_leaves_too():
    first, second = _handoff(1), _handoff(3)
    streams = [
        _Stream(200, "a", [FRAMES[0], first]),
        _Stream(200, "b", [*FRAMES[1:3], second]),
        _Stream(200, "c", FRAMES[3:]),
    ]
    handle = _Handle(*streams)
    assert asyncio.run(_answer(handle))[2] == b"".join(FRAMES)
    assert [r["avoid"] for r in handle.routes] == [[], ["id-a"], ["id-a", "id-b"]]
    assert handle.handoffs == [None, first, second]


def test_a_continuation_refused_by_one_replica_is_offered_to_another():
    refusing = _Stream(503, "b", [b"{}"], [("retry-after", "1")])
    handle = _Handle(
        _Stream(200, "a", [FRAMES[0], _handoff(1)]), refusing, _Stream(200, "c", FRAMES[1:])
    )
    assert asyncio.run(_answer(handle))[2] == b"".join(FRAMES)
    assert handle.routes[2]["avoid"] == ["id-a", "id-b"] and refusing.cancelled


def test_an_answer_no_replica_takes_ends_with_an_error_frame_and_one_done():
    refusals = [_Stream(503, r, [b"{}"]) for r in ("b", "c", "d")]
    handle = _Handle(_Stream(200, "a", [FRAMES[0], _handoff(1)]), *refusals)
    status, _, body = asyncio.run(_answer(handle))
    assert status == 200 and body.startswith(FRAMES[0])
    assert b'"error"' in body and body.count(b"[DONE]") == 1 and body.endswith(b"[DONE]\n\n")
    assert len(handle.routes) == 1 + MAX_TRIES


def test_the_ticket_is_the_ingress_own_never_the_clients():
    handle = _Handle(_Stream(200, "a", FRAMES))
    asyncio.run(_answer(handle, _request(((MOVE_HEADER.lower().encode(), b"forged"),))))
    tickets = _ticket(handle.headers[0])
    assert len(tickets) == 1 and tickets != ["forged"]


def test_the_continuation_is_cancelled_when_the_client_leaves_while_it_opens():
    taking = _Stream(block=True)  # the next replica has not answered yet
    handle = _Handle(_Stream(200, "a", [FRAMES[0], _handoff(1)]), taking)

    async def leave_during_the_move():
        response = await Forwarder(handle, 4.0).forward(_request(), "v1/completions")

        task = asyncio.ensure_future(response(_request().scope, _request().receive, _ignore))
        await taking.waited.wait()  # the relay waits for the continuation's first item
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    asyncio.run(leave_during_the_move())
    assert taking.cancelled and handle.handoffs[1] is not None


async def _ignore(message):
    """A client that reads whatever comes."""


# -- each key's limits, held at the ingress -----------------------------------------------------
OTHER_KEY = "another-key"


def _keyed(body: bytes = BODY, key: str = KEY, method: str = "POST") -> Request:
    """A request of `key`."""
    request = _request(((b"authorization", f"Bearer {key}".encode()),), body)
    request.scope["method"] = method
    return request


def _limited(handle: _Handle, **limits) -> Forwarder:
    """The ingress of a fleet whose `tokenflow serve` options set these per-key limits."""
    return Forwarder(handle, 4.0, ServerConfig(api_keys=(KEY, OTHER_KEY), **limits))


def _error(response) -> dict:
    return json.loads(response.body)["error"]


def test_a_per_key_429_from_a_replica_is_never_offered_to_another():
    limited = _Stream(429, "a", [asyncio.run(key_limit_429())], [("retry-after", "1")])
    handle = _Handle(limited, _Stream(200, "b", [b"ok"]))
    status, _, body = asyncio.run(_answer(handle))
    assert status == 429 and json.loads(body)["error"]["code"] == "rate_limit_exceeded"
    assert len(handle.routes) == 1  # the other replica never saw it


def test_a_key_at_its_limit_gets_429_from_the_ingress_and_no_replica_sees_it():
    handle = _Handle(*(_Stream(200, r, FRAMES) for r in ("a", "b", "a", "b")))
    forwarder = _limited(handle, max_requests_per_key=1)

    async def three_requests():
        first = await forwarder.forward(_keyed(), "v1/completions")  # (its answer is open)
        refused = await forwarder.forward(_keyed(), "v1/completions")
        other = await forwarder.forward(_keyed(key=OTHER_KEY), "v1/completions")
        models = await forwarder.forward(_keyed(b"", method="GET"), "v1/models")
        await _read(first)  # the first answer ends: its key has room again
        again = await forwarder.forward(_keyed(), "v1/completions")
        return refused, other, models, await _read(again)

    refused, other, models, again = asyncio.run(three_requests())
    assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
    assert _error(refused)["code"] == "rate_limit_exceeded"
    assert "1 completions in flight" in _error(refused)["message"]
    assert other.status_code == 200 and models.status_code == 200  # (not this key's work)
    assert again[0] == 200 and again[2] == b"".join(FRAMES)
    assert len(handle.routes) == 4  # first, other key, models, again: never the refused one


def test_every_choice_counts_against_the_keys_limit():
    handle = _Handle()
    forwarder = _limited(handle, max_requests_per_key=4)
    for body in (
        {"prompt": "hi", "n": 5},
        {"prompt": ["a", "b", "c"], "n": 2},
        {"prompt": [[1], [2], [3], [4], [5]]},
        {"messages": [{"role": "user", "content": "hi"}], "n": 128},
    ):
        request = _keyed(json.dumps(body).encode())
        response = asyncio.run(forwarder.forward(request, "v1/completions"))
        assert (
            response.status_code == 429 and "may have 4 completions" in _error(response)["message"]
        )
    assert handle.routes == []


def test_prompt_and_max_tokens_count_against_the_keys_token_limit():
    handle = _Handle(_Stream(200, "a", FRAMES))
    forwarder = _limited(handle, max_tokens_per_key=1000)
    # 2 choices of 101 prompt tokens (400 characters) + 500: 1202 tokens
    body = {"prompt": "x" * 400, "max_tokens": 500, "n": 2}
    response = asyncio.run(forwarder.forward(_keyed(json.dumps(body).encode()), "v1/completions"))
    assert response.status_code == 429 and "1000 tokens" in _error(response)["message"]
    no_max = json.dumps({"prompt": "hi"}).encode()  # 1 + reports.DEFAULT_MAX_TOKENS
    assert asyncio.run(_answer(handle, _keyed(no_max), forwarder))[0] == 200
    assert len(handle.routes) == 1


def test_the_keys_work_is_released_when_its_client_leaves_mid_stream():
    stream = _Stream(200, "a", [b"data: %d\n\n" % i for i in range(100)])
    handle = _Handle(stream, _Stream(200, "b", FRAMES))
    forwarder = _limited(handle, max_requests_per_key=1)

    async def leave_after_two_chunks_then_ask_again():
        response = await forwarder.forward(_keyed(), "v1/completions")
        num_sent = 0
        gone = asyncio.Event()

        async def send(message):
            nonlocal num_sent
            num_sent += 1
            if num_sent > 2:
                gone.set()
                await asyncio.Event().wait()

        task = asyncio.ensure_future(response(_request().scope, _request().receive, send))
        await gone.wait()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return await _answer(handle, _keyed(), forwarder)

    assert asyncio.run(leave_after_two_chunks_then_ask_again())[0] == 200
    assert stream.cancelled


def test_the_keys_work_is_released_when_its_client_leaves_before_a_replica_answers():
    handle = _Handle(_Stream(block=True), _Stream(200, "b", FRAMES))
    forwarder = _limited(handle, max_requests_per_key=1)

    async def leave_then_ask_again():
        task = asyncio.ensure_future(forwarder.forward(_keyed(), "v1/completions"))
        await handle.streams[0].waited.wait()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return await _answer(handle, _keyed(), forwarder)

    assert asyncio.run(leave_then_ask_again())[0] == 200


def test_the_keys_work_is_released_when_no_replica_takes_the_request():
    dead = [_Stream(200, r) for r in ("a", "b", "c")]
    for stream in dead:
        stream.items = [RuntimeError("the actor died")]
    full = [_Stream(429, r, [FULL]) for r in ("a", "b", "c")]
    handle = _Handle(*dead, *full, _Stream(200, "a", FRAMES))
    forwarder = _limited(handle, max_requests_per_key=1)
    assert asyncio.run(_answer(handle, _keyed(), forwarder))[0] == 503  # no replica answered
    assert asyncio.run(_answer(handle, _keyed(), forwarder))[0] == 429  # every replica full
    assert asyncio.run(_answer(handle, _keyed(), forwarder))[0] == 200


def test_a_moved_answer_goes_on_under_its_first_admission():
    handoff = _handoff(2)
    taking = _Stream(200, "b", FRAMES[2:], block=True)  # (it has not answered yet)
    handle = _Handle(_Stream(200, "a", [*FRAMES[:2], handoff]), taking)
    forwarder = _limited(handle, max_requests_per_key=1)

    async def ask_during_the_move():
        response = await forwarder.forward(_keyed(), "v1/completions")
        task = asyncio.ensure_future(response(_request().scope, _request().receive, _ignore))
        await taking.waited.wait()  # the answer is between its two replicas
        refused = await forwarder.forward(_keyed(), "v1/completions")
        taking.unblocked.set()
        await task
        return refused

    refused = asyncio.run(ask_during_the_move())
    assert refused.status_code == 429  # the moved answer still holds its key's one completion
    assert handle.handoffs == [None, handoff]  # its continuation was not admitted again
    assert not taking.items  # (it went on to its end)
