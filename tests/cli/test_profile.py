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


def test_the_profiled_engine_and_its_probe_server_have_no_prefix_cache(tiny_model_dir):
    # The probe sends the same prompts burst after burst.  With the serve default's prefix
    # cache a repeat finds its prompt's full blocks cached, and the lone request's prefill,
    # which prices every prefill step, looks almost free.
    from tokenflow.calibrate.probe import in_process_burst
    from tokenflow.calibrate.sweep import SweepSpec
    from tokenflow.cli.profile import profiled_engine_args
    from tokenflow.engine.llm_engine import LLMEngine

    served = EngineArgs(model=tiny_model_dir, device_kv_tokens=1024)
    profiled = profiled_engine_args(served, SweepSpec())
    assert served.enable_prefix_caching and not profiled.enable_prefix_caching
    assert profiled.device_kv_tokens > served.device_kv_tokens  # the sweep's largest point
    assert "--no-enable-prefix-caching" in engine_flags(profiled)

    def cached_tokens(args: EngineArgs) -> int:
        engine = LLMEngine(args)
        try:
            for _ in range(2):
                in_process_burst(engine, 1, 64)
            return engine.stats().prefix_cache_hits_total
        finally:
            engine.close()

    assert cached_tokens(served) > 0  # what the profile would have timed
    assert cached_tokens(profiled) == 0
