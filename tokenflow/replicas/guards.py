"""What the ingress checks of a request's body before any replica sees it, when it offers a
refused request to another replica (`should_retry`: a full or draining replica's refusal, never
a per-key limit's), and what a replica's health is.

The ingress is the one process every stream passes through, so no client may make it do more
than a request's worth of work: its API key is checked from the headers before the body is read
(`tokenflow.serving.auth.RequireApiKey`, as `tokenflow serve` checks it), the body is read up to
--max-body-bytes and no further, and a body that is not a JSON object is a 400 (never a 500).
Errors have the `{"error": {...}}` shape `tokenflow serve` answers with (`ApiError`).

Nothing here imports Ray or torch: the ingress stays light, and tests run without a cluster.
(`tokenflow.serving.app`, whose body limit the server uses, imports the engine and torch.)
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from starlette.requests import Request
from starlette.responses import Response

from tokenflow.serving.validation import ApiError

if TYPE_CHECKING:  # (tokenflow.engine imports torch, which the ingress never needs)
    from tokenflow.engine.client import EngineHealth

# A replica's refusals: full (429) or a limit reached (429), draining or its engine loop gone
# (503).  Nothing of the request was generated; whether another replica may take it is
# `can_go_elsewhere`'s to say, from the refusal's body.
REFUSAL_STATUSES = frozenset({429, 503})
MAX_TRIES = 3  # replicas one request is offered to before the last refusal passes through
# The error type of a 429 that says the replica's engine is full (`EngineOverloaded`, or a wait
# for its share of the engine past its timeout); a per-key limit's is "rate_limit_error".
ENGINE_FULL_TYPE = "server_overloaded"
MAX_REFUSAL_BYTES = 16 << 10  # of a refusal's body read to tell what it means (an error: < 1 KiB)


def too_large(max_bytes: int) -> ApiError:
    """The 413 `tokenflow serve` answers for a body over --max-body-bytes."""
    return ApiError(413, f"the request body exceeds {max_bytes} bytes", code="too_large")


async def read_body(request: Request, max_bytes: int) -> bytes:
    """The body, read chunk by chunk as it arrives; ApiError(413) as soon as its Content-Length
    or what has arrived exceeds `max_bytes`, so an oversized body is never held whole."""
    length = request.headers.get("content-length")
    if length is not None and (not length.isdigit() or int(length) > max_bytes):
        raise too_large(max_bytes)
    chunks: list[bytes] = []
    num_bytes = 0
    async for chunk in request.stream():
        num_bytes += len(chunk)
        if num_bytes > max_bytes:
            raise too_large(max_bytes)
        chunks.append(chunk)
    return b"".join(chunks)


def parse_body(body: bytes) -> dict[str, object]:
    """The body as a JSON object ({} when empty); ApiError(400) for anything else, including
    what makes the parser itself fail (invalid UTF-8, nesting too deep for the stack).  Its
    size is bounded by `read_body`, so the parse is too."""
    if not body:
        return {}
    try:
        parsed = json.loads(body)
    except (ValueError, RecursionError) as err:  # (UnicodeDecodeError is a ValueError)
        reason = "nested too deeply" if isinstance(err, RecursionError) else str(err)
        raise ApiError(400, f"malformed JSON body: {reason}") from None
    if not isinstance(parsed, dict):
        raise ApiError(400, f"the body must be a JSON object, got {type(parsed).__name__}")
    return parsed


def error_response(error: ApiError) -> Response:
    """An ApiError as the ingress's answer."""
    content = error.body().model_dump_json()
    return Response(content, error.status_code, error.headers, media_type="application/json")


def can_go_elsewhere(status: int | None, body: bytes = b"") -> bool:
    """Whether another replica may take a request that one answered with `status` and `body`
    (None: it failed before answering): a 503 (draining, its engine loop gone) or a 429 whose
    error type says its engine is full (`ENGINE_FULL_TYPE`) may; any other 429 may not, above
    all a per-key limit's (code "rate_limit_exceeded", type "rate_limit_error"): offered to
    the next replica, a key would get its limit once per replica."""
    if status is None or status == 503:
        return True
    return status == 429 and _error_type(body) == ENGINE_FULL_TYPE


def should_retry(
    status: int | None, body: bytes, num_tries: int, max_tries: int = MAX_TRIES
) -> bool:
    """Whether to offer a request to another replica after its `num_tries`-th replica answered
    `status` with `body` (`can_go_elsewhere`).  Bounded, so a fleet that is full everywhere
    costs a request `max_tries` refusals, then the last one reaches the client."""
    return can_go_elsewhere(status, body) and num_tries < max_tries


def _error_type(body: bytes) -> str | None:
    """The `type` of an `{"error": {...}}` body; None for any other body."""
    try:
        parsed = json.loads(body)
    except (ValueError, RecursionError):
        return None
    error = parsed.get("error") if isinstance(parsed, dict) else None
    kind = error.get("type") if isinstance(error, dict) else None
    return kind if isinstance(kind, str) else None


def health_problem(health: EngineHealth, stall_s: float) -> str | None:
    """Why a replica is unhealthy, as `tokenflow serve`'s /health reads it: its engine loop
    died, or has not turned for more than `stall_s` (stuck in a step); None when healthy."""
    if not health.is_alive:
        return health.error or "the engine loop died"
    if health.seconds_since_tick > stall_s:
        return f"the engine loop has not turned for {health.seconds_since_tick:.1f} s"
    return None
