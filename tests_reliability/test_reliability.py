"""One bad request never hurts another, on a live server: hostile bodies get a clear 4xx, poison
requests leave an innocent stream beside them exact, dropped streams free the engine, and a storm
of 10x the batch completes or gets a clear 429. After each: /health answers and nothing is lost.

`make test-reliability` (docs/reliability.md); the table of every category is printed at the end.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

from tests_reliability.probe import (
    INNOCENT,
    Outcome,
    Row,
    client,
    hostile_bodies,
    is_healthy,
    poison_bodies,
    send,
    settles,
)


def run_category(
    name: str,
    url: str,
    api_key: str | None,
    category: Callable[..., Awaitable[None]],
    rows: list[Row],
    max_connections: int = 48,
) -> Row:
    """Run one category against `url` with `api_key`, then check /health; the category's
    tally."""
    row = Row(name)

    async def measured() -> None:
        async with client(url, max_connections, api_key) as http:
            started = time.monotonic()
            await category(http, row)
            row.seconds = time.monotonic() - started
            row.is_healthy_after = await is_healthy(http)

    asyncio.run(measured())
    rows.append(row)
    return row


def assert_clean(row: Row) -> None:
    assert row.num_lost == 0, f"{row.category}: {row.num_lost} lost ({row.notes})"
    assert row.is_healthy_after, f"{row.category}: /health fails afterwards"
    assert all(row.innocent_intact), f"{row.category}: innocent {row.innocent_intact}"


def test_hostile_bodies_get_a_clear_4xx(
    server_url: str, api_key: str | None, max_body_bytes: int, report_rows: list[Row]
) -> None:
    async def hostile(http, row: Row) -> None:
        for body in hostile_bodies(max_body_bytes):
            row.add(await send(http, body))

    row = run_category("hostile", server_url, api_key, hostile, report_rows)
    assert_clean(row)
    assert row.num_clear_4xx == row.num_sent


def test_poison_requests_leave_the_innocent_stream_exact(
    server_url: str, api_key: str | None, solo: Outcome, report_rows: list[Row]
) -> None:
    async def poison(http, row: Row) -> None:
        for body in poison_bodies():
            innocent, outcome = await asyncio.gather(send(http, INNOCENT), send(http, body))
            row.add(outcome)
            row.innocent_intact.append(innocent.is_complete and innocent.text == solo.text)

    row = run_category("poison", server_url, api_key, poison, report_rows)
    assert_clean(row)
    assert row.num_complete == row.num_sent


def test_dropped_streams_free_the_engine(
    server_url: str, api_key: str | None, solo: Outcome, report_rows: list[Row]
) -> None:
    async def disconnect(http, row: Row) -> None:
        body = {**INNOCENT, "max_tokens": 200, "stream_rate": 2}
        drops = [send(http, body, max_frames=n) for n in (0, 1, 2, 3, 5, 8) * 4]
        innocent, *dropped = await asyncio.gather(send(http, INNOCENT), *drops)
        for outcome in dropped:
            row.add(outcome)
        row.innocent_intact.append(innocent.is_complete and innocent.text == solo.text)
        row.innocent_intact.append(await settles(http))
        after = await send(http, INNOCENT)
        row.innocent_intact.append(after.is_complete and after.text == solo.text)

    assert_clean(run_category("disconnect", server_url, api_key, disconnect, report_rows))


def test_a_storm_completes_or_gets_a_clear_429(
    server_url: str,
    api_key: str | None,
    solo: Outcome,
    storm_size: int,
    report_rows: list[Row],
) -> None:
    async def storm(http, row: Row) -> None:
        body = {**INNOCENT, "max_tokens": 8, "stream_rate": 4}
        admitted = asyncio.Event()
        innocent = asyncio.ensure_future(send(http, INNOCENT, answered=admitted))
        await admitted.wait()  # the innocent stream is in before the storm
        outcomes = await asyncio.gather(*(send(http, body) for _ in range(storm_size)))
        for outcome in outcomes:
            row.add(outcome)
        first = await innocent
        row.innocent_intact.append(first.is_complete and first.text == solo.text)
        row.innocent_intact.append(await settles(http))

    row = run_category("storm", server_url, api_key, storm, report_rows, storm_size + 16)
    assert_clean(row)
    refused = row.num_sent - row.num_complete
    assert refused == row.num_clear_4xx, "every storm request not served got a clear 429"
