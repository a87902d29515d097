"""Who may use /v1, and how much of it: the allow-list of API keys, checked before a request's
body is read, and a bound on each key's requests in flight.

The keys come from `--api-key` (repeatable), `--api-key-file` (one key a line; blank lines and
`#` comments skipped) and the keys named by `--api-key-class`.  With no `--api-key` and no key
file the server is open: every request is served, and a key only picks a class rule.

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

PROTECTED_PREFIX = "/v1"


def bearer_token(authorization: str | None) -> str | None:
    """The token of an `Authorization: Bearer TOKEN` header (any case of "Bearer"), else None."""
    if not authorization:
        return None
    scheme, _, token = authorization.strip().partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


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
        return not self._keys

    def accepts(self, authorization: str | None) -> bool:
        """Whether a request with this Authorization header may use /v1."""
        if self.is_open:
            return True
        token = bearer_token(authorization)
        if token is None:
            return False
        given = token.encode()
        # Every key is compared, so the time taken does not tell which one came close.
        matches = [hmac.compare_digest(given, key) for key in self._keys]
        return any(matches)


class RequireApiKey:
    """ASGI middleware: 401 for a /v1 request whose bearer token is not on the list, answered
    from the headers before the body is read.  `on_refused(401)` counts it."""

    def __init__(self, app: ASGIApp, keys: ApiKeys, on_refused: Callable[[int], None]) -> None:
        self.app = app
        self.keys = keys
        self.on_refused = on_refused

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith(PROTECTED_PREFIX):
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


class LimitPerKey:
    """ASGI middleware: at most `limit` /v1 requests in flight per API key (a stream counts
    until its last byte), so one tenant cannot take every slot of the engine; the next gets
    429 with Retry-After, from the headers alone.  Requests without a key are not counted."""

    def __init__(self, app: ASGIApp, limit: int, on_refused: Callable[[int], None]) -> None:
        self.app = app
        self.limit = limit
        self.on_refused = on_refused
        self._in_flight: dict[str, int] = {}  # one event loop: no lock needed

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        key = None
        if scope["type"] == "http" and scope["path"].startswith(PROTECTED_PREFIX):
            key = bearer_token(dict(scope["headers"]).get(b"authorization", b"").decode("latin-1"))
        if key is None:
            await self.app(scope, receive, send)
            return
        if self._in_flight.get(key, 0) >= self.limit:
            self.on_refused(429)
            error = ApiError(
                429,
                f"this API key has {self.limit} requests in flight already",
                type="server_overloaded",
                code="rate_limit_exceeded",
                headers={"Retry-After": "1"},
            )
            await error.send_raw(send)
            return
        self._in_flight[key] = self._in_flight.get(key, 0) + 1
        try:
            await self.app(scope, receive, send)
        finally:
            self._in_flight[key] -= 1
            if not self._in_flight[key]:
                del self._in_flight[key]
