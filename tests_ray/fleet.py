"""A live fleet for the tests that need one: replicas of the embedded model on Ray Serve behind
the TokenFlow router, started by the launcher's own `start`."""

import contextlib
import time
from collections.abc import Callable, Iterator

from tokenflow.eval.local_server import free_port
from tokenflow.replicas.board import DEFAULT_MODE
from tokenflow.replicas.launch import Fleet, parse_options, start, stop_serve

REPORT_PERIOD_S = 0.5
TIMEOUT_S = 600  # the longest a live test waits for what the fleet is to do


@contextlib.contextmanager
def running_fleet(
    serve_argv: list[str], num_replicas: int = 2, migrate: str = DEFAULT_MODE.value
) -> Iterator[tuple[str, Fleet]]:
    """The application's URL and the actors its replicas listen to (the drain signal, the
    board of moves, planning by `migrate`: the launcher's default unless a test says); Serve and
    Ray are shut down on exit."""
    port = free_port()
    args = parse_options(
        ["--replicas", str(num_replicas), "--port", str(port), "--migrate", migrate]
        + ["--report-period-s", str(REPORT_PERIOD_S), "--num-cpus", "2"]
        + ["--object-store-mib", "128"]
    )
    fleet = start(args, serve_argv)
    try:
        yield f"http://127.0.0.1:{port}", fleet
    finally:
        stop_serve()


def until(read: Callable[[], object], what: str) -> object:
    """What `read()` returns once it is truthy, polled for at most `TIMEOUT_S`."""
    deadline_s = time.monotonic() + TIMEOUT_S
    while not (value := read()):
        assert time.monotonic() < deadline_s, f"timed out waiting for {what}"
        time.sleep(0.05)
    return value
