"""`tokenflow tune`: the objectives' rules, the frontier, and a config file serve loads."""

from tests.cli.test_config_file import parse_serve
from tests.sim.synthetic import synthetic_profile
from tokenflow.cli.engine_options import engine_args_from
from tokenflow.cli.main import main
from tokenflow.cli.tune import Score, candidate_points, choose, frontier
from tokenflow.eval.workload import WorkloadRequest, save_trace


def score(qoe: float, p99: float, stall: float, **knobs: float) -> Score:
    return Score(knobs, qoe=qoe, ttft_p99_s=p99, ttft_mean_s=p99 / 2, stall_mean_s=stall,
                 effective_tps=10.0)  # fmt: skip


DEFAULTS = score(0.90, 10.0, 0.2)
FAST_BUT_STALLING = score(0.89, 4.0, 1.5, queue_headroom=1.15)
FAST = score(0.91, 6.0, 0.4, mu=1.0)
CALM = score(0.88, 10.5, 0.0, critical_slack=2.0)
SLOW = score(0.80, 12.0, 0.3, mu=4.0)
ALL = [DEFAULTS, FAST_BUT_STALLING, FAST, CALM, SLOW]


def test_each_objective_keeps_within_the_defaults_allowances():
    assert choose(ALL, "qoe") is FAST
    assert choose(ALL, "p99-ttft") is FAST  # the stalling one moves waiting into stalling
    assert choose(ALL, "stall") is CALM  # its P99 TTFT within 10% of the defaults'
    assert choose([DEFAULTS, SLOW], "qoe") is DEFAULTS


def test_the_frontier_leaves_out_dominated_points():
    assert frontier(ALL) == [FAST_BUT_STALLING, FAST, DEFAULTS, CALM]  # SLOW: DEFAULTS beat it


def test_candidates_start_with_the_defaults_and_repeat_by_seed():
    points = candidate_points(30, seed=1)
    assert points[0] == {} and len(points) == 30
    assert points == candidate_points(30, seed=1) != candidate_points(30, seed=2)


def test_tune_writes_a_config_that_serve_loads(tmp_path, capsys):
    profile, trace, out = tmp_path / "p.json", tmp_path / "t.jsonl", tmp_path / "tuned.toml"
    synthetic_profile().save(profile)
    save_trace(trace, [WorkloadRequest(f"req-{i}", 0.1 * i, 40, 30, 8.0) for i in range(10)])
    code = main(
        ["tune", "--profile", str(profile), "--workload", str(trace), "--device-kv-tokens",
         "640", "--budget", "4", "--seeds", "3", "--workers", "2", "--out", str(out)]
    )  # fmt: skip
    assert code == 0, capsys.readouterr().err
    assert "frontier" in capsys.readouterr().out
    args = engine_args_from(parse_serve(["--config", str(out)]))
    assert args.device_kv_tokens == 640 and args.policy == "tokenflow"
