"""The ingress deployment: the OpenAI endpoint in front of the engine replicas (deployments.py).

The ingress guards the fleet as `tokenflow serve` guards itself: the API key from the headers,
before any of the body is read (`tokenflow.serving.auth.RequireApiKey`, the server's own), then
(`guards.py`) --max-body-bytes while the body is read and a 400 for a body that is not a JSON
object, then each key's limits on its work in flight, fleet-wide (`keys.py`: 429 naming the
limit).  It reads only what routing needs from the body (`reports.route_facts`) and hands the
request, untouched, to an engine replica through a streaming handle; Ray Serve's request router
(`router.TokenFlowRequestRouter`, or Ray's default) picks the replica.  A replica that refuses
the request because it is full (429 `server_overloaded`) or draining (503) has it offered to
another, a bounded number of times (`guards.should_retry`).  The ingress cancels the replica
call as soon as the client leaves, and goes on with an answer a replica hands off on another
(`relay.Relay`).
"""

# No `from __future__ import annotations`: Ray pickles the ingress class by value, and FastAPI
# must find its routes' parameter types (`Request`) as objects, not as names to look up.
import asyncio
import logging
import uuid

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from ray import serve
from ray.serve.handle import DeploymentHandle
from starlette.requests import ClientDisconnect

from tokenflow.replicas.guards import (
    MAX_REFUSAL_BYTES,
    MAX_TRIES,
    REFUSAL_STATUSES,
    error_response,
    parse_body,
    read_body,
    should_retry,
)
from tokenflow.replicas.keys import end, ingress_gate, starts_work, work_of
from tokenflow.replicas.relay import Opened, ReadAhead, Relay, ReplicaCall, call_replica
from tokenflow.replicas.reports import (
    facts_to_route_request,
    route_facts,
    with_avoided,
    with_preferred,
)
from tokenflow.serving.auth import ApiKeys, RequireApiKey, bearer_token, unguarded_paths
from tokenflow.serving.config import ServerConfig
from tokenflow.serving.drain import DRAIN_RETRY_AFTER_S
from tokenflow.serving.moves import MOVE_HEADER, StreamHandoff
from tokenflow.serving.tenants import Admission
from tokenflow.serving.validation import ApiError

