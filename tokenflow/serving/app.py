"""The HTTP routes: thin wrappers around `OpenAIServing`, plus /v1/models, /health, /metrics and
vLLM's tokenizer routes (/tokenize, /detokenize, /tokenizer_info).

`build_app()` makes a fresh app per engine (no global app object); everything the routes need
lives on `app.state`.  Every error, including FastAPI's own validation errors (never a 422) and
unknown routes, is answered in OpenAI's `{"error": {...}}` shape.  Request bodies larger than
`ServerConfig.max_body_bytes` are refused (413) before they are read in full or parsed.

Streams are sse-starlette's `EventSourceResponse`: `data: {json}\n\n` frames, the 200 headers
sent at once, with `ServerConfig.keepalive_s` a `: keep-alive` comment that often (so proxies
with read timeouts keep a stream that waits for its first token or is paused; off by default,
as OpenAI and vLLM send none and some clients' parsers lose the events after a comment), and
the client's disconnect noticed while the stream waits.  While the server drains (see
`drain.py`) /health and every /v1 route answer 503.

`/v1/tokenflow/streams` (streams.py) shows what the scheduler does, behind the /v1 guards;
`/dashboard` (dashboard.py) is a page that draws it.  Under a server, the app's lifespan logs
vLLM's stats line (stats_log.py) unless `ServerConfig.disable_log_stats`.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Awaitable, Sequence
from contextlib import AbstractAsyncContextManager
from typing import Annotated, Any

from fastapi import APIRouter, Depends, FastAPI, Header, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from pydantic import BaseModel
from sse_starlette import EventSourceResponse, ServerSentEvent
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tokenflow.engine.client import EngineClient
from tokenflow.serving.auth import (
    ApiKeys,
    RequireApiKey,
    bearer_token,
    unguarded_paths,
)
from tokenflow.serving.choices import EventStream
from tokenflow.serving.classes import Stated
from tokenflow.serving.config import ServerConfig
from tokenflow.serving.dashboard import dashboard_router
from tokenflow.serving.drain import DRAIN_RETRY_AFTER_S, CountInFlight, Drain
from tokenflow.serving.metrics import ServingMetrics
from tokenflow.serving.moves import MOVE_HEADER, MoveBook, MoveTicket
from tokenflow.serving.openai_serving import (
    STREAM_CLASS_HEADER,
    STREAM_PACING_HEADER,
    STREAM_RATE_HEADER,
    OpenAIServing,
)
from tokenflow.serving.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorInfo,
    ErrorResponse,
    ModelCard,
    ModelList,
    RateTps,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
    TokenizerInfo,
)
from tokenflow.serving.responder import ClientDisconnected, ServeResult, WaitForDisconnect
from tokenflow.serving.stats_log import StatsLog, logging_stats
from tokenflow.serving.streams import StreamsWatch, streams_router
from tokenflow.serving.tenants import KeyGate
from tokenflow.serving.validation import ApiError, check_token_ids

logger = logging.getLogger(__name__)

# nginx-style "client closed request": logged, never seen by the (gone) client.
CLIENT_CLOSED_STATUS = 499
SSE_HEADERS = {"Cache-Control": "no-cache"}  # sse-starlette adds X-Accel-Buffering: no
# The keep-alive is a bare blank line, not an SSE comment (`: keep-alive`): every SSE parser
# skips an empty line, while `vllm bench serve` strips each network read before splitting it
# into events, so a comment at the end of a read lost its separator and swallowed every later
# event of the stream.
KEEPALIVE = b"\n"

_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "none"})
_SOURCES = frozenset({"body", "header", "query"})  # where FastAPI found a value, not its name

RateHeader = Annotated[RateTps | None, Header(alias=STREAM_RATE_HEADER)]
ClassHeader = Annotated[str | None, Header(alias=STREAM_CLASS_HEADER, max_length=16)]
PacingHeader = Annotated[bool | None, Header(alias=STREAM_PACING_HEADER)]  # true / false


def build_app(
    engine: EngineClient,
    config: ServerConfig | None = None,
    drain: Drain | None = None,
    moves: MoveBook | None = None,
) -> FastAPI:
    """An OpenAI-compatible streaming server over `engine` (`config.allowed_keys` guard every
    route but /health, /dashboard and, with `config.public_metrics`, /metrics);
    `drain` is begun by whoever stops the server (`tokenflow serve` on SIGTERM/SIGINT);
    `moves`, a fleet replica's book of streams that move (serving/moves.py), makes the
    requests its ingress marks movable (without it the mark is ignored)."""
    config = config or ServerConfig()
    drain = drain or Drain()
    # No /docs or /redoc: their pages load JavaScript from a CDN; /openapi.json stays.
    app = FastAPI(
        title="TokenFlow",
        summary="Buffer-aware LLM text streaming server",
        docs_url=None,
        redoc_url=None,
        lifespan=_lifespan,
    )
    metrics = ServingMetrics(engine)
    app.state.engine = engine
    app.state.config = config
    app.state.metrics = metrics
    app.state.drain = drain
    app.state.moves = moves
    app.state.serving = OpenAIServing(
        engine,
        metrics,
        class_rules=config.class_rules,
        tool_call_parser=config.auto_tool_call_parser,
        # Each key's work in flight bounded, and the engine's slots shared between keys.
        key_gate=KeyGate(config.key_limits(engine.max_num_requests or 0)),
        drain=drain,  # a paced stream sends what it holds once the drain begins
        model_names=config.served_model_names,
    )
    app.state.streams_watch = StreamsWatch(engine, metrics)
    app.state.stats_log = None if config.disable_log_stats else StatsLog(engine, metrics.vllm)
    app.state.started_s = int(time.time())
    _add_error_handlers(app)
    app.include_router(_openai_router())
    app.include_router(streams_router(), prefix="/v1", dependencies=_v1_guards())
    app.include_router(_tokenizer_router())
    app.include_router(_ops_router())
    app.include_router(dashboard_router())
    app.add_middleware(_BodyLimit, max_bytes=config.max_body_bytes)
    # Outside the body limit: a request without a key is refused before its body is read.
    keys = ApiKeys(config.allowed_keys)
    unguarded = unguarded_paths(config.public_metrics)
    app.add_middleware(
        RequireApiKey, keys=keys, on_refused=metrics.count_http_error, open_paths=unguarded
    )
    app.add_middleware(CountInFlight, drain=drain)  # outermost: counts until the last byte
    return app


def _lifespan(app: FastAPI) -> AbstractAsyncContextManager[None]:
    """While the server runs: the periodic stats line, where the config keeps it."""
    return logging_stats(app.state.stats_log)


# -- routes -------------------------------------------------------------------------------------
async def _check_not_draining(request: Request) -> None:
    if request.app.state.drain.is_draining:
        raise ApiError(
            503,
            "the server is shutting down; retry on another replica",
            type="server_error",
            code="server_shutting_down",
            headers={"Retry-After": str(DRAIN_RETRY_AFTER_S)},
        )


def _stated(
    request: Request, rate_tps: float | None, stream_class: str | None, pacing: bool | None
) -> Stated:
    """What the headers say of the request's class: rate, class, the bearer token, pacing."""
    api_key = bearer_token(request.headers.get("authorization"))
    return Stated(rate_tps, stream_class, api_key, pacing)


