"""One live `tokenflow serve` for the whole suite (embedded SmolLM2), or the server at `--url`.

The innocent streams must be exact beside any other request, so the default server runs dense
float32 weights on one thread: there greedy tokens do not depend on what else is in the batch
(with 4-bit weights in bfloat16 on every core they do, docs/reliability.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import shlex
from collections.abc import Iterator

import pytest

from tests_reliability.probe import INNOCENT, Outcome, Row, client, report, send
from tokenflow.eval.compare import free_port, running_server, serve_command

DEFAULT_SERVE_ARGS = "--dtype float32 --num-threads 1"
ROWS = pytest.StashKey[list[Row]]()


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("reliability")
    group.addoption("--url", default=None, help="probe this server instead of starting one")
    group.addoption(
        "--serve-args",
        default=DEFAULT_SERVE_ARGS,
        help=f"options of the server started here (default: {DEFAULT_SERVE_ARGS})",
    )
    group.addoption("--storm", type=int, default=320, help="storm size (10x max_num_seqs 32)")
    group.addoption(
        "--max-body-bytes", type=int, default=2 << 20, help="the server's body limit, in bytes"
    )


@pytest.fixture(scope="session")
def server_url(request: pytest.FixtureRequest) -> Iterator[str]:
    """The URL of the server under probe."""
    url = request.config.getoption("--url")
    with contextlib.ExitStack() as stack:
        if url is None:
            port = free_port()
            command = serve_command(port, shlex.split(request.config.getoption("--serve-args")))
            url = stack.enter_context(running_server(command, port, name="tokenflow")).url
        yield url


@pytest.fixture(scope="session")
def solo(server_url: str) -> Outcome:
    """The innocent stream alone: the text it must produce beside anything else."""

    async def alone() -> Outcome:
        async with client(server_url, max_connections=4) as http:
            return await send(http, INNOCENT)

    outcome = asyncio.run(alone())
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
