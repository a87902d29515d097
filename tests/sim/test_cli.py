"""`tokenflow simulate`: side-by-side JSON with the documented keys, and one-line errors."""

import json

import pytest

from tokenflow.cli.main import main

KEYS = {
    "policy",
    "num_requests",
    "makespan_s",
    "throughput_tps",
    "effective_throughput_tps",
    "ttft_mean_s",
    "ttft_p50_s",
    "ttft_p99_s",
    "rebuffer_mean_s",
    "qoe_mean",
    "num_preemptions",
}


def test_small_custom_run_writes_json_and_plot(tmp_path, capsys):
    out, plot = tmp_path / "r.json", tmp_path / "r.png"
    code = main(
        [
            "simulate",
            "--gpu",
            "rtx4090",
            "--memory-fraction",
            "0.75",
            "--workload",
            "burst",
            "--num-requests",
            "30",
            "--prompt-len",
            "256:32",
            "--output-len",
            "256:32",
            "--no-progress",
            "--json",
            str(out),
            "--plot",
            str(plot),
        ]
    )
    assert code == 0
    records = json.loads(out.read_text())
    assert [r["policy"] for r in records] == ["fcfs", "chunked", "andes", "tokenflow"]
    assert all(set(r) >= KEYS for r in records)
    assert all(r["num_requests"] == 30 for r in records)
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "tokenflow" in capsys.readouterr().out


@pytest.mark.parametrize(
    "args, words",
    [
        (["--setup", "nope"], "unknown setup"),
        (["--workload", "burst", "--rates", "-5"], "rate"),
        (["--setup", "4090-a", "--policies", "fifo"], "unknown policy"),
        (["--workload", "burst", "--gpu", "tpu"], "tpu"),
        (["--setup", "4090-a", "--capacity-headroom", "3"], "capacity_headroom"),
        (["--setup", "4090-a", "--queue-headroom", "-1"], "queue_headroom"),
        (["--setup", "4090-a", "--max-stall-s", "-1"], "max_stall_s"),
        (["--workload", "burst", "--copy-pieces-per-block", "0"], "copy_pieces_per_block"),
        (["--workload", "burst", "--sched-overhead-ms", "-1"], "fixed_s"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(args, words, capsys):
    assert main(["simulate", "--no-progress", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and words in err and "Traceback" not in err


def test_malformed_trace_line_names_the_line(tmp_path, capsys):
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"arrival_s": 0, "prompt_tokens": 10, "output_tokens": 5}\n{"arrival_s": \n')
    assert main(["simulate", "--workload", "trace", "--trace", str(trace), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert ":2" in err and len(err.strip().splitlines()) == 1


PRESSED = [
    "simulate",
    "--gpu",
    "rtx4090",
    "--memory-fraction",
    "0.66",
    "--host-memory-gib",
    "4",
    "--workload",
    "burst",
    "--num-requests",
    "12",
    "--prompt-len",
    "512:0",
    "--output-len",
    "400:0",
    "--rates",
    "20:1",
    "--policies",
    "tokenflow",
    "--no-progress",
]


def test_cost_and_ablation_flags_reach_the_run(capsys):
    assert main(PRESSED) == 0
    default = capsys.readouterr().out
    assert " 0 loads" not in default  # the case reloads by default
    flags = ["--no-offload", "--sched-overhead-ms", "0", "--sched-overhead-us-per-request", "0"]
    assert main([*PRESSED, *flags]) == 0
    ablated = capsys.readouterr().out
    assert " 0 loads" in ablated and "0.0 s scheduler CPU" in ablated