def _move_ticket(request: Request) -> MoveTicket | None:
    """The fleet ingress's ticket for this answer, where this app keeps a book of moves."""
    book: MoveBook | None = request.app.state.moves
    ticket = request.headers.get(MOVE_HEADER)
    return None if book is None or not ticket else MoveTicket(ticket, book)


def _v1_guards() -> list[Any]:
    """What every /v1 route checks first: not draining (the API key was checked before the
    body was read: `auth.RequireApiKey`)."""
    return [Depends(_check_not_draining)]


def _openai_router() -> APIRouter:
    router = APIRouter(prefix="/v1", dependencies=_v1_guards())

    @router.post("/completions")
    async def create_completion(
        body: CompletionRequest,
        request: Request,
        x_stream_rate: RateHeader = None,
        x_stream_class: ClassHeader = None,
        x_stream_pacing: PacingHeader = None,
    ) -> Response:
        """OpenAI completions; `stream_rate` (or X-Stream-Rate) is the reader's tokens/s,
        `stream_class` (or X-Stream-Class) its class (serving/classes.py), `stream_pacing`
        (or X-Stream-Pacing) whether its tokens are sent at that rate (serving/pacing.py)."""
        serving: OpenAIServing = request.app.state.serving
        stated = _stated(request, x_stream_rate, x_stream_class, x_stream_pacing)
        wait, ticket = _disconnect_waiter(request), _move_ticket(request)
        result = await _or_disconnected(serving.create_completion(body, stated, wait, ticket))
        return _to_response(result, request.app.state.config)

    @router.post("/chat/completions")
    async def create_chat_completion(
        body: ChatCompletionRequest,
        request: Request,
        x_stream_rate: RateHeader = None,
        x_stream_class: ClassHeader = None,
        x_stream_pacing: PacingHeader = None,
    ) -> Response:
        """OpenAI chat completions; the class, rate and pacing as for completions."""
        serving: OpenAIServing = request.app.state.serving
        stated = _stated(request, x_stream_rate, x_stream_class, x_stream_pacing)
        wait, ticket = _disconnect_waiter(request), _move_ticket(request)
        result = await _or_disconnected(serving.create_chat_completion(body, stated, wait, ticket))
        return _to_response(result, request.app.state.config)

    @router.get("/models")
    async def list_models(request: Request) -> Response:
        """The one model this server runs, a card for each name it is served under."""
        serving: OpenAIServing = request.app.state.serving
        cards = [_model_card(request, name) for name in serving.model_names]
        return _json(ModelList(data=cards).model_dump_json())

    @router.get("/models/{model_id:path}")
    async def retrieve_model(model_id: str, request: Request) -> Response:
        """The model card of `model_id`; 404 (OpenAI's shape) for any other id."""
        serving: OpenAIServing = request.app.state.serving
        serving.check_model(model_id)
        return _json(_model_card(request, model_id).model_dump_json())

    return router