logger = logging.getLogger(__name__)
REPLICA_HEADER = "X-TokenFlow-Replica"  # which replica served a response
CLIENT_CLOSED_STATUS = 499  # (as `tokenflow serve` logs a client that left)
_HOP_HEADERS = {"content-length", "transfer-encoding", "connection"}
# Not forwarded from the client: the hop headers, and a ticket only the ingress gives.
_NOT_FORWARDED = _HOP_HEADERS | {MOVE_HEADER.lower()}


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
        # The replicas' class rules and --default-rate: routed as the replicas will serve it.
        self._class_rules = config.class_rules
        self._default_rate_tps = default_rate_tps
        self._max_body_bytes = config.max_body_bytes
        self._max_tries = max_tries
        self._gate = ingress_gate(config)
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
        JSON (400), then a generation's work against its key's limits (429: `keys.py`), so no
        client costs the ingress more than a request's worth, nor a key more than its share."""
        try:
            body = await read_body(request, self._max_body_bytes)
            parsed = parse_body(body)
            route = route_facts(parsed, request.headers, self._class_rules, self._default_rate_tps)
            admission = await self._admit(request, f"/{path}", route)
        except ApiError as err:
            return error_response(err)
        except ClientDisconnect:
            return Response(status_code=CLIENT_CLOSED_STATUS)
        try:
            return await self._relay(request, path, body, route, admission)
        except BaseException:
            end(admission)  # (the client left before any replica answered)
            raise

    async def _admit(
        self, request: Request, path: str, route: dict[str, object]
    ) -> Admission | None:
        """A generation's admission against its key's limits, fleet-wide (ApiError 429 naming
        the limit); None for a request that starts no engine work."""
        facts = facts_to_route_request(route)
        if facts is None or not starts_work(request.method, path):
            return None
        key = bearer_token(request.headers.get("authorization"))
        return await self._gate.admit(key, work_of(facts))

    async def _relay(
        self,
        request: Request,
        path: str,
        body: bytes,
        route: dict[str, object],
        admission: Admission | None,
    ) -> Response:
        """The answer of the replica that takes the request, relayed; `admission` ends with
        it (`keys.end`)."""
        headers = [(k, v) for k, v in request.headers.items() if k.lower() not in _NOT_FORWARDED]
        if request.method == "POST":  # the answer may move (serving/moves.py): its ticket
            headers.append((MOVE_HEADER, uuid.uuid4().hex))
        target = f"/{path}" + (f"?{request.url.query}" if request.url.query else "")
        call = ReplicaCall(route, request.method, target, headers, body)
        opened = await self._open(call)
        if isinstance(opened, Response):
            end(admission)
            return opened
        start, stream = opened
        status, replica = int(start["status"]), str(start["replica"])
        if request.method == "POST":  # (generations, not /v1/models)
            self._num_by_replica[replica] = self._num_by_replica.get(replica, 0) + 1
        response_headers = {k: v for k, v in start["headers"] if k.lower() not in _HOP_HEADERS}
        response_headers[REPLICA_HEADER] = replica
        if status in REFUSAL_STATUSES and "retry-after" not in map(str.lower, response_headers):
            response_headers["Retry-After"] = str(DRAIN_RETRY_AFTER_S)
        replica_id = str(start["replica_id"])

        async def resume(handoff: StreamHandoff, left: list[str]) -> Opened | None:
            return await self._resume(call, handoff, left)

        return Relay(stream, status, response_headers, replica_id, resume, lambda: end(admission))

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
        item: the first whose answer is not a refusal another replica could take back
        (`guards.should_retry`, told by the refusal's body, which is read ahead), else the last
        refusal; a 503 when no replica answered at all.  A refused request is offered to the
        replicas that have not refused it and are not in `avoid` (`reports.with_avoided`), and
        each refused call is cancelled at once; so is the call in hand when the client leaves
        meanwhile.  A continuation planned for a replica (`StreamHandoff.target_replica_id`) is
        offered to that one first."""
        refused_by: list[str] = list(avoid or [])
        route = call.route
        if handoff is not None and handoff.target_replica_id is not None:
            route = with_preferred(route, handoff.target_replica_id)
        num_tries = 0
        while True:
            num_tries += 1
            stream = call_replica(self._engine, call, with_avoided(route, refused_by), handoff)
            body = b""
            try:
                start = await stream.__anext__()
                if int(start["status"]) in REFUSAL_STATUSES:  # (its body tells what it means)
                    stream = ReadAhead(stream)
                    body = await stream.read(MAX_REFUSAL_BYTES)
            except asyncio.CancelledError:
                stream.cancel()  # the client left before the replica answered
                raise
            except Exception as err:  # noqa: BLE001 - a replica that died before answering
                if not should_retry(None, b"", num_tries, self._max_tries):
                    return _unavailable(err)
                logger.warning("a replica failed before answering, trying another: %s", err)
                continue
            if not should_retry(int(start["status"]), body, num_tries, self._max_tries):
                return start, stream
            stream.cancel()
            refused_by.append(str(start["replica_id"]))


def ingress_class(config: ServerConfig | None = None) -> type:
    """The ingress deployment's class with its FastAPI app, guarded by `config`'s API keys as
    `tokenflow serve` is guarded (`RequireApiKey`): 401 for a request without an accepted key
    on every route but those `serve` leaves open (`auth.unguarded_paths`), the ingress's own
    too, from its headers, before its body is read.  Built here, not at import, so Ray
    pickles the app with the class (an app imported afresh in the replica would lack the
    routes' `self`)."""
    config = config or ServerConfig()
    app = FastAPI(title="TokenFlow replicas", docs_url=None, redoc_url=None)
    keys, unguarded = ApiKeys(config.allowed_keys), unguarded_paths(config.public_metrics)
    app.add_middleware(RequireApiKey, keys=keys, on_refused=_uncounted, open_paths=unguarded)

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


def _unavailable(err: BaseException) -> JSONResponse:
    message = f"no replica could serve the request: {type(err).__name__}"
    error = {"message": message, "type": "server_error", "code": 503}
    return JSONResponse({"error": error}, status_code=503, headers={"Retry-After": "1"})
