"""The two deployments: N TokenFlow engine replicas, and the OpenAI ingress in front of them.

The ingress reads only what routing needs from each body (`reports.route_facts`) and hands the
request, untouched, to an engine replica through a streaming handle; Ray Serve's request router
(`router.TokenFlowRequestRouter`, or Ray's default) picks the replica.  The replica serves it
with the app `tokenflow serve` runs, so `stream_rate`, validation and SSE framing are the same.
"""

# No `from __future__ import annotations`: Ray pickles the ingress class by value, and FastAPI
# must find its routes' parameter types (`Request`) as objects, not as names to look up.
import argparse
import json
import logging
import os
import time
from collections.abc import AsyncIterator

import ray
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from ray import serve
from ray.serve.handle import DeploymentHandle

from tokenflow.core.routing import LoadReport, load_report
from tokenflow.replicas.asgi import ResponseStart, stream_asgi
from tokenflow.replicas.reports import report_to_stats, route_facts

logger = logging.getLogger(__name__)
REPLICA_HEADER = "X-TokenFlow-Replica"  # which replica served a response
_HOP_HEADERS = {"content-length", "transfer-encoding", "connection"}


class EngineReplica:
    """One TokenFlow engine (its own scheduler, policy and KV tiers) and its OpenAI app."""

    def __init__(self, serve_argv: list[str], report_period_s: float) -> None:
        from tokenflow.engine.async_engine import AsyncEngine
        from tokenflow.engine.engine_args import EngineArgs
        from tokenflow.executors import executor_factory
        from tokenflow.serving.app import build_app
        from tokenflow.serving.cli import add_serve_arguments
        from tokenflow.serving.config import ServerConfig

        parser = argparse.ArgumentParser(allow_abbrev=False)
        add_serve_arguments(parser)
        args = parser.parse_args(serve_argv)
        engine_args = EngineArgs.from_namespace(args)
        self.engine = AsyncEngine(engine_args, True, executor_factory(engine_args.executor))
        self.app = build_app(self.engine, ServerConfig.from_namespace(args))
        self.name = ray.get_runtime_context().get_actor_name() or f"pid-{os.getpid()}"
        self._period_s = report_period_s
        self._report: LoadReport = self._measure()
        self._reported_s = time.monotonic()
        self.engine.after_step = self._after_step

    def _measure(self) -> LoadReport:
        """This replica's report (on the engine thread, or before it starts stepping)."""
        llm = self.engine.engine
        return load_report(llm.scheduler.view(llm.core.clock.now()))

    def _after_step(self) -> None:
        if time.monotonic() - self._reported_s >= self._period_s / 2:
            self._report, self._reported_s = self._measure(), time.monotonic()

    def record_routing_stats(self) -> dict[str, object]:
        """Ray Serve asks every `request_routing_stats_period_s`: the latest load report."""
        return report_to_stats(self._report)

    async def serve_http(
        self,
        route: dict[str, object],
        method: str,
        path: str,
        headers: list[tuple[str, str]],
        body: bytes,
    ) -> AsyncIterator[dict[str, object] | bytes]:
        """Serve one HTTP request: first {status, headers, replica}, then the body's chunks.
        `route` (the routing facts) is for the request router, which reads the first argument."""
        async for item in stream_asgi(self.app, method, path, headers, body):
            if isinstance(item, ResponseStart):
                yield {"status": item.status, "headers": item.headers, "replica": self.name}
            else:
                yield item

    def check_health(self) -> None:
        """Ray Serve's health check: the engine loop is alive."""
        health = self.engine.health()
        if not health.is_alive:
            raise RuntimeError(health.error or "the engine loop died")


class Forwarder:
    """What the ingress does: forward every request to an engine replica, stream its answer."""

    def __init__(self, engine: DeploymentHandle, default_rate_tps: float) -> None:
        self._engine = engine
        self._default_rate_tps = default_rate_tps
        self._num_by_replica: dict[str, int] = {}

    async def replicas(self) -> JSONResponse:
        """Generation requests answered so far by each replica (by its actor name)."""
        return JSONResponse(dict(sorted(self._num_by_replica.items())))

    async def forward(self, request: Request, path: str) -> StreamingResponse | JSONResponse:
        """Any other path: to a replica, as it came."""
        body = await request.body()
        headers = [(k, v) for k, v in request.headers.items() if k.lower() not in _HOP_HEADERS]
        route = route_facts(body, dict(request.headers), self._default_rate_tps)
        target = f"/{path}" + (f"?{request.url.query}" if request.url.query else "")
        stream = self._engine.options(stream=True).serve_http.remote(
            route, request.method, target, headers, body
        )
        try:
            start = await stream.__anext__()
        except Exception as err:  # noqa: BLE001 - a replica that died before answering
            return _unavailable(err)
        replica = str(start["replica"])
        if request.method == "POST":  # (generations, not /v1/models)
            self._num_by_replica[replica] = self._num_by_replica.get(replica, 0) + 1
        response_headers = {k: v for k, v in start["headers"] if k.lower() not in _HOP_HEADERS}
        response_headers[REPLICA_HEADER] = replica
        return StreamingResponse(
            _rest(stream), status_code=int(start["status"]), headers=response_headers
        )


def ingress_class() -> type:
    """The ingress deployment's class with its FastAPI app.  Built here, not at import, so
    Ray pickles the app with the class (an app imported afresh in the replica would lack the
    routes' `self`)."""
    app = FastAPI(title="TokenFlow replicas")

    class OpenAIIngress(Forwarder):
        @app.get("/replicas")
        async def replicas(self) -> JSONResponse:
            return await Forwarder.replicas(self)

        @app.api_route("/{path:path}", methods=["GET", "POST"], response_model=None)
        async def forward(self, request: Request, path: str) -> StreamingResponse | JSONResponse:
            return await Forwarder.forward(self, request, path)

    return serve.ingress(app)(OpenAIIngress)


async def _rest(stream: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """The body; if the replica dies meanwhile, an SSE error frame and [DONE] end it."""
    try:
        async for chunk in stream:
            yield chunk
    except Exception as err:  # noqa: BLE001 - the replica (or its actor) died mid-stream
        logger.warning("a replica failed mid-stream: %s", err)
        error = {
            "error": {
                "message": f"the replica failed: {type(err).__name__}",
                "type": "server_error",
                "code": 503,
            }
        }
        yield f"data: {json.dumps(error)}\n\ndata: [DONE]\n\n".encode()


def _unavailable(err: BaseException) -> JSONResponse:
    message = f"no replica could serve the request: {type(err).__name__}"
    error = {"message": message, "type": "server_error", "code": 503}
    return JSONResponse({"error": error}, status_code=503, headers={"Retry-After": "1"})