def _model_card(request: Request, name: str) -> ModelCard:
    engine: EngineClient = request.app.state.engine
    return ModelCard(
        id=name,
        created=request.app.state.started_s,
        max_model_len=engine.max_model_len,
        kernels=engine.kernels,
    )


def _tokenizer_router() -> APIRouter:
    """vLLM's /tokenize, /detokenize and /tokenizer_info (lm-eval's remote tokenizer)."""
    router = APIRouter(dependencies=_v1_guards())

    @router.post("/tokenize")
    async def tokenize(
        body: TokenizeCompletionRequest | TokenizeChatRequest, request: Request
    ) -> Response:
        """A prompt's token ids, or the messages' through the chat template."""
        serving: OpenAIServing = request.app.state.serving
        serving.check_model(body.model)
        if isinstance(body, TokenizeChatRequest):
            ids = await serving.apply_chat_template(body.messages, body.add_generation_prompt)
        else:
            ids = await serving.tokenize(body.prompt, body.add_special_tokens)
        engine: EngineClient = request.app.state.engine
        answer = TokenizeResponse(count=len(ids), max_model_len=engine.max_model_len, tokens=ids)
        return _json(answer.model_dump_json())

    @router.post("/detokenize")
    async def detokenize(body: DetokenizeRequest, request: Request) -> Response:
        """The text of token ids."""
        serving: OpenAIServing = request.app.state.serving
        serving.check_model(body.model)
        engine: EngineClient = request.app.state.engine
        ids = check_token_ids(body.tokens, engine.vocab_size, "tokens")
        return _json(DetokenizeResponse(prompt=engine.tokenizer.decode(ids)).model_dump_json())

    @router.get("/tokenizer_info")
    async def tokenizer_info(request: Request) -> Response:
        """The special tokens and the chat template."""
        engine: EngineClient = request.app.state.engine
        tokenizer = engine.tokenizer
        info = TokenizerInfo(
            eos_token=tokenizer.eos_token,
            bos_token=tokenizer.bos_token,
            chat_template=tokenizer.chat_template,
            model_max_length=engine.max_model_len,
            vocab_size=engine.vocab_size,
        )
        return _json(info.model_dump_json())

    return router


