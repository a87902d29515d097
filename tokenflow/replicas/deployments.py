"""The engine replicas' deployment: N TokenFlow engines, each serving the app `tokenflow serve`
runs, behind the ingress (`ingress.py`), and the launcher's word to them when they drain.

A replica serves each request the ingress forwards with the app `tokenflow serve` runs, so
`stream_rate`, validation and SSE framing are the same, without per-key limits (the ingress
holds them fleet-wide: `keys.py`); it reports its load for the request router
(`record_routing_stats`) and is cancelled as soon as the client leaves.

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

import argparse
import asyncio
import logging
import os
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace

import ray
from ray import serve
from ray.actor import ActorHandle

from tokenflow.cli.engine_options import add_default_rate_argument
from tokenflow.cli.server_options import add_server_options, server_config_from
from tokenflow.core.load_report import LoadReport
from tokenflow.core.request import is_reader_rate, reader_rate_error
from tokenflow.replicas.asgi import ResponseStart, stream_asgi
from tokenflow.replicas.guards import health_problem
from tokenflow.replicas.keys import replica_config
from tokenflow.replicas.rebalancer import Rebalancer, RemoteBoard
from tokenflow.replicas.reports import report_to_stats
from tokenflow.serving.config import ServerConfig
from tokenflow.serving.moves import MOVE_HEADER, MoveBook, StreamHandoff

logger = logging.getLogger(__name__)


def server_config(serve_argv: list[str]) -> ServerConfig:
    """The server options among `serve_argv` (the replicas' `tokenflow serve` options), parsed
    as `tokenflow serve` parses them, without the engine's options (whose module loads torch,
    which the ingress and the launcher never need).  ValueError on a bad value."""
    parser = argparse.ArgumentParser(allow_abbrev=False, add_help=False)
    add_server_options(parser)
    args, _ = parser.parse_known_args(serve_argv)
    return server_config_from(args)


def served_default_rate(serve_argv: list[str]) -> float:
    """The replicas' `--default-rate` among `serve_argv` (an engine option, read here alone
    for the same reason as `server_config`): the rate of readers that state none, which the
    ingress routes by.  ValueError on a rate no reader may have."""
    parser = argparse.ArgumentParser(allow_abbrev=False, add_help=False)
    add_default_rate_argument(parser)
    rate_tps = parser.parse_known_args(serve_argv)[0].default_rate_tps
    if not is_reader_rate(rate_tps):
        raise ValueError(f"--default-rate: {reader_rate_error(rate_tps)}")
    return rate_tps


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
        from tokenflow.cli.serve_options import add_serve_arguments, serve_options_from
        from tokenflow.serving.server import build_server

        parser = argparse.ArgumentParser(allow_abbrev=False)
        add_serve_arguments(parser)
        args = parser.parse_args(serve_argv)
        options = serve_options_from(args)
        self.config = replica_config(options.config)  # (no per-key limit)
        self.moves = MoveBook()
        served = build_server(options.engine_args, self.config, start_thread=True, moves=self.moves)
        self.engine, self.drain_state, self.app = served.engine, served.drain, served.app
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
        """This replica's report (on the engine thread, or before any request reached it)."""
        return self.engine.load_report()

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


def _header(headers: list[tuple[str, str]], name: str) -> str | None:
    """The value of header `name` among `headers` (None when absent)."""
    return next((v for k, v in headers if k.lower() == name.lower()), None)
