"""`simulate --profile`: a profile file round-trips, the profiled engine replays a trace with
the keys `bench` writes, and it sizes prefill chunks by the real engine's rule."""

import json
from dataclasses import replace

import pytest

from tests.sim.synthetic import synthetic_profile
from tokenflow.calibrate.costs import ProfiledCostModel
from tokenflow.calibrate.profile_file import ProfileError, load_profile
from tokenflow.cli.main import main
from tokenflow.eval.metrics import Summary
from tokenflow.eval.workload import WorkloadRequest, save_trace
from tokenflow.sim.profiled import ProfiledDeployment, build_profiled_engine
from tokenflow.sim.runner import SimConfig, run_engine


@pytest.fixture
def profile_path(tmp_path):
    path = tmp_path / "profile.json"
    synthetic_profile().save(path)
    return path


def burst(n: int, prompt: int = 64, output: int = 40) -> list[WorkloadRequest]:
    return [WorkloadRequest(f"req-{i}", 0.0, prompt, output, 4.0 + 4 * (i % 2)) for i in range(n)]


def test_a_profile_file_round_trips(profile_path):
    assert load_profile(profile_path) == synthetic_profile()


def test_an_unknown_key_is_refused_with_its_place(profile_path, tmp_path):
    record = json.loads(profile_path.read_text())
    record["costs"]["parallel"]["q_s"] = 1.0
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(record))
    with pytest.raises(ProfileError, match=r"costs.parallel: unknown keys \['q_s'\]"):
        load_profile(bad)


def test_simulate_profile_writes_the_keys_bench_writes(profile_path, tmp_path, capsys):
    trace, out = tmp_path / "t.jsonl", tmp_path / "s.json"
    save_trace(trace, burst(12))
    code = main(
        ["simulate", "--profile", str(profile_path), "--device-kv-tokens", "1024", "--workload",
         "trace", "--trace", str(trace), "--policies", "fcfs,tokenflow", "--json", str(out),
         "--no-progress"]
    )  # fmt: skip
    assert code == 0, capsys.readouterr().err
    records = json.loads(out.read_text())
    keys = {"policy", *Summary.__dataclass_fields__}
    assert [r["policy"] for r in records] == ["fcfs", "tokenflow"]
    assert all(set(r) == keys and r["num_completed"] == 12 for r in records)


@pytest.mark.parametrize("flags", [["--gpu", "h200"], ["--setup", "h200-a"]])
def test_roofline_flags_are_refused_with_a_profile(profile_path, flags, capsys):
    args = ["simulate", "--profile", str(profile_path), "--workload", "burst", *flags]
    assert main(args) == 2
    assert "do not apply with --profile" in capsys.readouterr().err


def test_deployment_flags_without_a_profile_are_refused(capsys):
    assert main(["simulate", "--workload", "burst", "--device-kv-tokens", "1024"]) == 2
    assert "apply with --profile only" in capsys.readouterr().err


def test_the_chat_template_lengthens_the_served_prompts(profile_path):
    deployment = ProfiledDeployment(load_profile(profile_path), endpoint="chat")
    engine = build_profiled_engine(deployment, "fcfs")
    result = run_engine(burst(2, prompt=50), "fcfs", engine, SimConfig())
    assert [t.num_prompt_tokens for t in result.traces] == [80, 80]  # 30 + 1.0 x 50


def test_the_server_charge_lengthens_the_run(profile_path):
    profile = load_profile(profile_path)
    free = synthetic_profile(server_step_s=0.0)
    runs = [
        run_engine(burst(8), "fcfs", build_profiled_engine(ProfiledDeployment(p), "fcfs"),
                   SimConfig()).summary.makespan_s
        for p in (free, profile)
    ]  # fmt: skip
    assert runs[1] > runs[0]


def test_the_request_path_delays_a_lone_first_token_by_its_time(profile_path):
    ttfts = [
        run_engine(burst(1), "fcfs", build_profiled_engine(ProfiledDeployment(p), "fcfs"),
                   SimConfig()).summary.ttft_mean_s
        for p in (load_profile(profile_path), synthetic_profile(request_path_s=0.25))
    ]  # fmt: skip
    assert ttfts[1] == pytest.approx(ttfts[0] + 0.25, abs=1e-6)


def test_prefill_terms_take_their_own_speed_factor():
    costs = synthetic_profile().costs
    slow_prefill = ProfiledCostModel(replace(costs, prefill_speed_factor=2.0), 1024)
    as_fitted = ProfiledCostModel(costs, 1024)
    decode = (0, 0, 4000, 8)  # 8 streams decoding over 4000 context tokens
    assert slow_prefill.compute_time_s(*decode) == as_fitted.compute_time_s(*decode)
    prefill_only = costs.parallel.time_s(8, 4000, 256, 256 * 257 // 2) - costs.parallel.time_s(
        8, 4000, 0, 0
    )
    mixed = (256, 256 * 257 // 2, 4000, 8)
    extra = slow_prefill.compute_time_s(*mixed) - as_fitted.compute_time_s(*mixed)
    assert extra == pytest.approx(prefill_only * costs.speed_factor)


def test_the_engines_decode_attention_is_charged_on_its_padded_keys():
    costs = synthetic_profile().costs
    model = ProfiledCostModel(costs, 1024)
    fit, speed = costs.compute_fit(2), costs.speed_factor
    uneven = model.compute_time_s(0, 0, 100 + 900, 2, padded_decode_keys=2 * 912)
    assert uneven == pytest.approx(fit.time_s(2, 2 * 912, 0, 0) * speed)
    assert model.compute_time_s(0, 0, 1000, 2) == pytest.approx(fit.time_s(2, 1000, 0, 0) * speed)
