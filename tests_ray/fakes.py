"""Engine replicas without an engine, for tests of the ingress on a live Serve cluster.

A `FakeReplica` is an `EngineReplica` (the same `serve_http`, through `stream_asgi`) whose app
answers POST /v1/completions by the request's headers, and tells a `Recorder` actor what it was
asked and which of its streams ended early (cancelled).  A module apart from the tests, so Ray's
workers import it by name.
"""

import asyncio

import ray
from ray import serve
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from tokenflow.engine.client import EngineOverloaded
from tokenflow.replicas.deployments import EngineReplica
from tokenflow.serving.moves import MoveBook
from tokenflow.serving.responder import _refusal
from tokenflow.serving.tenants import KeyGate, KeyLimits, Work
from tokenflow.serving.validation import ApiError

RECORDER = "tokenflow-test-recorder"
NAMESPACE = "tokenflow-tests"
# busy-first: the first replica answers 429 (its engine full); busy-all: every replica does;
# key-limited: a 429 of a per-key limit
FAKE = "x-fake"
CHUNKS = "x-fake-chunks"  # how many SSE frames a stream sends, 50 ms apart
STREAM_ID = "x-fake-id"


@ray.remote(num_cpus=0)
class Recorder:
    """What the fake replicas were asked."""

    def __init__(self) -> None:
        self._names: list[str] = []
        self._calls: list[int] = []
        self._cancelled: list[str] = []

    async def register(self, name: str) -> int:
        """The replica's index: its place in the order the replicas started."""
        self._names.append(name)
        return len(self._names) - 1

    async def called(self, index: int) -> None:
        self._calls.append(index)

    async def cancelled(self, stream_id: str) -> None:
        self._cancelled.append(stream_id)

    async def state(self) -> dict:
        return {"names": self._names, "calls": self._calls, "cancelled": self._cancelled}

    async def reset(self) -> None:
        self._calls.clear()
        self._cancelled.clear()


def engine_full_429() -> bytes:
    """A replica's 429 body when its engine is full, as the server makes it."""
    error = _refusal(EngineOverloaded("the waiting queue is full", 1.0))
    return error.body().model_dump_json().encode()


async def key_limit_429() -> bytes:
    """A 429 body of a key over its limit, as the server's gate makes it."""
    try:
        await KeyGate(KeyLimits(max_choices=1)).admit("a-key", Work(2, 10))
    except ApiError as error:
        return error.body().model_dump_json().encode()
    raise AssertionError("the gate admitted more than the key's limit")


class FakeReplica(EngineReplica):
    """An engine replica that answers from its request's headers (see the module docstring)."""

    def __init__(
        self, serve_argv: list[str], report_period_s: float, drain_signal=None, board=None
    ) -> None:
        self.name = ray.get_runtime_context().get_actor_name()
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        recorder = ray.get_actor(RECORDER, namespace=NAMESPACE)
        self.app = _app(ray.get(recorder.register.remote(self.name)), recorder)
        self.moves = MoveBook()  # (its answers never move)

    def record_routing_stats(self) -> dict[str, object]:
        return {}  # (no report: the router spreads requests evenly)

    def check_health(self) -> None:
        pass


def _app(index: int, recorder) -> Starlette:
    async def completions(request: Request) -> Response:
        await request.body()
        await recorder.called.remote(index)
        fake = request.headers.get(FAKE, "")
        if fake == "busy-all" or (fake == "busy-first" and index == 0):
            return _json(engine_full_429(), 429, headers={"Retry-After": "2"})
        if fake == "key-limited":
            return _json(await key_limit_429(), 429, headers={"Retry-After": "1"})
        num_chunks = int(request.headers.get(CHUNKS, "2"))
        stream_id = request.headers.get(STREAM_ID, "")

        async def frames():
            finished = False
            try:
                for i in range(num_chunks):
                    yield f"data: {i}\n\n".encode()
                    await asyncio.sleep(0.05)
                yield b"data: [DONE]\n\n"
                finished = True
            finally:
                if not finished:  # (not awaited: this task is being cancelled)
                    recorder.cancelled.remote(stream_id)

        return StreamingResponse(frames(), media_type="text/event-stream")

    return Starlette(routes=[Route("/v1/completions", completions, methods=["POST"])])


def _json(body: bytes, status: int, headers: dict[str, str]) -> Response:
    return Response(body, status, headers, media_type="application/json")
