"""`tokenflow bench --compare` starts our server per policy and reports them side by side."""

import json

from tokenflow.cli.main import main


def test_compare_two_policies_on_the_tiny_model(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "compare.json"
    code = main(
        [
            "bench",
            "--compare",
            "fcfs,tokenflow",
            "--serve-args",
            f"--model {tiny_model_dir} --device-kv-tokens 512",
            "--workload",
            "burst",
            "--num-requests",
            "4",
            "--prompt-len",
            "16:0",
            "--output-len",
            "12:0",
            "--rates",
            "5",
            "--endpoint",
            "completions",
            "--no-progress",
            "--json",
            str(out),
        ]
    )
    assert code == 0
    records = json.loads(out.read_text())
    assert [r["policy"] for r in records] == ["fcfs", "tokenflow"]
    assert all(r["num_completed"] == 4 and r["total_output_tokens"] == 48 for r in records)
    table = capsys.readouterr().out
    assert "fcfs" in table and "tokenflow" in table


def test_compare_reports_a_server_that_cannot_start(tmp_path, capsys):
    code = main(
        [
            "bench",
            "--compare",
            "fcfs",
            "--serve-args",
            f"--model {tmp_path / 'missing'}",
            "--num-requests",
            "1",
            "--no-progress",
        ]
    )
    assert code == 2
    assert "does not exist" in capsys.readouterr().err


def test_url_and_compare_are_exclusive(capsys):
    assert main(["bench", "--num-requests", "1"]) == 2
    assert "exactly one of" in capsys.readouterr().err
