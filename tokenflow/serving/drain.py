"""Graceful drain: once shutdown is asked for, refuse new work and let the answers in flight end.

`Drain` is shared by the process that stops (`tokenflow serve` begins it on SIGTERM/SIGINT and
waits for it) and the app (whose /health turns 503 and whose /v1 routes answer 503 with
Retry-After from the moment it began).  `CountInFlight` counts the /v1 requests whose answer is
not sent yet, so the wait ends when the last stream sent its `data: [DONE]`.

The HTTP server runs its own event loop in another thread than the one that waits, and `begin()`
is called from a signal handler: the state sits under one `threading.Condition`, whose lock is
reentrant, so a second signal arriving inside the first handler cannot deadlock.  A task on the
server's loop that must act at once when the drain begins (a paced stream sends what it holds:
serving/pacing.py) awaits `begun()`, which `begin()` wakes through the loop's thread-safe call.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable

from starlette.types import ASGIApp, Receive, Scope, Send

# Retry-After of a request refused while draining: another replica can take it at once.
DRAIN_RETRY_AFTER_S = 1


class Drain:
    """Whether the server is draining, and how many /v1 answers are still being sent."""

    def __init__(self) -> None:
        self._changed = threading.Condition()  # an RLock: see the module docstring
        self._num_in_flight = 0
        self._is_draining = False
        self._is_cut_short = False
        self._on_begin: list[Callable[[], None]] = []  # wakes `begun()` waiters; under the lock

    @property
    def is_draining(self) -> bool:
        """True from `begin()` on: /health is 503, new requests are refused (503)."""
        return self._is_draining

    @property
    def num_in_flight(self) -> int:
        """The /v1 requests whose answer has not been sent in full."""
        return self._num_in_flight

    def begin(self) -> None:
        """Start draining; called again while draining, it cuts the drain short (a second
        Ctrl-C).  Safe from a signal handler."""
        with self._changed:
            if self._is_draining:
                self._is_cut_short = True
            self._is_draining = True
            self._changed.notify_all()
            for wake in self._on_begin:
                wake()

    async def begun(self) -> None:
        """Return once `begin()` was called (at once if it was), on the running event loop
        whichever thread calls `begin()`."""
        loop = asyncio.get_running_loop()
        begun: asyncio.Future[None] = loop.create_future()

        def wake() -> None:
            with contextlib.suppress(RuntimeError):  # the loop closed: nobody waits any more
                loop.call_soon_threadsafe(_set_once, begun)

        with self._changed:
            if self._is_draining:
                return
            self._on_begin.append(wake)
        try:
            await begun
        finally:
            with self._changed:
                self._on_begin.remove(wake)

    def wait_begun(self) -> None:
        """Block until `begin()` was called."""
        with self._changed:
            self._changed.wait_for(lambda: self._is_draining)

    def wait_drained(self, timeout_s: float) -> bool:
        """Block until no answer is in flight (True), or until `timeout_s` passed or the drain
        was cut short (False)."""
        with self._changed:
            self._changed.wait_for(
                lambda: self._num_in_flight == 0 or self._is_cut_short, timeout=timeout_s
            )
            return self._num_in_flight == 0

    def entered(self) -> None:
        """A /v1 request came in."""
        with self._changed:
            self._num_in_flight += 1

    def left(self) -> None:
        """A /v1 request's answer was sent in full (or its client went away)."""
        with self._changed:
            self._num_in_flight -= 1
            if self._num_in_flight == 0:
                self._changed.notify_all()


def _set_once(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


class CountInFlight:
    """ASGI middleware: every /v1 HTTP request counts in `drain` until its app call returned,
    that is until its last byte was handed to the server (or it failed, or its client left)."""

    def __init__(self, app: ASGIApp, drain: Drain) -> None:
        self.app = app
        self.drain = drain

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith("/v1/"):
            await self.app(scope, receive, send)
            return
        self.drain.entered()
        try:
            await self.app(scope, receive, send)
        finally:
            self.drain.left()
