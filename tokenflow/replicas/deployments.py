"""The two deployments: N TokenFlow engine replicas, and the OpenAI ingress in front of them.

The ingress guards the fleet as `tokenflow serve` guards itself: the API key from the headers,
before any of the body is read (`tokenflow.serving.auth.RequireApiKey`, the server's own), then
(`guards.py`) --max-body-bytes while the body is read and a 400 for a body that is not a JSON
object.  It reads only what routing needs from the body (`reports.route_facts`) and hands the
request, untouched, to an engine replica through a streaming handle; Ray Serve's request router
(`router.TokenFlowRequestRouter`, or Ray's default) picks the replica.  A replica that refuses
the request (429 full, 503 draining) has it offered to another, a bounded number of times.  The
replica serves it with the app `tokenflow serve` runs, so `stream_rate`, validation and SSE
framing are the same; the ingress cancels the replica call as soon as the client leaves.

A replica drains as `tokenflow serve` does on SIGTERM when the launcher asks (`DrainSignal`):
503 with Retry-After for new requests, the answers in flight go on for --drain-timeout-s.  When
it leaves alone (the others serve on), its streamed answers move first: the ingress marks each
request it forwards with a ticket (`serving.moves.MOVE_HEADER`), the replica exports the
movable ones from its engine and ends their bodies with their `StreamHandoff`, and the ingress
continues each on another replica (`resume_http`) in the response its client holds.  Queued
requests move the same way while every replica serves on: each replica posts its load to the
fleet's board once a period (`rebalancing.Rebalancer`, `board.MoveBoard`), and those the board
sends to a replica with room (one that just joined) continue there.
"""

# No `from __future__ import annotations`: Ray pickles the ingress class by value, and FastAPI
# must find its routes' parameter types (`Request`) as objects, not as names to look up.
import argparse
import asyncio
import logging
import os
import threading
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace

import ray
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from ray import serve
from ray.actor import ActorHandle
from ray.serve.handle import DeploymentHandle
from starlette.requests import ClientDisconnect

from tokenflow.core.routing import LoadReport, load_report
from tokenflow.replicas.asgi import ResponseStart, stream_asgi
from tokenflow.replicas.guards import (
    MAX_TRIES,
    RETRY_STATUSES,
    error_response,
    health_problem,
    parse_body,
    read_body,
    should_retry,
)
from tokenflow.replicas.rebalancing import Rebalancer, RemoteBoard
from tokenflow.replicas.relay import Opened, Relay, ReplicaCall, call_replica
from tokenflow.replicas.reports import report_to_stats, route_facts, with_avoided, with_preferred
from tokenflow.serving.auth import ApiKeys, RequireApiKey
from tokenflow.serving.config import ServerConfig
from tokenflow.serving.drain import DRAIN_RETRY_AFTER_S, Drain
from tokenflow.serving.moves import MOVE_HEADER, MoveBook, StreamHandoff
from tokenflow.serving.validation import ApiError

logger = logging.getLogger(__name__)
REPLICA_HEADER = "X-TokenFlow-Replica"  # which replica served a response
CLIENT_CLOSED_STATUS = 499  # (as `tokenflow serve` logs a client that left)
_HOP_HEADERS = {"content-length", "transfer-encoding", "connection"}
# Not forwarded from the client: the hop headers, and a ticket only the ingress gives.
_NOT_FORWARDED = _HOP_HEADERS | {MOVE_HEADER.lower()}


def server_config(serve_argv: list[str]) -> ServerConfig:
    """The server options among `serve_argv` (the replicas' `tokenflow serve` options), parsed
    as `tokenflow serve` parses them, without the engine's options (whose module loads torch,
    which the ingress and the launcher never need).  ValueError on a bad value."""
    parser = argparse.ArgumentParser(allow_abbrev=False, add_help=False)
    ServerConfig.add_arguments(parser)
    args, _ = parser.parse_known_args(serve_argv)
    return ServerConfig.from_namespace(args)


@dataclass(frozen=True)
class DrainOutcome:
    """How one replica's drain ended."""

    is_drained: bool  # every answer was sent, or handed off, within its --drain-timeout-s
    num_handed_off: int  # answers that moved to other replicas


