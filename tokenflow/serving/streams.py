"""`GET /v1/tokenflow/streams`: what the scheduler does, stream by stream.

The answer is the engine's `StreamsSnapshot` (tokenflow/engine/snapshot.py) as JSON: the most
urgent `limit` streams (smallest slack first), totals over all of them, the engine's capacity
Gamma against the started streams' reading demand, KV blocks per tier (used, and keyed by the
prefix cache), the prefix cache's lookups and hits, and the latest moves.

Every caller goes through one `StreamsWatch` per app: it takes at most one snapshot per
`SNAPSHOT_INTERVAL_S` and shares it, so however many dashboards poll (and /metrics scrapes),
the engine loop answers at most a few snapshot commands a second, between its steps.

Where the server has keys, a key sees its own streams only (`owners.StreamOwners` knows which
key sent each one, while it is in flight): the `limit` most urgent of them among the server's
`MAX_LIMIT` most urgent (a stream released since the shared snapshot was taken is no longer
listed).  An admin key (`--admin-api-key`) sees every stream, and so does everyone on an open
server.  The totals, Gamma, the demand, the KV tiers and the moves are the whole server's for
every caller: they tell how loaded it is, not whose streams are there.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Annotated, Literal

from fastapi import APIRouter, Query, Request
from fastapi.responses import Response
from pydantic import BaseModel

from tokenflow.engine.client import EngineClient, EngineDead
from tokenflow.engine.snapshot import StreamRow, StreamsSnapshot
from tokenflow.serving.auth import ApiKeys, bearer_token
from tokenflow.serving.config import ServerConfig
from tokenflow.serving.metrics import ServingMetrics
from tokenflow.serving.owners import StreamOwners
from tokenflow.serving.validation import ApiError

DEFAULT_LIMIT = 64  # streams listed when the query does not say
MAX_LIMIT = 512  # the most one answer lists (the totals always count every stream)
SNAPSHOT_INTERVAL_S = 0.25  # a snapshot younger than this is shared, not taken again
SNAPSHOT_TIMEOUT_S = 10.0  # an engine that does not answer in this long is a 503
METRICS_WAIT_S = 1.0  # /metrics renders the last capacity it has after this long

StreamStateName = Literal["waiting", "running", "loading", "paused"]


class StreamInfo(BaseModel):
    """One unfinished request; times in seconds, None where a number has no meaning."""

    id: str
    stream_class: Literal["reader", "eager", "batch"]
    rate_tps: float | None  # None: eager or batch (reads each token at once)
    state: StreamStateName
    kv_on_host: bool  # paused with its KV in the host tier (resumes by a load)
    # Why it is off the device: queued (admission holds it), buffered (paused while its reader
    # reads its buffer), overload (left out of the served set), memory; None while on it.
    wait_reason: Literal["queued", "buffered", "overload", "memory"] | None
    num_output_tokens: int
    num_consumed_tokens: int  # by the reader model
    buffer_s: float | None  # seconds of reading buffered; None unless a reader
    slack_s: float  # until the reader wants a token not generated yet (<= 0: stalling)
    ttft_s: float | None  # None before the first token
    stall_s: float | None  # stalls so far; None unless a reader with a token
    age_s: float
    num_preemptions: int


class StreamTotals(BaseModel):
    num_unfinished: int
    num_waiting: int
    num_running: int
    num_loading: int
    num_paused: int


class KVBlocks(BaseModel):
    device_used_blocks: int
    device_total_blocks: int
    device_cached_blocks: int  # keyed by the prefix cache, held or cached-free
    host_used_blocks: int
    host_total_blocks: int
    host_cached_blocks: int


class PrefixCacheTotals(BaseModel):
    """Prompt tokens looked up in the prefix cache since start, and those found per tier."""

    queried_tokens_total: int
    device_hit_tokens_total: int
    host_hit_tokens_total: int
    hit_rate: float | None  # hits of both tiers / queried; None before any lookup


class LastMoves(BaseModel):
    """The latest step that moved streams."""

    seconds_ago: float
    num_preemptions: int
    num_starts: int  # waiting requests started
    num_loads: int  # paused streams resumed by loading their KV
    num_recomputes: int  # paused streams resumed by recomputing it


class StreamsResponse(BaseModel):
    object: Literal["tokenflow.streams"] = "tokenflow.streams"
    policy: str
    capacity_tps: float | None  # Gamma; None only if the estimate is not a finite number
    demand_tps: float  # what the started streams ask (`Capacity.demand_tps`)
    asked_tps: float  # the same over every unfinished request, waiting ones too
    is_overloaded: bool  # asked_tps above Gamma: some readers cannot be served at their rate
    num_readers: int  # unfinished readers
    num_served_readers: int  # of them, on the device
    totals: StreamTotals
    kv: KVBlocks
    prefix_cache: PrefixCacheTotals
    num_preemptions_total: int
    num_loads_total: int
    num_recomputes_total: int
    last_moves: LastMoves | None
    streams: list[StreamInfo]  # the most urgent first


def finite_or_none(value: float | None) -> float | None:
    """`value` where it is a finite number, else None (JSON has no infinity)."""
    return value if value is not None and math.isfinite(value) else None


def prefix_hit_rate(num_queried_tokens: int, num_hit_tokens: int) -> float | None:
    """The share of looked-up prompt tokens found cached (vLLM's prefix cache hit rate: hits
    over queries); None before any lookup."""
    return num_hit_tokens / num_queried_tokens if num_queried_tokens > 0 else None


def prefix_cache_totals(snapshot: StreamsSnapshot) -> PrefixCacheTotals:
    """The prefix cache's lookups and hits per tier since start, for the wire."""
    s = snapshot
    num_hit_tokens = s.num_prefix_hit_tokens + s.num_prefix_host_hit_tokens
    return PrefixCacheTotals(
        queried_tokens_total=s.num_prefix_queried_tokens,
        device_hit_tokens_total=s.num_prefix_hit_tokens,
        host_hit_tokens_total=s.num_prefix_host_hit_tokens,
        hit_rate=prefix_hit_rate(s.num_prefix_queried_tokens, num_hit_tokens),
    )