def _ops_router() -> APIRouter:
    router = APIRouter()

    @router.get("/health")
    async def health(request: Request) -> Response:
        """200 while the engine loop is alive and turning and the server is not draining; 503
        (with the reason) otherwise.  Both tell how many /v1 requests are in flight."""
        engine: EngineClient = request.app.state.engine
        drain: Drain = request.app.state.drain
        state = engine.health()
        body: dict[str, object] = {"status": "ok"}
        if drain.is_draining:
            body = {"status": "draining"}
        elif not state.is_alive:
            body = {"status": "dead"}  # why is in the server log, not for every prober
        elif state.seconds_since_tick > request.app.state.config.health_stall_s:
            body = {"status": "stalled", "seconds_since_tick": round(state.seconds_since_tick, 1)}
        body["num_in_flight"] = drain.num_in_flight
        return _json(json.dumps(body), 200 if body["status"] == "ok" else 503)

    @router.get("/metrics")
    async def metrics(request: Request) -> Response:
        """Prometheus exposition of this app's registry; the capacity gauges from a fresh
        scheduler snapshot when the engine answers within a second."""
        await request.app.state.streams_watch.refresh_gauges()
        content, content_type = request.app.state.metrics.render()
        return Response(content=content, media_type=content_type)

    return router


def _disconnect_waiter(request: Request) -> WaitForDisconnect:
    """Waits for the ASGI `http.disconnect` (the body has already been read by then)."""

    async def wait_for_disconnect() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    return wait_for_disconnect


async def _or_disconnected(serve: Awaitable[ServeResult]) -> ServeResult | None:
    try:
        return await serve
    except ClientDisconnected:
        return None


def _to_response(result: ServeResult | None, config: ServerConfig) -> Response:
    if result is None:
        return Response(status_code=CLIENT_CLOSED_STATUS)
    if isinstance(result, BaseModel):
        return _json(result.model_dump_json())
    return _SseResponse(result, config.keepalive_s, config.send_timeout_s)


class _SseResponse(EventSourceResponse):
    """Sends an `EventStream` as SSE frames (a keep-alive every `keepalive_s`, 0: none; a
    send stuck for `send_timeout_s` ends it, 0: never), and always closes it, even when the
    client left before the first event was pulled (then the engine request is aborted)."""

    def __init__(self, stream: EventStream, keepalive_s: float, send_timeout_s: float) -> None:
        super().__init__(
            stream,
            headers=SSE_HEADERS,
            ping=keepalive_s,
            sep="\n",  # OpenAI's framing: `data: {json}\n\n`
            ping_message_factory=_keepalive,
            send_timeout=send_timeout_s or None,
        )
        self._stream = stream

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._stream.aclose()


def _keepalive() -> ServerSentEvent:
    return ServerSentEvent(sep="\n")  # no field: encodes to KEEPALIVE, the blank line alone