@ray.remote(num_cpus=0)
class DrainSignal:
    """The launcher's word to the engine replicas that the fleet shuts down, or that one of them
    leaves, and their answers.  An actor, because Serve can call one replica of a deployment,
    never all of them: each replica waits on `wait_begun` (in a thread) from its start."""

    def __init__(self) -> None:
        self._changed = asyncio.Condition()
        self._is_fleet_draining = False
        self._leaving: set[str] = set()
        self._drained: dict[str, bool] = {}
        self._num_handed_off: dict[str, int] = {}

    async def begin(self) -> None:
        """Every replica drains (the fleet shuts down: no stream has anywhere to move)."""
        async with self._changed:
            self._is_fleet_draining = True
            self._changed.notify_all()

    async def leave(self, replica: str) -> None:
        """`replica` (its actor name) drains while the others serve on: its streams move."""
        async with self._changed:
            self._leaving.add(replica)
            self._changed.notify_all()

    async def wait_begun(self, replica: str) -> bool:
        """Block until `replica` is to drain; True when it leaves alone (its streams move)."""
        async with self._changed:
            await self._changed.wait_for(
                lambda: self._is_fleet_draining or replica in self._leaving
            )
            return not self._is_fleet_draining

    async def done(self, replica: str, drained: bool, num_handed_off: int = 0) -> None:
        """`replica` finished its drain; `drained`: every answer was sent (or handed off) in
        time; `num_handed_off`: the answers that moved to other replicas."""
        async with self._changed:
            self._drained[replica] = drained
            self._num_handed_off[replica] = num_handed_off
            self._changed.notify_all()

    async def drained(self) -> dict[str, bool]:
        """The replicas that finished their drain so far."""
        return dict(self._drained)

    async def wait_done(self, replica: str, timeout_s: float) -> DrainOutcome | None:
        """Block until `replica` finished its drain, for at most `timeout_s`: what it told
        `done`; None when it did not finish in time."""
        async with self._changed:
            try:
                await asyncio.wait_for(
                    self._changed.wait_for(lambda: replica in self._drained), timeout_s
                )
            except TimeoutError:
                return None
            return DrainOutcome(self._drained[replica], self._num_handed_off[replica])


