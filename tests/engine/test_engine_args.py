"""`tokenflow serve` options reach the engine's configuration."""

import argparse
import math

import pytest

from tokenflow.cli.engine_options import add_engine_options, engine_args_from
from tokenflow.core.config import TokenFlowConfig, tokenflow_defaults
from tokenflow.engine.engine_args import EngineArgs


def parse(*argv: str) -> EngineArgs:
    parser = argparse.ArgumentParser()
    add_engine_options(parser)
    return engine_args_from(parser.parse_args(list(argv)))


def test_overload_options_reach_the_tokenflow_policy():
    default = parse().tokenflow_for("cpu")
    tuned = parse("--capacity-headroom", "0.8", "--max-stall-s", "3").tokenflow_for("cpu")
    assert (tuned.capacity_headroom, tuned.max_stall_s) == (0.8, 3.0)
    assert (default.capacity_headroom, default.max_stall_s) != (0.8, 3.0)


@pytest.mark.parametrize("option, value", [("--capacity-headroom", "0"), ("--max-stall-s", "-1")])
def test_bad_overload_options_are_refused(option, value):
    with pytest.raises(ValueError):
        parse(option, value)


def test_serve_runs_the_devices_defaults_of_the_policy_and_options_override_them():
    served = parse().tokenflow_for("cpu")
    profile = (served.critical_slack_s, served.init_new_token_ratio, served.queue_headroom)
    assert profile == (1.0, 0.3, TokenFlowConfig().queue_headroom)
    assert parse().tokenflow_for("cuda") == tokenflow_defaults("cuda") == TokenFlowConfig()
    assert EngineArgs().tokenflow_for("cpu") == served == tokenflow_defaults("cpu")
    argv = ("--critical-slack", "2", "--new-token-ratio", "0.7", "--queue-headroom", "1.15")
    tuned = parse("--device", "cpu", *argv).tokenflow_for("cpu")
    wanted = (2.0, 0.7, 1.15)
    assert (tuned.critical_slack_s, tuned.init_new_token_ratio, tuned.queue_headroom) == wanted
    with pytest.raises(ValueError):
        parse("--new-token-ratio", "1.5")
    # a knob given keeps the device's other defaults
    one = parse("--device", "cpu", "--mu", "3").tokenflow_for("cpu")
    assert (one.buffer_conservativeness, one.critical_slack_s) == (3.0, 1.0)
    with pytest.raises(ValueError, match="queue_headroom"):
        parse("--queue-headroom", "0")
    assert parse("--prefill-stall-s", "inf").tokenflow_for("cpu").prefill_stall_s == math.inf
    with pytest.raises(ValueError, match="prefill_stall_s"):
        parse("--prefill-stall-s", "-1")


def test_executor_and_its_weight_formats():
    assert parse().executor == "torch"
    args = parse("--executor", "llama-cpp", "--weights", "q8_0")
    assert (args.executor, args.weights) == ("llama-cpp", "q8_0")
    for argv in (("--weights", "q8_0"), ("--executor", "llama-cpp", "--weights", "int4")):
        with pytest.raises(ValueError, match="weights must be one of"):
            parse(*argv)
    with pytest.raises(ValueError, match="executor must be one of"):
        EngineArgs(executor="onnx")


def test_llamacpp_repacking_is_off_unless_asked():
    assert not parse("--executor", "llama-cpp").llama_cpp_repack
    assert parse("--executor", "llama-cpp", "--llama-cpp-repack").llama_cpp_repack
    with pytest.raises(ValueError, match="llama_cpp_repack"):
        parse("--llama-cpp-repack")  # the torch executor has nothing to repack


def test_the_llamacpp_executor_says_what_is_missing_when_not_installed(monkeypatch):
    import sys

    from tokenflow.engine.llm_engine import LLMEngine
    from tokenflow.integrations.executors import executor_factory

    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # as if not installed
    monkeypatch.delitem(sys.modules, "tokenflow.integrations.llamacpp.context", raising=False)
    monkeypatch.delitem(sys.modules, "tokenflow.integrations.llamacpp.executor", raising=False)
    args = EngineArgs(executor="llama-cpp", device="cpu")
    with pytest.raises(RuntimeError, match=r"pip install 'tokenflow\[llamacpp\]'"):
        LLMEngine(args, executor_factory("llama-cpp"))


def test_an_engine_told_to_use_llamacpp_without_its_factory_says_where_it_is():
    from tokenflow.engine.llm_engine import LLMEngine

    with pytest.raises(ValueError, match=r"executor_factory\('llama-cpp'\)"):
        LLMEngine(EngineArgs(executor="llama-cpp", device="cpu"))


def test_executors_are_found_by_name():
    from tokenflow.engine.build import build_torch_executor
    from tokenflow.integrations.executors import executor_factory

    assert executor_factory("torch") is build_torch_executor
    with pytest.raises(ValueError, match="executor must be one of"):
        executor_factory("onnx")


def test_tiny_cpu_steps_run_on_one_thread_unless_told_otherwise():
    assert parse().serial_below_tokens == 8
    assert parse("--serial-below-tokens", "0").serial_below_tokens == 0
    with pytest.raises(ValueError, match="serial_below_tokens"):
        parse("--serial-below-tokens", "-1")


@pytest.mark.parametrize("rate", [1e-309, 0.0, 5000.0, float("inf")])
def test_a_default_rate_outside_the_readers_bound_is_refused(rate):
    with pytest.raises(ValueError, match="reader's rate"):
        EngineArgs(default_rate_tps=rate)
