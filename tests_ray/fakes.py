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
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from tokenflow.replicas.deployments import EngineReplica
from tokenflow.serving.moves import MoveBook

RECORDER = "tokenflow-test-recorder"
NAMESPACE = "tokenflow-tests"
FAKE = "x-fake"  # busy-first: the first replica answers 429; busy-all: every replica does
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
            error = {"message": "full", "type": "server_error", "param": None, "code": None}
            return JSONResponse({"error": error}, 429, headers={"Retry-After": "2"})
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