class EngineReplica:
    """One TokenFlow engine (its own scheduler, policy and KV tiers) and its OpenAI app."""

    def __init__(
        self,
        serve_argv: list[str],
        report_period_s: float,
        drain_signal: ActorHandle | None = None,
        board: ActorHandle | None = None,
    ) -> None:
        from tokenflow.cli.serve import add_serve_arguments
        from tokenflow.engine.async_engine import AsyncEngine
        from tokenflow.engine.engine_args import EngineArgs
        from tokenflow.integrations.executors import executor_factory
        from tokenflow.serving.app import build_app

        parser = argparse.ArgumentParser(allow_abbrev=False)
        add_serve_arguments(parser)
        args = parser.parse_args(serve_argv)
        engine_args = EngineArgs.from_namespace(args)
        self.config = ServerConfig.from_namespace(args)
        self.engine = AsyncEngine(engine_args, True, executor_factory(engine_args.executor))
        self.drain_state = Drain()
        self.moves = MoveBook()
        self.app = build_app(self.engine, self.config, self.drain_state, self.moves)
        self.name = ray.get_runtime_context().get_actor_name() or f"pid-{os.getpid()}"
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self.num_handed_off = 0  # answers its drain handed to other replicas
        self._period_s = report_period_s
        self._report: LoadReport = self._measure()
        self._reported_s = time.monotonic()
        self.engine.after_step = self._after_step
        self.rebalancer: Rebalancer | None = None  # (no board: nothing moves but at a leave)
        if board is not None:
            remote = RemoteBoard(board, self.config.drain_timeout_s)
            self.rebalancer = Rebalancer(
                self.engine, self.moves, remote, self.replica_id, report_period_s
            )
            self.rebalancer.start()
        if drain_signal is not None:
            threading.Thread(
                target=self._drain_when_signalled,
                args=(drain_signal,),
                name="tokenflow-drain",
                daemon=True,
            ).start()

    def _measure(self) -> LoadReport:
        """This replica's report (on the engine thread, or before it starts stepping)."""
        llm = self.engine.engine
        return load_report(llm.scheduler.view(llm.core.clock.now()))

    def _after_step(self) -> None:
        if time.monotonic() - self._reported_s >= self._period_s / 2:
            self._report, self._reported_s = self._measure(), time.monotonic()

    def record_routing_stats(self) -> dict[str, object]:
        """Ray Serve asks every `request_routing_stats_period_s`: the latest load report.  (The
        first ask says Serve routes to this replica: its rebalancing starts.)"""
        if self.rebalancer is not None:
            self.rebalancer.routed()
        return report_to_stats(self._report)

    async def serve_http(
        self,
        route: dict[str, object],
        method: str,
        path: str,
        headers: list[tuple[str, str]],
        body: bytes,
    ) -> AsyncIterator[dict[str, object] | bytes | StreamHandoff]:
        """Serve one HTTP request: first {status, headers, replica, replica_id}, then the body's
        chunks.  `route` (the routing facts) is for the request router, which reads the first
        argument.  Cancelling the call tells the app the client left (`stream_asgi`).  An answer
        this replica hands off (`drain` with moves) ends without [DONE], and its
        `StreamHandoff` follows as the last item: the ingress continues it elsewhere."""
        async for item in self._serve_app(method, path, headers, body):
            yield item

    async def resume_http(
        self,
        route: dict[str, object],
        method: str,
        path: str,
        headers: list[tuple[str, str]],
        body: bytes,
        handoff: StreamHandoff,
    ) -> AsyncIterator[dict[str, object] | bytes | StreamHandoff]:
        """Serve the request (`body` and ticket as first forwarded) as the continuation of
        `handoff`, an answer another replica handed off: its engine request is imported here
        and the body holds only the chunks after those its client has, with the same `id` and
        `created`, then the usage over every token and [DONE].  Items as `serve_http`."""
        ticket = _header(headers, MOVE_HEADER)
        if ticket is None:
            raise ValueError(f"a continuation needs the ingress's {MOVE_HEADER} header")
        self.moves.expect_resume(ticket, handoff)
        if self.rebalancer is not None:
            self.rebalancer.landed(handoff.state.request_id, handoff.handed_off_s)
        try:
            async for item in self._serve_app(method, path, headers, body):
                yield item
        finally:
            self.moves.take_resume(ticket)  # (left there when the app refused the request)

    async def _serve_app(
        self, method: str, path: str, headers: list[tuple[str, str]], body: bytes
    ) -> AsyncIterator[dict[str, object] | bytes | StreamHandoff]:
        async for item in stream_asgi(self.app, method, path, headers, body):
            if isinstance(item, ResponseStart):
                yield {
                    "status": item.status,
                    "headers": item.headers,
                    "replica": self.name,
                    "replica_id": self.replica_id,
                }
            else:
                yield item
        ticket = _header(headers, MOVE_HEADER)
        handoff = self.moves.take_handoff(ticket) if ticket is not None else None
        if handoff is not None and self.rebalancer is not None:
            target = self.rebalancer.take_target(handoff.state.request_id)
            handoff = replace(handoff, target_replica_id=target)
        if handoff is not None:
            yield handoff

    def check_health(self) -> None:
        """Ray Serve's health check (every `health_check_period_s`; a replica that fails it is
        replaced): the engine loop is alive and has turned within --health-stall-s, as
        `tokenflow serve`'s /health reads it, so a loop stuck in a step is caught too.  A
        draining replica passes: its loop stops on purpose."""
        if self.drain_state.is_draining:
            return
        problem = health_problem(self.engine.health(), self.config.health_stall_s)
        if problem is not None:
            raise RuntimeError(problem)

    def drain(self, move_streams: bool = False) -> bool:
        """Drain as `tokenflow serve` does on SIGTERM: from now on /health and every /v1
        request answer 503 with Retry-After (the ingress offers the request to another
        replica), the answers in flight go on for --drain-timeout-s, then the engine loop stops
        (a stream still open then ends with an error frame and [DONE]).  With `move_streams`
        (this replica leaves, the others serve on), its movable answers are first exported from
        its engine and handed to the ingress, which continues each on another replica: the
        drain then waits only for the rest.  Blocks; True when every answer was sent or handed
        off in time."""
        self.drain_state.begin()
        if self.rebalancer is not None:
            self.rebalancer.stop()
        if move_streams:
            self.num_handed_off = self._hand_off_streams()
        drained = self.drain_state.wait_drained(self.config.drain_timeout_s)
        self.engine.stop()
        return drained

    def _hand_off_streams(self) -> int:
        """Export every movable answer's engine request, between two steps; each answer's body
        then ends, and `serve_http` yields its handoff.  How many were exported."""
        request_ids = self.moves.movable_request_ids()
        try:
            exported = self.engine.export_streams(request_ids)
            states = exported.result(timeout=self.config.drain_timeout_s)
        except Exception as err:  # noqa: BLE001 - they finish here instead, as without moves
            logger.warning("the streams could not be exported: %s", err)
            return 0
        logger.info("handing off %d of %d movable streams", len(states), len(request_ids))
        return len(states)

    def _drain_when_signalled(self, drain_signal: ActorHandle) -> None:
        """(Its own thread, from the start.)  Drain once the launcher says so; tell it when
        done."""
        try:
            move_streams = ray.get(drain_signal.wait_begun.remote(self.name))
        except ray.exceptions.RayError:
            return  # the launcher, which holds the signal, is gone: nobody will ask
        logger.info("draining %d requests in flight", self.drain_state.num_in_flight)
        drained = self.drain(move_streams)
        drain_signal.done.remote(self.name, drained, self.num_handed_off)

    def __del__(self) -> None:
        """Serve's shutdown hook (scale-down, redeploy, `serve.shutdown`).  Serve calls it once
        it has waited for the requests in flight (for `graceful_shutdown_timeout_s`, which the
        launcher sets from --drain-timeout-s) and refuses new ones: stop the engine loop."""
        if hasattr(self, "engine"):  # (not when __init__ failed before the engine started)
            self.drain_state.begin()
            rebalancer = getattr(self, "rebalancer", None)
            if rebalancer is not None:
                rebalancer.stop()
            self.engine.stop()


