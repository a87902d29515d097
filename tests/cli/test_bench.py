"""`tokenflow bench` arguments: bad ones give one line and exit 2; a good run writes outputs."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from tests.serving.fake_engine import FakeEngine
from tests.serving.live_server import serve_in_thread
from tokenflow.cli.bench import add_bench_arguments, main, run_bench
from tokenflow.serving.app import build_app


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_bench_arguments(parser)
    return parser.parse_args(argv)


@pytest.mark.parametrize(
    "extra",
    [
        ["--prompt-len", "abc"],
        ["--output-len", "10:2:3"],
        ["--rates", "15:0.4,x"],
        ["--rates", "-5"],
        ["--num-requests", "0"],
        ["--workload", "poisson", "--request-rate", "-1"],
        ["--workload", "trace"],
        ["--workload", "trace", "--trace", "/nonexistent/trace.jsonl"],
        ["--timeout", "0"],
        ["--max-concurrency", "0"],
        ["--json", "/nonexistent-dir/out.json"],
    ],
)
def test_bad_arguments_one_line_exit_2(extra: list[str], capsys: pytest.CaptureFixture) -> None:
    code = run_bench(parse(["--url", "http://127.0.0.1:9", "--no-progress", *extra]))
    assert code == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tokenflow bench: error: ")
    assert "Traceback" not in captured.err
    assert captured.out == ""


def test_bad_url_is_one_line(capsys: pytest.CaptureFixture) -> None:
    assert run_bench(parse(["--url", "localhost:8000", "--num-requests", "1"])) == 2
    assert capsys.readouterr().err.count("\n") == 1


def test_unreachable_server_exits_1_without_traceback(capsys: pytest.CaptureFixture) -> None:
    argv = ["--url", "http://127.0.0.1:9", "--num-requests", "2", "--no-progress"]
    argv += ["--prompt-len", "4", "--output-len", "3", "--timeout", "10"]
    assert main(argv) == 1
    captured = capsys.readouterr()
    assert "2 of 2 requests failed" in captured.err
    assert "Traceback" not in captured.err


def test_full_run_writes_json_and_plot(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    engine = FakeEngine(token_delay_s=0.002, max_model_len=1024)
    with serve_in_thread(build_app(engine)) as url:
        argv = ["--url", url, "--endpoint", "completions", "--workload", "poisson"]
        argv += ["--num-requests", "4", "--request-rate", "50", "--prompt-len", "8:2"]
        argv += ["--output-len", "6:2", "--rates", "15:0.4,20:0.6", "--seed", "3"]
        argv += ["--json", str(tmp_path / "r.json"), "--plot", str(tmp_path / "r.png")]
        argv += ["--name", "fake", "--no-progress"]
        assert main(argv) == 0
    records = json.loads((tmp_path / "r.json").read_text())
    assert len(records) == 1 and records[0]["policy"] == "fake"
    assert records[0]["num_completed"] == 4
    assert (tmp_path / "r.png").stat().st_size > 10_000
    assert "fake" in capsys.readouterr().out
    assert {rate for _, _, rate in engine.submitted} <= {15.0, 20.0}