def _json(content: str, status_code: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(content, status_code, headers, media_type="application/json")


class _BodyLimit:
    """ASGI middleware: 413 for a body over `max_bytes`, by its Content-Length before anything
    is read, or as soon as a body without one (chunked) grows past the limit.  The body is read
    here (at most `max_bytes`) and replayed to the app, then `receive` passes through."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_bytes):
            await self._refuse(receive, send)
            return
        buffered: list[Message] = []
        num_bytes = 0
        while True:
            message = await receive()
            buffered.append(message)
            if message["type"] != "http.request":
                break
            num_bytes += len(message.get("body", b""))
            if num_bytes > self.max_bytes:
                await self._refuse(receive, send, more_body=message.get("more_body", False))
                return
            if not message.get("more_body", False):
                break

        async def replay() -> Message:
            return buffered.pop(0) if buffered else await receive()

        await self.app(scope, replay, send)

    async def _refuse(self, receive: Receive, send: Send, more_body: bool = True) -> None:
        """Answer 413.  The rest of the body is read and dropped first (up to 8x the limit), so
        a client still sending it can read the answer instead of a reset connection."""
        num_dropped = 0
        while more_body and num_dropped <= 8 * self.max_bytes:
            message = await receive()
            num_dropped += len(message.get("body", b""))
            more_body = message["type"] == "http.request" and message.get("more_body", False)
        error = ApiError(413, f"the request body exceeds {self.max_bytes} bytes", code="too_large")
        await error.send_raw(send, [(b"connection", b"close")])


# -- errors -------------------------------------------------------------------------------------
def _error_response(
    request: Request, status_code: int, info: ErrorInfo, headers: dict[str, str] | None = None
) -> Response:
    request.app.state.metrics.count_http_error(status_code)
    # uvicorn's access log shows only the status; the reason is what an operator needs.
    logger.info(
        "%s %s -> %d %s: %s", request.method, request.url.path, status_code, info.type, info.message
    )
    return _json(ErrorResponse(error=info).model_dump_json(), status_code, headers)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """The first error as one line, and the offending parameter's name."""
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    first = _most_telling(errors)
    if first.get("type") == "json_invalid":
        return f"malformed JSON body: {first.get('ctx', {}).get('error', 'cannot parse')}", None
    loc = [str(part) for part in first.get("loc", ()) if part not in _SOURCES]
    param = loc[0] if loc else None
    where = ".".join(part for part in loc if not _is_type_tag(part)) or "body"
    more = f" (and {len(errors) - 1} more errors)" if len(errors) > 1 else ""
    return f"{where}: {first.get('msg', 'invalid value')}{more}", param


def _most_telling(errors: Sequence[Any]) -> Any:
    """The first error, or, where a union's members each failed on that same parameter, the
    first that is not a wrong type (`stop: [...100 strings]` is too long, not "not a string")."""
    first = errors[0]
    same_param = [e for e in errors if e.get("loc", ())[:2] == first.get("loc", ())[:2]]
    telling = [e for e in same_param if not str(e.get("type", "")).endswith("_type")]
    return telling[0] if telling else first


def _is_type_tag(part: str) -> bool:
    """pydantic's union-member tags in an error's path ("str", "list[int]", "constrained-str")."""
    return part in _TYPE_TAGS or "[" in part or part.startswith("constrained-")


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def on_api_error(request: Request, exc: ApiError) -> Response:
        return _error_response(request, exc.status_code, exc.info, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, exc: RequestValidationError) -> Response:
        message, param = _validation_message(exc)
        info = ErrorInfo(message=message, type="invalid_request_error", param=param)
        return _error_response(request, 400, info)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException) -> Response:
        info = ErrorInfo(message=str(exc.detail), type="invalid_request_error")
        return _error_response(request, exc.status_code, info, dict(exc.headers or {}))

    @app.exception_handler(Exception)
    async def on_unexpected(request: Request, exc: Exception) -> Response:
        info = ErrorInfo(message=f"internal error: {type(exc).__name__}", type="server_error")
        return _error_response(request, 500, info)