class Forwarder:
    """What the ingress does: forward every request to an engine replica, stream its answer."""

    def __init__(
        self,
        engine: DeploymentHandle,
        default_rate_tps: float,
        config: ServerConfig | None = None,
        max_tries: int = MAX_TRIES,
    ) -> None:
        config = config or ServerConfig()
        self._engine = engine
        self._default_rate_tps = default_rate_tps
        self._max_body_bytes = config.max_body_bytes
        self._max_tries = max_tries
        self._num_by_replica: dict[str, int] = {}
        self._num_moved_to: dict[str, int] = {}

    async def replicas(self) -> JSONResponse:
        """Generation requests answered so far by each replica (by its actor name)."""
        return JSONResponse(dict(sorted(self._num_by_replica.items())))

    async def moves(self) -> JSONResponse:
        """Answers each replica (by its actor name) went on with after another handed them
        off (a move of a queued request, or a replica that left)."""
        return JSONResponse(dict(sorted(self._num_moved_to.items())))

    async def forward(self, request: Request, path: str) -> Response:
        """Any other path: to a replica, as it came.  Its API key was checked already (from
        the headers: `ingress_class`); first the body's size (413, while it is read), then its
        JSON (400), so no client costs the ingress more than a request's worth."""
        try:
            body = await read_body(request, self._max_body_bytes)
            parsed = parse_body(body)
        except ApiError as err:
            return error_response(err)
        except ClientDisconnect:
            return Response(status_code=CLIENT_CLOSED_STATUS)
        headers = [(k, v) for k, v in request.headers.items() if k.lower() not in _NOT_FORWARDED]
        if request.method == "POST":  # the answer may move (serving/moves.py): its ticket
            headers.append((MOVE_HEADER, uuid.uuid4().hex))
        route = route_facts(parsed, request.headers, self._default_rate_tps)
        target = f"/{path}" + (f"?{request.url.query}" if request.url.query else "")
        call = ReplicaCall(route, request.method, target, headers, body)
        opened = await self._open(call)
        if isinstance(opened, Response):
            return opened
        start, stream = opened
        status, replica = int(start["status"]), str(start["replica"])
        if request.method == "POST":  # (generations, not /v1/models)
            self._num_by_replica[replica] = self._num_by_replica.get(replica, 0) + 1
        response_headers = {k: v for k, v in start["headers"] if k.lower() not in _HOP_HEADERS}
        response_headers[REPLICA_HEADER] = replica
        if status in RETRY_STATUSES and "retry-after" not in map(str.lower, response_headers):
            response_headers["Retry-After"] = str(DRAIN_RETRY_AFTER_S)
        replica_id = str(start["replica_id"])

        async def resume(handoff: StreamHandoff, left: list[str]) -> Opened | None:
            return await self._resume(call, handoff, left)

        return Relay(stream, status, response_headers, replica_id, resume)

    async def _resume(
        self, call: ReplicaCall, handoff: StreamHandoff, left: list[str]
    ) -> Opened | None:
        """The continuation of an answer handed off by the replicas in `left` (never offered to
        them), with its first item; None when no other replica took it."""
        opened = await self._open(call, left, handoff)
        if isinstance(opened, Response):
            return None
        start, stream = opened
        if int(start["status"]) != 200:
            logger.warning("no replica took a moved stream: %s", start["status"])
            stream.cancel()
            return None
        replica = str(start["replica"])
        self._num_moved_to[replica] = self._num_moved_to.get(replica, 0) + 1
        return start, stream

    async def _open(
        self,
        call: ReplicaCall,
        avoid: list[str] | None = None,
        handoff: StreamHandoff | None = None,
    ) -> Opened | Response:
        """The replica call that answers the request (or continues `handoff`), with its first
        item: the first whose status is not a refusal another replica could take back
        (`guards.should_retry`), else the last refusal; a 503 when no replica answered at all.
        A refused request is offered to the replicas that have not refused it and are not in
        `avoid` (`reports.with_avoided`), and each refused call is cancelled at once; so is the
        call in hand when the client leaves meanwhile.  A continuation planned for a replica
        (`StreamHandoff.target_replica_id`) is offered to that one first."""
        refused_by: list[str] = list(avoid or [])
        route = call.route
        if handoff is not None and handoff.target_replica_id is not None:
            route = with_preferred(route, handoff.target_replica_id)
        num_tries = 0
        while True:
            num_tries += 1
            stream = call_replica(self._engine, call, with_avoided(route, refused_by), handoff)
            try:
                start = await stream.__anext__()
            except asyncio.CancelledError:
                stream.cancel()  # the client left before the replica answered
                raise
            except Exception as err:  # noqa: BLE001 - a replica that died before answering
                if not should_retry(None, num_tries, self._max_tries):
                    return _unavailable(err)
                logger.warning("a replica failed before answering, trying another: %s", err)
                continue
            if not should_retry(int(start["status"]), num_tries, self._max_tries):
                return start, stream
            stream.cancel()
            refused_by.append(str(start["replica_id"]))


