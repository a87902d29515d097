"""One live `tokenflow serve` for the whole suite (embedded SmolLM2), or the server at `--url`.

The innocent streams must be exact beside any other request, so the default server runs dense
float32 weights on one thread: there greedy tokens do not depend on what else is in the batch
(with 4-bit weights in bfloat16 on every core they do, docs/reliability.md). It holds two API
keys: the first goes with every request of the suite, the second is the freeze probes' other
tenant. It has no per-key limit (the storm sends 320 streams with one key); the freeze probes of
per-key limits get a second server, the same with `--max-requests-per-key 2`.
"""

from __future__ import annotations

import asyncio
import contextlib
import shlex
from collections.abc import Iterator

import pytest

from tests_reliability.freeze import KEY_LIMIT
from tests_reliability.probe import (
    INNOCENT,
    SERVE_ARGS,
    Outcome,
    Row,
    alone,
    report,
    serve_args_keys,
)
from tokenflow.eval.local_server import free_port, running_server, serve_command

ROWS = pytest.StashKey[list[Row]]()


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("reliability")
    group.addoption("--url", default=None, help="probe this server instead of starting one")
    group.addoption(
        "--serve-args",
        default=SERVE_ARGS,
        help=f"options of the server started here (default: {SERVE_ARGS})",
    )
    group.addoption(
        "--api-keys",
        default=None,
        help="KEY,KEY: API keys of the server at --url (the first goes with every request); "
        "the freeze probes that need keys are skipped without, those of per-key limits without two",
    )
    group.addoption(
        "--limited-url",
        default=None,
        help=f"with --url: a server like it with --max-requests-per-key {KEY_LIMIT}, for the "
        "freeze probes of per-key limits (skipped without it)",
    )
    group.addoption("--storm", type=int, default=320, help="storm size (10x max_num_seqs 32)")
    group.addoption(
        "--max-body-bytes", type=int, default=2 << 20, help="the server's body limit, in bytes"
    )


@contextlib.contextmanager
def started_server(serve_args: list[str]) -> Iterator[str]:
    """A `tokenflow serve` with `serve_args` on a free port, its URL while it runs."""
    port = free_port()
    with running_server(serve_command(port, serve_args), port, name="tokenflow") as server:
        yield server.url


@pytest.fixture(scope="session")
def server_url(request: pytest.FixtureRequest) -> Iterator[str]:
    """The URL of the server under probe."""
    url = request.config.getoption("--url")
    if url is not None:
        yield url
        return
    with started_server(shlex.split(request.config.getoption("--serve-args"))) as url:
        yield url


@pytest.fixture(scope="module")
def limited_url(request: pytest.FixtureRequest, api_keys: tuple[str, ...]) -> Iterator[str]:
    """A server like the one under probe with a per-key limit of KEY_LIMIT completions (started
    here for the module that asks for it, or --limited-url)."""
    if len(api_keys) < 2:
        pytest.skip("the per-key probes need a server with two API keys (--api-keys)")
    if request.config.getoption("--url") is not None:
        url = request.config.getoption("--limited-url")
        if url is None:
            pytest.skip(f"with --url, the per-key probes need --limited-url (limit {KEY_LIMIT})")
        yield url
        return
    serve_args = shlex.split(request.config.getoption("--serve-args"))
    with started_server([*serve_args, "--max-requests-per-key", str(KEY_LIMIT)]) as url:
        yield url


@pytest.fixture(scope="session")
def api_keys(request: pytest.FixtureRequest) -> tuple[str, ...]:
    """The API keys of the server under probe: --api-keys with --url, else the `--api-key`
    options of the server started here (empty: an open server)."""
    if request.config.getoption("--url") is not None:
        listed = request.config.getoption("--api-keys") or ""
        return tuple(key for key in listed.split(",") if key)
    return serve_args_keys(shlex.split(request.config.getoption("--serve-args")))


@pytest.fixture(scope="session")
def api_key(api_keys: tuple[str, ...]) -> str | None:
    """The key every request of the suite sends (None: the server is open)."""
    return api_keys[0] if api_keys else None


@pytest.fixture(scope="session")
def solo(server_url: str, api_key: str | None) -> Outcome:
    """The innocent stream alone: the text it must produce beside anything else."""
    outcome = asyncio.run(alone(server_url, api_key, INNOCENT))
    assert outcome.is_complete, f"the innocent stream does not complete alone: {outcome}"
    return outcome


@pytest.fixture
def storm_size(request: pytest.FixtureRequest) -> int:
    return request.config.getoption("--storm")


@pytest.fixture
def max_body_bytes(request: pytest.FixtureRequest) -> int:
    return request.config.getoption("--max-body-bytes")


@pytest.fixture(scope="session")
def report_rows(request: pytest.FixtureRequest) -> list[Row]:
    """Every category's tally, printed as one table at the end of the run."""
    return request.config.stash.setdefault(ROWS, [])


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    rows = terminalreporter.config.stash.get(ROWS, [])
    if rows:
        terminalreporter.write_sep("=", "reliability")
        terminalreporter.write_line(report(rows))
