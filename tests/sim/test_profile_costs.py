"""The profile fit recovers the coefficients of a synthetic executor whose costs are known."""

import math

import numpy as np
import pytest

from tests.sim.synthetic import D2H, H2D, PARALLEL, SERIAL, synthetic_costs
from tokenflow.calibrate.costs import ComputeFit, nonnegative_lstsq, residuals


def close(fit: ComputeFit, truth: ComputeFit, rel: float) -> bool:
    return all(
        math.isclose(getattr(fit, k), getattr(truth, k), rel_tol=rel, abs_tol=1e-12)
        for k in ("a_s", "b_s", "c_s", "p0_s", "p1_s", "p2_s")
    )


def test_the_fit_recovers_both_regimes_and_both_copy_directions():
    costs, samples = synthetic_costs()
    assert close(costs.parallel, PARALLEL, 1e-6)
    assert close(costs.serial, SERIAL, 1e-6)  # its prefill terms: none in the serial regime
    assert costs.d2h.latency_s == pytest.approx(D2H.latency_s, rel=1e-6)
    assert costs.d2h.block_s == pytest.approx(D2H.block_s, rel=1e-6)
    assert costs.h2d.latency_s == pytest.approx(H2D.latency_s, rel=1e-6)
    assert costs.h2d.block_s == pytest.approx(H2D.block_s, rel=1e-6)
    assert all(r.max_abs < 1e-6 for r in residuals(costs, samples))


def test_a_step_slowed_now_and_then_moves_no_coefficient():
    # every 7th step 5x slower: at most one of a point's three timed steps per round
    costs, samples = synthetic_costs(slow_every=7)
    assert close(costs.parallel, PARALLEL, 1e-6)
    assert close(costs.serial, SERIAL, 1e-6)
    by_kind = {r.kind: r for r in residuals(costs, samples)}
    assert by_kind["all"].max_abs == pytest.approx(0.8, rel=1e-6)  # the slow steps: 1/5 - 1


def test_nonnegative_lstsq_fixes_a_negative_coefficient_at_zero():
    rows = np.array([[1.0, 0.0], [1.0, 1.0], [1.0, 2.0]])
    targets = np.array([2.0, 1.0, 0.0])  # slope -1 unconstrained
    coef = nonnegative_lstsq(rows, targets)
    assert coef[1] == 0.0 and coef[0] == pytest.approx(1.0)
