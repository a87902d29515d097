"""The fidelity analysis on hand-built runs: errors against the real runs' median, the policy
order, and the generated block of the page replacing only itself."""

from __future__ import annotations

from benchmarks.lib.fidelity_doc import BEGIN, END, render
from tokenflow.eval.fidelity import METRICS, WORKLOADS, analyse


def _summary(ttft_p99_s: float) -> dict:
    """Every metric at 1, but P99 TTFT."""
    return {**{metric: 1.0 for metric, _ in METRICS}, "ttft_p99_s": ttft_p99_s}


def _run(policy: str, ttft_p99_s: float) -> dict:
    summary = _summary(ttft_p99_s)
    return {"workload": "burst-fits", "policy": policy, "summary": summary}


def _prediction(policy: str, ttft_p99_s: float) -> dict:
    summary = _summary(ttft_p99_s)
    return {"workload": "burst-fits", "policy": policy, "summary": summary}


RUNS = [_run("fcfs", 4.0), _run("fcfs", 6.0), _run("tokenflow", 1.0), _run("tokenflow", 1.0)]


def test_the_error_is_against_the_median_of_the_real_runs() -> None:
    result = analyse(
        RUNS, [_prediction("fcfs", 5.5), _prediction("tokenflow", 1.0)], ["burst-fits"]
    )
    fcfs = next(r for r in result.rows if r.policy == "fcfs" and r.metric == "ttft_p99_s")
    assert fcfs.median == 5.0
    assert abs(fcfs.error - 0.1) < 1e-12
    assert result.order == {"burst-fits": []}


def test_a_prediction_that_swaps_the_policies_misses_the_order() -> None:
    result = analyse(
        RUNS, [_prediction("fcfs", 0.5), _prediction("tokenflow", 2.0)], ["burst-fits"]
    )
    assert result.order == {"burst-fits": ["ttft_p99_s"]}
    assert "MISSED ttft_p99_s" in result.text


def test_the_page_keeps_what_is_outside_its_block() -> None:
    result = analyse(
        RUNS, [_prediction("fcfs", 5.0), _prediction("tokenflow", 1.0)], ["burst-fits"]
    )
    block = f"{BEGIN}\nstale figures\n{END}"
    existing = f"# Simulator fidelity\n\nby hand above\n\n{block}\n\nby hand below\n"
    page = render(result, WORKLOADS, "python -m benchmarks.fidelity predict", None, {}, existing)
    assert page.startswith("# Simulator fidelity\n\nby hand above\n\n")
    assert page.endswith("\n\nby hand below\n")
    assert "stale figures" not in page
    assert "python -m benchmarks.fidelity predict" in page
    assert "`burst-fits`" in page
