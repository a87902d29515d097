"""The ingress's half of an answer: the replica calls that serve it, relayed to its client.

`Relay` streams one answer's body from the replica call that serves it.  When that replica
hands the answer off (it leaves the fleet: `EngineReplica.drain` with moves), its body ends
without [DONE] and its `StreamHandoff` comes as the call's last item; the relay opens the
continuation on another replica (`resume_http`, through the ingress's `Resume`) and goes on
relaying from it into the same response, so the client sees one answer: no chunk lost or
repeated, one [DONE].
"""

# No `from __future__ import annotations`, as in ingress.py: Ray pickles the ingress
# class, whose module imports these, by value.
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

from fastapi.responses import StreamingResponse
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator
from starlette.types import Receive, Scope, Send

from tokenflow.serving.moves import StreamHandoff

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ReplicaCall:
    """One forwarded request, as every replica call for its answer sends it."""

    route: dict[str, object]
    method: str
    target: str
    headers: list[tuple[str, str]]
    body: bytes


class ReadAhead:
    """A replica call whose first items were read ahead of its client (a refusal's body, to
    tell what it means: `read`): they come again first, then the rest of the call.  Cancelled
    as the call is."""

    def __init__(self, stream: DeploymentResponseGenerator) -> None:
        self._stream = stream
        self._items: list[bytes | StreamHandoff] = []
        self._is_exhausted = False

    async def read(self, max_bytes: int) -> bytes:
        """Read the call (once, after its first item) to its end, or past `max_bytes`: the
        body read."""
        num_bytes = 0
        while num_bytes <= max_bytes:
            try:
                item = await self._stream.__anext__()
            except StopAsyncIteration:
                self._is_exhausted = True
                break
            self._items.append(item)
            num_bytes += len(item) if isinstance(item, bytes) else 0
        return b"".join(item for item in self._items if isinstance(item, bytes))

    def __aiter__(self) -> "ReadAhead":
        return self

    async def __anext__(self) -> bytes | StreamHandoff:
        if self._items:
            return self._items.pop(0)
        if self._is_exhausted:
            raise StopAsyncIteration
        return await self._stream.__anext__()

    def cancel(self) -> None:
        """Cancel the replica call."""
        self._stream.cancel()


# A replica call's first item (status, headers, replica) and the call.
Opened = tuple[dict[str, object], DeploymentResponseGenerator | ReadAhead]
# Opens the continuation of a handed-off answer on a replica not among those it left.
Resume = Callable[[StreamHandoff, list[str]], Awaitable[Opened | None]]


def call_replica(
    engine: DeploymentHandle,
    call: ReplicaCall,
    route: dict[str, object],
    handoff: StreamHandoff | None,
) -> DeploymentResponseGenerator:
    """A streaming call of `serve_http`, or of `resume_http` to continue `handoff`."""
    handle = engine.options(stream=True)
    if handoff is None:
        return handle.serve_http.remote(route, call.method, call.target, call.headers, call.body)
    return handle.resume_http.remote(
        route, call.method, call.target, call.headers, call.body, handoff
    )


class Relay(StreamingResponse):
    """A replica's answer, streamed to the client.  When the replica hands the answer off (it
    leaves: `EngineReplica.drain`), its body ends without [DONE] and its `StreamHandoff` comes
    instead: the answer goes on from another replica's continuation, in this same response.
    When the answer ends before the replica's last chunk (the client disconnected, or the
    ingress stopped), the replica call is cancelled there and then, so the replica aborts the
    request in its engine and frees its KV at once, not whenever Ray notices that the caller
    is gone.  However it ends, `on_end` is called then (the ingress releases the request's
    admission)."""

    def __init__(
        self,
        stream: DeploymentResponseGenerator | ReadAhead,
        status_code: int,
        headers: dict[str, str],
        replica_id: str = "",
        resume: Resume | None = None,
        on_end: Callable[[], None] | None = None,
    ) -> None:
        self._stream = stream
        self._replica_id = replica_id
        self._resume = resume
        self._on_end = on_end
        self._is_finished = False
        super().__init__(self._chunks(), status_code=status_code, headers=headers)

    async def _chunks(self) -> AsyncIterator[bytes]:
        """The body, across every replica that serves a part of it; if a replica dies
        meanwhile, or no replica takes a handed-off answer, an SSE error frame and [DONE] end
        it."""
        left: list[str] = []  # the replicas that handed this answer off
        while True:
            handoff = None
            try:
                async for item in self._stream:
                    if isinstance(item, StreamHandoff):
                        handoff = item  # (the call's last item)
                    else:
                        yield item
            except Exception as err:  # noqa: BLE001 - the replica (or its actor) died mid-stream
                logger.warning("a replica failed mid-stream: %s", err)
                yield error_frames(f"the replica failed: {type(err).__name__}")
                break
            if handoff is None:
                break
            left.append(self._replica_id)
            opened = await self._resume(handoff, left) if self._resume is not None else None
            if opened is None:
                yield error_frames("the stream's replica left and no other replica took it")
                break
            start, self._stream = opened
            self._replica_id = str(start["replica_id"])
        self._is_finished = True

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            if not self._is_finished:
                self._stream.cancel()
            if self._on_end is not None:
                self._on_end()


def error_frames(message: str) -> bytes:
    """An SSE error event and [DONE]: how an answer that cannot go on ends."""
    error = {"error": {"message": message, "type": "server_error", "code": 503}}
    return f"data: {json.dumps(error)}\n\ndata: [DONE]\n\n".encode()
