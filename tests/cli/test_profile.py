"""`tokenflow profile` on a tiny real model: a profile file with every kind of step, the
machine's and model's facts, and the flags that rebuild its engine (no timing is checked)."""

from tokenflow.calibrate.profile_file import load_profile
from tokenflow.cli.main import main
from tokenflow.cli.profile import engine_flags
from tokenflow.engine.engine_args import EngineArgs


def test_a_profile_of_a_tiny_model_holds_what_the_simulator_reads(tiny_model_dir, tmp_path):
    out = tmp_path / "p.json"
    argv = ["profile", "--model", tiny_model_dir, "--out", str(out), "--rounds", "1",
            "--repeats", "1", "--no-serve-probe", "--no-progress",
            "--device-kv-tokens", "1024"]  # fmt: skip
    assert main(argv) == 0
    profile = load_profile(out)
    kinds = {r.kind for r in profile.residuals}
    assert kinds == {"decode", "prefill", "mixed", "copy", "all"}
    assert profile.engine.device_kv_tokens == 1024  # the served tier, not the sweep's
    assert profile.scheduler.max_num_seqs == 32 and profile.tokenflow.critical_slack_s == 1.0
    assert profile.prompt["chat"].fixed_tokens > profile.prompt["completions"].fixed_tokens
    assert profile.model["num_layers"] == 2 and profile.machine["num_cpus"] >= 1
    assert profile.model["kernels"] == "kernels (checkpoint): float32"  # the choice, recorded
    assert all(s.duration_s > 0 for s in profile.samples)


def test_the_probe_server_gets_the_engine_flags_that_were_given():
    served = EngineArgs(model="m.gguf", num_threads=1, weights="dense")
    assert engine_flags(served) == ["--model", "m.gguf", "--weights", "dense", "--num-threads", "1"]
    assert engine_flags(EngineArgs()) == []
    assert engine_flags(EngineArgs(kernel_cache=False)) == ["--no-kernel-cache"]
