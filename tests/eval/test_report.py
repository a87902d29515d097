"""Report table, JSON records and plots from summaries and traces (no server)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tokenflow.eval.metrics import RequestTrace, summarize
from tokenflow.eval.plots import pick_timeline_requests, plot_report, plot_spread
from tokenflow.eval.report import (
    Spread,
    aggregate,
    check_targets,
    format_spread_table,
    format_table,
    report_records,
    spread,
    write_json,
)


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


def test_spread_is_median_min_max() -> None:
    assert spread([3.0, 1.0, 2.0]) == Spread(2.0, 1.0, 3.0)
    assert spread([4.0, 1.0, 2.0, 10.0]) == Spread(3.0, 1.0, 10.0)  # even: mean of the middle
    assert spread([5]).to_dict() == {"median": 5.0, "min": 5.0, "max": 5.0}
    with pytest.raises(ValueError):
        spread([])


def test_aggregate_over_seeds_per_metric() -> None:
    runs = [summarize(traces(offset)).to_dict() for offset in (0.2, 3.0, 1.0)]
    result = aggregate(runs, keys=("ttft_mean_s", "throughput_tps"))
    assert set(result) == {"ttft_mean_s", "throughput_tps"}
    ttfts = sorted(r["ttft_mean_s"] for r in runs)
    assert result["ttft_mean_s"] == Spread(ttfts[1], ttfts[0], ttfts[2])
    assert ttfts[0] < ttfts[1] < ttfts[2]  # the three runs really differ


def test_aggregate_defaults_cover_the_reported_metrics() -> None:
    runs = [summarize(traces(offset)).to_dict() for offset in (0.2, 1.0)]
    keys = set(aggregate(runs))
    assert {"ttft_mean_s", "ttft_p99_s", "rebuffer_mean_s", "rebuffer_p99_s", "qoe_mean"} <= keys
    assert {"effective_throughput_tps", "throughput_tps"} <= keys


def test_spread_table_is_median_and_range_over_rounds() -> None:
    assert Spread(2.0, 1.0, 3.25).text(1) == "2.0 [1.0-3.2]"
    rounds = [
        {"fcfs": summarize(traces(fcfs)), "tokenflow": summarize(traces(ours))}
        for fcfs, ours in ((1.0, 0.2), (3.0, 0.1), (2.0, 0.3))
    ]
    table = format_spread_table(rounds).splitlines()
    assert table[0].split()[:2] == ["policy", "runs"]
    assert len({len(line) for line in table}) == 1  # aligned columns
    ttfts = sorted(r["fcfs"].ttft_mean_s for r in rounds)
    fcfs_row = table[2]
    assert fcfs_row.startswith("fcfs") and fcfs_row.split()[1] == "3"
    assert f"{ttfts[1]:.2f} [{ttfts[0]:.2f}-{ttfts[2]:.2f}]" in fcfs_row
    assert table[3].startswith("tokenflow")
    assert format_spread_table(rounds, label="server").split()[:2] == ["server", "runs"]


def test_plot_spread_writes_a_png(tmp_path: Path) -> None:
    spreads = {
        name: aggregate([summarize(traces(o)).to_dict() for o in offsets])
        for name, offsets in (("fcfs", (1.0, 2.0, 3.0)), ("tokenflow", (0.1, 0.2, 0.3)))
    }
    plot_spread(tmp_path / "p.png", "setup", spreads)
    assert (tmp_path / "p.png").read_bytes().startswith(b"\x89PNG")


# -- targets against a baseline, runs paired by seed, judged on the median ----------------------
def _run(p99: float, eff: float, qoe: float, stall: float, raw: float) -> dict[str, float]:
    return {
        "ttft_p99_s": p99,
        "effective_throughput_tps": eff,
        "qoe_mean": qoe,
        "rebuffer_mean_s": stall,
        "throughput_tps": raw,
    }


def _seeds(**median: float) -> list[dict[str, float]]:
    """Three seeds' runs: the median's, and two far from it (only the median may decide)."""
    low = {k: v / 10 for k, v in median.items()}
    high = {k: v * 10 for k, v in median.items()}
    return [_run(**low), _run(**median), _run(**high)]


FCFS = _seeds(p99=100.0, eff=100.0, qoe=0.5, stall=3.0, raw=1000.0)


def test_a_policy_meeting_every_target_passes() -> None:
    good = _seeds(p99=25.0, eff=131.0, qoe=0.6, stall=3.29, raw=980.0)
    checks = check_targets(good, FCFS, p99_ttft_bound=0.3)
    assert all(check.passed for check in checks.values())
    assert checks["p99_ttft"].value == 0.25
    assert checks["p99_ttft"].to_dict() == {
        "value": 0.25, "min": 0.25, "max": 0.25, "pass": True, "target": "<= 0.3x"
    }  # fmt: skip


def test_each_target_can_fail() -> None:
    bad = _seeds(p99=31.0, eff=129.0, qoe=0.49, stall=3.31, raw=960.0)
    assert not any(check.passed for check in check_targets(bad, FCFS, 0.3).values())


def test_the_stall_allowance_is_never_below_a_tenth_of_a_second() -> None:
    calm_fcfs = _seeds(p99=100.0, eff=100.0, qoe=0.5, stall=0.1, raw=1000.0)
    tokenflow = _seeds(p99=90.0, eff=200.0, qoe=0.9, stall=0.19, raw=1000.0)
    assert check_targets(tokenflow, calm_fcfs, 1.0)["p99_ttft"].passed
    assert not check_targets(tokenflow, calm_fcfs, 0.3)["p99_ttft"].passed
    stall = check_targets(tokenflow, calm_fcfs, 1.0)["mean_stall_s"]
    assert stall.passed and stall.target == "<= +0.10 s"  # 0.09 s <= max(0.1, 0.01)
    assert "effective_tps" not in check_targets(tokenflow, calm_fcfs, 1.0, None)


def test_a_marked_block_is_rewritten_and_the_rest_of_the_page_kept(tmp_path):
    from tokenflow.eval.report import write_marked_block

    page = tmp_path / "page.md"
    page.write_text("intro\n<!-- b -->\nold table\n<!-- e -->\nafter\n")
    write_marked_block(page, "<!-- b -->", "<!-- e -->", ["new table", ""])
    assert page.read_text() == "intro\n<!-- b -->\nnew table\n<!-- e -->\nafter\n"
    fresh = tmp_path / "fresh.md"
    write_marked_block(fresh, "<!-- b -->", "<!-- e -->", ["only", ""])
    assert fresh.read_text() == "<!-- b -->\nonly\n<!-- e -->\n"
