"""The `tokenflow` command's engine choice."""

import importlib.util
import os

import pytest

from tokenflow.cli.main import build_parser, main


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed")
def test_serve_engine_vllm_without_vllm_is_one_clear_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--engine", "vllm", "--model", "some-dir", "--tensor-parallel-size", "2"])
    assert exit_info.value.code == 2
    assert "vLLM is not installed" in capsys.readouterr().err


def test_serve_engine_defaults_to_ours_and_rejects_unknown_engines(capsys):
    assert build_parser().parse_args(["serve"]).engine == "tokenflow"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--engine", "sglang"])
    assert "invalid choice" in capsys.readouterr().err


def test_serve_makes_openmp_workers_sleep_unless_told_otherwise(monkeypatch):
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    assert os.environ["OMP_WAIT_POLICY"] == "PASSIVE"
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    assert os.environ["OMP_WAIT_POLICY"] == "ACTIVE"


@pytest.mark.parametrize("flags", [["--executor", "llama-cpp"], ["--executor=llama-cpp"]])
def test_serve_leaves_openmp_waits_alone_for_llamacpp(monkeypatch, flags):
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    with pytest.raises(SystemExit):
        main(["serve", *flags, "--help"])
    assert "OMP_WAIT_POLICY" not in os.environ
    with pytest.raises(SystemExit):
        main(["serve", "--executor", "torch", "--help"])
    assert os.environ["OMP_WAIT_POLICY"] == "PASSIVE"


@pytest.mark.parametrize(
    ("argv", "abbreviated"),
    [
        (["serve"], "--conf"),  # once read as --config: a server without the file's api-key
        (["simulate"], "--conf"),
        (["bench"], "--num-req"),
        (["profile", "--out", "p.json"], "--round"),
        (["tune", "--out", "t.toml", "--profile", "p.json"], "--bud"),
    ],
)
def test_no_parser_takes_an_abbreviated_flag(argv, abbreviated, capsys):
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args([*argv, abbreviated, "1"])
    assert exit_info.value.code == 2
    assert f"unrecognized arguments: {abbreviated}" in capsys.readouterr().err


def test_every_parser_in_the_package_refuses_abbreviations():
    import ast
    from pathlib import Path

    import tokenflow

    offenders = []
    for path in Path(tokenflow.__file__).parent.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", None) in (
                "ArgumentParser",
                "add_parser",
            ):
                flags = {k.arg: k.value for k in node.keywords}
                value = flags.get("allow_abbrev")
                if not (isinstance(value, ast.Constant) and value.value is False):
                    offenders.append(f"{path.name}:{node.lineno}")
    assert offenders == []


@pytest.mark.parametrize(
    ("flags", "line"),
    [
        ([], "auth off: every request is served (no --api-key), default class eager"),
        (
            ["--api-key", "a", "--api-key-class", "b=reader:6", "--default-class", "reader"],
            "auth on: 2 API keys, /metrics needs a key, default class reader",
        ),
    ],
)
def test_serve_logs_whether_auth_is_on_at_start(monkeypatch, caplog, flags, line):
    import logging

    import tokenflow.cli.serve as serve

    monkeypatch.setattr(serve, "configure_logging", lambda level: None)  # (keeps caplog's)
    monkeypatch.setattr(serve, "_serve", lambda sock, config, engine_args: 0)
    args = build_parser().parse_args(["serve", "--port", "0", *flags])
    with caplog.at_level(logging.INFO, logger="tokenflow.cli.serve"):
        assert serve.run_serve(args) == 0
    assert [r.getMessage() for r in caplog.records if r.getMessage().startswith("auth ")] == [line]