def stream_info(stream: StreamRow) -> StreamInfo:
    """One stream for the wire."""
    return StreamInfo(
        id=stream.request_id,
        stream_class=stream.consumption.value,
        rate_tps=finite_or_none(stream.rate_tps),
        state=stream.state,  # type: ignore[arg-type]  (a value of engine.streams.STATE_NAMES)
        kv_on_host=stream.is_kv_on_host,
        wait_reason=stream.wait_reason,  # type: ignore[arg-type]  (a value of WaitReason)
        num_output_tokens=stream.num_output_tokens,
        num_consumed_tokens=stream.num_consumed_tokens,
        buffer_s=finite_or_none(stream.buffered_s),
        slack_s=stream.slack_s,
        ttft_s=stream.ttft_s,
        stall_s=stream.stalled_s,
        age_s=stream.age_s,
        num_preemptions=stream.num_preemptions,
    )


def streams_response(snapshot: StreamsSnapshot) -> StreamsResponse:
    """The snapshot for the wire."""
    s = snapshot
    moves = s.last_moves
    last_moves = None
    if moves is not None:
        last_moves = LastMoves(
            seconds_ago=max(s.taken_s - moves.at_s, 0.0),
            num_preemptions=moves.num_preemptions,
            num_starts=moves.num_starts,
            num_loads=moves.num_loads,
            num_recomputes=moves.num_recomputes,
        )
    return StreamsResponse(
        policy=s.policy,
        capacity_tps=finite_or_none(s.capacity_tps),
        demand_tps=s.demand_tps,
        asked_tps=s.asked_tps,
        is_overloaded=s.asked_tps > s.capacity_tps,
        num_readers=s.num_readers,
        num_served_readers=s.num_served_readers,
        totals=StreamTotals(
            num_unfinished=s.num_waiting + s.num_running + s.num_loading + s.num_paused,
            num_waiting=s.num_waiting,
            num_running=s.num_running,
            num_loading=s.num_loading,
            num_paused=s.num_paused,
        ),
        kv=KVBlocks(
            device_used_blocks=s.num_device_blocks_used,
            device_total_blocks=s.num_device_blocks,
            device_cached_blocks=s.num_cached_device_blocks,
            host_used_blocks=s.num_host_blocks_used,
            host_total_blocks=s.num_host_blocks,
            host_cached_blocks=s.num_cached_host_blocks,
        ),
        prefix_cache=prefix_cache_totals(s),
        num_preemptions_total=s.num_preemptions_total,
        num_loads_total=s.num_loads_total,
        num_recomputes_total=s.num_recomputes_total,
        last_moves=last_moves,
        streams=[stream_info(stream) for stream in s.streams],
    )


