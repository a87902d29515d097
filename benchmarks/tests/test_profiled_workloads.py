"""The profiled suite runner's overload verdicts, its spinning processes, its knobs and what
a real run reports."""

from __future__ import annotations

import argparse
import contextlib

import pytest

from benchmarks import profiled_workloads
from benchmarks.profiled_workloads import busy_loops, knob, main, overload_table
from tokenflow.eval.client import BenchRun
from tokenflow.sim.suite import suite_workload


def _runs(stalls_s: list[float], qoes: list[float]) -> list[dict]:
    return [{"rebuffer_mean_s": s, "qoe_mean": q} for s, q in zip(stalls_s, qoes, strict=True)]


def test_overload_verdicts_pair_runs_by_round() -> None:
    # stall ratios 0.4, 0.5, 0.6 (median 0.5: holds); QoE differences +0.04, +0.06, +0.02
    # (median +0.04: fails)
    results = {
        "burst": {
            "fcfs": _runs([1.0, 2.0, 1.0], [0.60, 0.50, 0.70]),
            "tokenflow": _runs([0.4, 1.0, 0.6], [0.64, 0.56, 0.72]),
        }
    }
    row = overload_table(results).splitlines()[-1]
    assert "0.50 [0.40-0.60]x holds" in row
    assert row.endswith("| 0.040 [0.020-0.060] fails |")


def test_busy_loops_run_until_the_block_ends() -> None:
    with busy_loops(2) as loops:
        assert len(loops) == 2
        assert all(loop.poll() is None for loop in loops)
    assert all(loop.poll() is not None for loop in loops)


def test_a_knob_is_a_policy_knob_name_and_a_number() -> None:
    assert knob("prefill_stall_s=0.25") == ("prefill_stall_s", 0.25)
    for bad in ("prefill_stall_s", "no_such_knob=1", "=0.25"):
        with pytest.raises(argparse.ArgumentTypeError, match="NAME=VALUE"):
            knob(bad)


def test_knobs_are_refused_for_real_servers(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--real", "--knob", "prefill_stall_s=0.25"])
    assert "--serve-args" in capsys.readouterr().err


def test_a_real_run_reports_the_preemptions_its_server_counted(monkeypatch) -> None:
    """A client sees no pause, so the real run's preemptions are the server's count."""

    @contextlib.contextmanager
    def server(policy, serve_args):
        yield "http://127.0.0.1:1"

    async def workload(requests, config, name):
        return BenchRun(
            name=name,
            traces=(),
            num_failed=0,
            errors=(),
            duration_s=1.0,
            server_counts={"preemptions": 7},
        )

    monkeypatch.setattr(profiled_workloads, "local_server", server)
    monkeypatch.setattr(profiled_workloads, "run_workload", workload)
    monkeypatch.setattr(profiled_workloads, "suite_score", lambda traces: {"num_preemptions": 0})
    run = profiled_workloads.run_real_once(suite_workload("burst-40"), "tokenflow")
    assert run["num_preemptions"] == 7


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--real", "--rounds", "0"], "--rounds: must be >= 1, got 0"),
        (["--profile", "p.json", "--seeds", "two"], "--seeds: expected an integer >= 1"),
        (["--profile", "p.json", "--workloads", "nope"], "unknown workload 'nope'"),
    ],
)
def test_bad_counts_and_names_are_refused_before_any_run(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2  # argparse's usage error, not a traceback
    error = capsys.readouterr().err
    assert message in error
    if "workload" in message:
        assert "readme-readers" in error  # every name `named_workload` knows is offered
