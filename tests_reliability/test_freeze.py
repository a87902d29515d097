"""No request freezes or starves the others, on a live server: each freeze probe (freeze.py) gets
its clear 4xx naming the limit, while an innocent stream beside it stays exact and /health
answers 200 during and after. The per-key probes run on a second server with a per-key limit
(`limited_url`). Durations are recorded in the report's notes, not asserted.

`make test-reliability ARGS="-k freeze"` (docs/reliability.md).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest

from tests_reliability.freeze import (
    FREEZE_INNOCENT,
    FreezeProbe,
    ProbeRun,
    freeze_probes,
    problems,
    run_probe,
)
from tests_reliability.probe import Outcome, Row, alone

SERVER_PROBES = [probe for probe in freeze_probes() if probe.needs != "key limit"]
KEY_PROBES = [probe for probe in freeze_probes() if probe.needs == "key limit"]


def innocent_alone(url: str, api_keys: Sequence[str]) -> str:
    """The text of the probes' innocent stream (sent with the last key) alone on `url`."""
    outcome = asyncio.run(alone(url, api_keys[-1] if api_keys else None, FREEZE_INNOCENT))
    assert outcome.is_complete, f"the innocent stream does not complete alone: {outcome}"
    return outcome.text


@pytest.fixture(scope="module")
def server_solo(server_url: str, api_keys: tuple[str, ...]) -> str:
    return innocent_alone(server_url, api_keys)


@pytest.fixture(scope="module")
def limited_solo(limited_url: str, api_keys: tuple[str, ...]) -> str:
    return innocent_alone(limited_url, api_keys)


def category_row(rows: list[Row], category: str) -> Row:
    """The report row of `category`, added on first use."""
    row = next((row for row in rows if row.category == category), None)
    if row is None:
        row = Row(category, is_healthy_after=True)
        rows.append(row)
    return row


def record(row: Row, probe: FreezeProbe, run: ProbeRun, solo_text: str) -> None:
    """Tally the probe's run in its category's row, with its durations as a note."""
    error = run.answer.error or {}
    row.add(Outcome(run.answer.status, error=error.get("message")))
    if run.follow_up is not None:
        row.add(run.follow_up)
    row.innocent_intact.append(run.innocent.is_complete and run.innocent.text == solo_text)
    is_healthy = run.is_healthy_after and all(poll.status == 200 for poll in run.health_polls)
    row.is_healthy_after = row.is_healthy_after and is_healthy
    row.seconds += run.probe_s
    row.notes.append(
        f"{probe.name}: {run.answer.status} in {run.probe_s:.2f} s, worst /health "
        f"{run.worst_health_s:.2f} s, innocent worst gap {run.innocent_worst_gap_s:.2f} s"
        + "".join(f"; {note}" for note in run.notes)
    )


def check(probe: FreezeProbe, url: str, api_keys: Sequence[str], solo_text: str, row: Row) -> None:
    run = asyncio.run(run_probe(url, api_keys, probe))
    record(row, probe, run, solo_text)
    found = problems(probe, run, solo_text)
    assert not found, f"{probe.name}: " + "; ".join(found)


@pytest.mark.parametrize("probe", SERVER_PROBES, ids=[probe.name for probe in SERVER_PROBES])
def test_a_hostile_request_gets_its_4xx_and_freezes_nothing(
    probe: FreezeProbe,
    server_url: str,
    api_keys: tuple[str, ...],
    server_solo: str,
    report_rows: list[Row],
) -> None:
    if probe.needs == "keys" and not api_keys:
        pytest.skip("the server under probe has no API keys (with --url: --api-keys)")
    check(probe, server_url, api_keys, server_solo, category_row(report_rows, "freeze"))


@pytest.mark.parametrize("probe", KEY_PROBES, ids=[probe.name for probe in KEY_PROBES])
def test_work_over_a_key_limit_gets_429_and_freezes_nothing(
    probe: FreezeProbe,
    limited_url: str,
    api_keys: tuple[str, ...],
    limited_solo: str,
    report_rows: list[Row],
) -> None:
    row = category_row(report_rows, "freeze per key")
    check(probe, limited_url, api_keys, limited_solo, row)
