"""Who may use the server: the allow-list of API keys, checked before a request's body is
read.  How much of the engine each key may hold is `tenants.py`'s.

The keys come from `--api-key` (repeatable), `--api-key-file` (one key a line; blank lines and
`#` comments skipped), `--admin-api-key` and the keys named by `--api-key-class`.  With no key
at all the server is open: every request is served.  With keys, every route needs one but
`/health` (for probers), the `/dashboard` page (it holds no data: it reads the key from its
URL fragment and sends it to /v1/tokenflow/streams) and, with `--public-metrics`, `/metrics`
(`unguarded_paths`).

The check is an ASGI middleware rather than a route dependency, so that it runs on the headers
alone: a client without a key gets 401 before its body is read or parsed (a dependency would
only run after FastAPI parsed the body, so a malformed body without a key got a 400).  Keys are
compared in constant time (`hmac.compare_digest`, against every key), and the scheme is matched
without regard to case (`bearer` as well as `Bearer`, RFC 7235).
"""

from __future__ import annotations

import hmac
from collections.abc import Callable, Iterable
from pathlib import Path

from starlette.types import ASGIApp, Receive, Scope, Send

from tokenflow.serving.validation import ApiError

# Served without a key even where the server has keys: the liveness probe, and the dashboard's
# page (static, no data; its script sends the key it reads from `#key=` as a bearer token).
ALWAYS_OPEN_PATHS = frozenset({"/health", "/dashboard"})
METRICS_PATH = "/metrics"


def bearer_token(authorization: str | None) -> str | None:
    """The token of an `Authorization: Bearer TOKEN` header (any case of "Bearer"), else None."""
    if not authorization:
        return None
    scheme, _, token = authorization.strip().partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


def unguarded_paths(public_metrics: bool) -> frozenset[str]:
    """The paths served without a key on a server with keys (exact matches): `/health`,
    `/dashboard`, and `/metrics` where `--public-metrics` says so."""
    return (ALWAYS_OPEN_PATHS | {METRICS_PATH}) if public_metrics else ALWAYS_OPEN_PATHS


def read_key_file(path: str) -> tuple[str, ...]:
    """The keys of a key file (ValueError naming the file when it cannot be read)."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot read the API key file {path}: {exc}") from exc
    keys = tuple(line.strip() for line in lines if line.strip() and not line.startswith("#"))
    if not keys:
        raise ValueError(f"the API key file {path} holds no key")
    return keys


class ApiKeys:
    """The allow-list; empty means an open server."""

    def __init__(self, keys: Iterable[str]) -> None:
        self._keys = tuple(dict.fromkeys(k.encode() for k in keys))

    @property
    def is_open(self) -> bool:
        """Whether the list is empty (every request is served)."""
        return not self._keys

    def accepts(self, authorization: str | None) -> bool:
        """Whether a request with this Authorization header may use the server."""
        return self.is_open or self.holds(bearer_token(authorization))

    def holds(self, token: str | None) -> bool:
        """Whether `token` is one of the keys (never where the list is empty)."""
        if token is None:
            return False
        given = token.encode()
        # Every key is compared, so the time taken does not tell which one came close.
        matches = [hmac.compare_digest(given, key) for key in self._keys]
        return any(matches)


class RequireApiKey:
    """ASGI middleware: 401 for a request whose bearer token is not on the list, answered from
    the headers before the body is read, on every path but `open_paths` (exact matches; by
    default `/health` and the `/dashboard` page, which a browser loads without a bearer header
    and which holds no data: its script reads the key from `#key=` and sends it to
    /v1/tokenflow/streams).  `on_refused(401)` counts it."""

    def __init__(
        self,
        app: ASGIApp,
        keys: ApiKeys,
        on_refused: Callable[[int], None],
        open_paths: frozenset[str] = ALWAYS_OPEN_PATHS,
    ) -> None:
        self.app = app
        self.keys = keys
        self.on_refused = on_refused
        self.open_paths = open_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self.open_paths:
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        authorization = headers.get(b"authorization", b"").decode("latin-1")
        if self.keys.accepts(authorization):
            await self.app(scope, receive, send)
            return
        self.on_refused(401)
        error = ApiError(401, "Incorrect API key provided.", code="invalid_api_key")
        await error.send_raw(send, [(b"www-authenticate", b"Bearer")])