@dataclass(frozen=True)
class _Taken:
    snapshot: StreamsSnapshot
    limit: int
    at_s: float  # on the watch's clock


class StreamsWatch:
    """At most one engine snapshot per `interval_s`, shared by every caller; each one taken
    also sets the capacity and demand gauges of /metrics."""

    def __init__(
        self,
        engine: EngineClient,
        metrics: ServingMetrics,
        interval_s: float = SNAPSHOT_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._engine = engine
        self._metrics = metrics
        self._interval_s = interval_s
        self._clock = clock
        self._lock = asyncio.Lock()
        self._taken: _Taken | None = None
        self.num_taken = 0

    async def latest(self, limit: int) -> StreamsSnapshot:
        """A snapshot at most `interval_s` old listing up to `limit` streams; ApiError 503 when
        the engine is gone or does not answer."""
        async with self._lock:
            taken = self._taken
            if taken is None or not self._serves(taken, limit):
                snapshot = await self._take(limit)
                taken = _Taken(snapshot=snapshot, limit=limit, at_s=self._clock())
                self._taken = taken
        return taken.snapshot.top(limit)

    def _serves(self, taken: _Taken, limit: int) -> bool:
        """Whether `taken` is fresh enough and lists enough streams for `limit`."""
        return taken.limit >= limit and self._clock() - taken.at_s < self._interval_s

    async def refresh_gauges(self, wait_s: float = METRICS_WAIT_S) -> None:
        """Refresh the capacity gauges if the engine answers within `wait_s` (else they keep
        their last values: a scrape never waits long on a busy or dead engine)."""
        with contextlib.suppress(ApiError, TimeoutError):
            await asyncio.wait_for(self.latest(0), wait_s)

    async def _take(self, limit: int) -> StreamsSnapshot:
        try:
            snapshot = await asyncio.wait_for(self._engine.streams(limit), SNAPSHOT_TIMEOUT_S)
        except EngineDead as err:
            raise ApiError(503, f"the engine is not running: {err}", type="server_error") from None
        except TimeoutError:
            message = f"the engine did not answer within {SNAPSHOT_TIMEOUT_S:g} s"
            raise ApiError(503, message, type="server_error") from None
        self.num_taken += 1
        self._metrics.observe_capacity(
            snapshot.capacity_tps, snapshot.demand_tps, snapshot.asked_tps
        )
        return snapshot


@dataclass(frozen=True)
class Viewer:
    """Which streams a caller is shown: every one, or only those its key sent."""

    sees_all: bool
    api_key: str | None = None  # the caller's key (None: no key, so no stream is its own)


def viewer_of(config: ServerConfig, authorization: str | None) -> Viewer:
    """Who a caller with this Authorization header is: on an open server, or with an admin
    key, one who sees every stream; else the owner of its key's streams."""
    token = bearer_token(authorization)
    if not config.allowed_keys or ApiKeys(config.admin_api_keys).holds(token):
        return Viewer(sees_all=True)
    return Viewer(sees_all=False, api_key=token)


def owned_only(
    snapshot: StreamsSnapshot, owners: StreamOwners, api_key: str | None, limit: int
) -> StreamsSnapshot:
    """The snapshot listing only the `limit` most urgent of `api_key`'s streams."""
    owned = tuple(s for s in snapshot.streams if owners.is_owned_by(s.request_id, api_key))
    return replace(snapshot, streams=owned[:limit])


def streams_router() -> APIRouter:
    """The route; the app mounts it under /v1 with the /v1 guards (API key, drain)."""
    router = APIRouter()

    @router.get("/tokenflow/streams")
    async def list_streams(
        request: Request,
        limit: Annotated[int, Query(ge=0, le=MAX_LIMIT)] = DEFAULT_LIMIT,
    ) -> Response:
        """Every unfinished stream's buffer and state (the `limit` most urgent; a key that is
        not an admin's sees its own streams only), the totals, Gamma against the reading
        demand, the KV tiers and the latest moves."""
        watch: StreamsWatch = request.app.state.streams_watch
        viewer = viewer_of(request.app.state.config, request.headers.get("authorization"))
        if viewer.sees_all:
            snapshot = await watch.latest(limit)
        else:
            owners = request.app.state.serving.stream_owners
            snapshot = owned_only(await watch.latest(MAX_LIMIT), owners, viewer.api_key, limit)
        body = streams_response(snapshot).model_dump_json()
        return Response(body, media_type="application/json")

    return router
