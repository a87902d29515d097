"""Report table, JSON records and plots from summaries and traces (no server)."""

from __future__ import annotations

import json
from pathlib import Path

from tokenflow.report import (
    format_table,
    pick_timeline_requests,
    plot_report,
    report_records,
    write_json,
)
from tokenflow.metrics import RequestTrace, summarize


def traces(offset: float) -> list[RequestTrace]:
    return [
        RequestTrace(
            f"req-{i}",
            0.0,
            10.0,
            5,
            tuple(offset + i * 0.5 + 0.05 * j for j in range(20)),
            finish_reason="length",
        )
        for i in range(5)
    ]


def test_table_json_and_plot(tmp_path: Path) -> None:
    runs = {"fcfs": traces(1.0), "tokenflow": traces(0.2)}
    summaries = {name: summarize(run) for name, run in runs.items()}
    table = format_table(summaries).splitlines()
    assert table[0].split()[:2] == ["policy", "done/reqs"]
    assert set(table[1]) <= {"-", " "}
    assert table[2].startswith("fcfs") and "5/5" in table[2]
    assert table[3].startswith("tokenflow")
    assert len({len(line) for line in table}) == 1  # aligned columns
    records = report_records(summaries)
    assert [r["policy"] for r in records] == ["fcfs", "tokenflow"]
    assert records[0]["ttft_mean_s"] > records[1]["ttft_mean_s"]
    write_json(tmp_path / "s.json", summaries)
    assert json.loads((tmp_path / "s.json").read_text()) == records
    plot_report(tmp_path / "s.png", summaries, runs, num_timelines=2)
    assert (tmp_path / "s.png").read_bytes().startswith(b"\x89PNG")


def test_timeline_requests_are_common_and_spread() -> None:
    runs = {"a": traces(0.0), "b": traces(0.0)[1:]}
    assert pick_timeline_requests(runs, 2) == ["req-1", "req-4"]
    assert pick_timeline_requests(runs, 10) == ["req-1", "req-2", "req-3", "req-4"]
    assert pick_timeline_requests({}, 3) == []


def test_empty_runs_still_plot(tmp_path: Path) -> None:
    failed = [RequestTrace("req-0", 0.0, 10.0, 5, (), finish_reason="error")]
    summaries = {"broken": summarize(failed)}
    assert "0/1" in format_table(summaries)
    plot_report(tmp_path / "e.png", summaries, {"broken": failed})
    assert (tmp_path / "e.png").exists()