def ingress_class(config: ServerConfig | None = None) -> type:
    """The ingress deployment's class with its FastAPI app, guarded by `config`'s API keys as
    `tokenflow serve` is guarded: 401 for a /v1 request without an accepted key, from its
    headers, before its body is read.  Built here, not at import, so Ray pickles the app with
    the class (an app imported afresh in the replica would lack the routes' `self`)."""
    config = config or ServerConfig()
    app = FastAPI(title="TokenFlow replicas", docs_url=None, redoc_url=None)
    app.add_middleware(RequireApiKey, keys=ApiKeys(config.allowed_keys), on_refused=_uncounted)

    class OpenAIIngress(Forwarder):
        @app.get("/replicas")
        async def replicas(self) -> JSONResponse:
            return await Forwarder.replicas(self)

        @app.get("/replicas/moves")
        async def moves(self) -> JSONResponse:
            return await Forwarder.moves(self)

        @app.api_route("/{path:path}", methods=["GET", "POST"], response_model=None)
        async def forward(self, request: Request, path: str) -> Response:
            return await Forwarder.forward(self, request, path)

    return serve.ingress(app)(OpenAIIngress)


def _uncounted(status: int) -> None:
    """(The ingress keeps no error metrics: the replicas' /metrics count what they answer.)"""


def _header(headers: list[tuple[str, str]], name: str) -> str | None:
    """The value of header `name` among `headers` (None when absent)."""
    return next((v for k, v in headers if k.lower() == name.lower()), None)


def _unavailable(err: BaseException) -> JSONResponse:
    message = f"no replica could serve the request: {type(err).__name__}"
    error = {"message": message, "type": "server_error", "code": 503}
    return JSONResponse({"error": error}, status_code=503, headers={"Retry-After": "1"})
