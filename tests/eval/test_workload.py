"""Workload generation: determinism, arrival processes, length and rate mixes, trace files."""

from __future__ import annotations

import random
import statistics
from pathlib import Path

import pytest

from tokenflow.eval.workload import (
    LengthDist,
    RateMix,
    WorkloadError,
    WorkloadRequest,
    WorkloadSpec,
    generate,
    load_trace,
)


def gaps_s(requests: list[WorkloadRequest]) -> list[float]:
    return [b.arrival_s - a.arrival_s for a, b in zip(requests, requests[1:], strict=False)]


# -- generation ---------------------------------------------------------------------------------
def test_same_seed_same_workload_and_other_seed_another() -> None:
    spec = WorkloadSpec("poisson", num_requests=50, request_rate=4.0, seed=1)
    assert generate(spec) == generate(spec)
    assert generate(spec) != generate(WorkloadSpec("poisson", 50, 4.0, seed=2))


def test_golden_values_pin_the_generator() -> None:
    # Any change here changes every recorded experiment: update only on purpose.
    spec = WorkloadSpec("poisson", num_requests=3, request_rate=2.0, seed=0)
    got = [
        (r.request_id, round(r.arrival_s, 9), r.num_prompt_tokens, r.num_output_tokens, r.rate_tps)
        for r in generate(spec)
    ]
    assert got == [
        ("req-0", 0.0, 507, 863, 20.0),
        ("req-1", 0.044514338, 519, 875, 20.0),
        ("req-2", 4.081208408, 519, 563, 20.0),
    ]


def test_burst_arrives_all_at_zero_with_ordered_ids() -> None:
    requests = generate(WorkloadSpec("burst", num_requests=400))
    assert [r.arrival_s for r in requests] == [0.0] * 400
    assert [r.request_id for r in requests] == [f"req-{i}" for i in range(400)]


def test_poisson_mean_inter_arrival() -> None:
    requests = generate(WorkloadSpec("poisson", num_requests=2000, request_rate=5.0, seed=3))
    assert requests[0].arrival_s == 0.0  # vLLM: first request at once
    gaps = gaps_s(requests)
    assert all(gap >= 0 for gap in gaps)
    # Mean of 1999 exponential gaps: standard error 0.2 / sqrt(1999) = 2.2 % of the mean.
    assert statistics.fmean(gaps) == pytest.approx(0.2, rel=0.07)
    # Exponential: the standard deviation equals the mean.
    assert statistics.pstdev(gaps) == pytest.approx(0.2, rel=0.1)


def test_gamma_burstiness_changes_variance_not_mean() -> None:
    def gaps(burstiness: float) -> list[float]:
        spec = WorkloadSpec("gamma", 2000, request_rate=5.0, burstiness=burstiness, seed=4)
        return gaps_s(generate(spec))

    bursty, poisson_like, smooth = gaps(0.25), gaps(1.0), gaps(4.0)
    for sample in (bursty, poisson_like, smooth):
        assert statistics.fmean(sample) == pytest.approx(0.2, rel=0.12)
    # Coefficient of variation 1 / sqrt(shape): 2, 1 and 0.5.
    cv = [statistics.pstdev(s) / statistics.fmean(s) for s in (bursty, poisson_like, smooth)]
    assert cv[0] > 1.6 and 0.9 < cv[1] < 1.1 and 0.4 < cv[2] < 0.6


def test_gamma_with_burstiness_one_is_the_poisson_process() -> None:
    poisson = generate(WorkloadSpec("poisson", 20, request_rate=3.0, seed=5))
    gamma = generate(WorkloadSpec("gamma", 20, request_rate=3.0, burstiness=1.0, seed=5))
    assert gamma == poisson


def test_rate_mix_proportions() -> None:
    spec = WorkloadSpec("burst", 2000, rates=RateMix.parse("15:0.4,20:0.6"), seed=6)
    rates = [r.rate_tps for r in generate(spec)]
    assert set(rates) == {15.0, 20.0}
    assert rates.count(15.0) / len(rates) == pytest.approx(0.4, abs=0.04)


def test_changing_the_rate_mix_keeps_arrivals_and_lengths() -> None:
    base = WorkloadSpec("poisson", 30, request_rate=2.0, seed=8)
    mixed = WorkloadSpec("poisson", 30, request_rate=2.0, seed=8, rates=RateMix.parse("15,30"))
    strip = [(r.arrival_s, r.num_prompt_tokens, r.num_output_tokens) for r in generate(base)]
    assert strip == [
        (r.arrival_s, r.num_prompt_tokens, r.num_output_tokens) for r in generate(mixed)
    ]


def test_lengths_follow_the_normal_and_are_clipped() -> None:
    rng = random.Random(0)
    wide = LengthDist(100, 1000, minimum=50, maximum=150)
    samples = [wide.sample(rng) for _ in range(500)]
    assert min(samples) == 50 and max(samples) == 150
    normal = [LengthDist(512, 128).sample(rng) for _ in range(4000)]
    assert statistics.fmean(normal) == pytest.approx(512, rel=0.02)
    assert statistics.pstdev(normal) == pytest.approx(128, rel=0.05)
    assert all(isinstance(n, int) and n >= 1 for n in normal)
    assert {LengthDist(7, 0).sample(rng) for _ in range(10)} == {7}
    assert {LengthDist(3, 50).sample(rng) for _ in range(200)} >= {1}  # the default minimum


def test_generated_lengths_come_from_the_spec() -> None:
    spec = WorkloadSpec("burst", 50, prompt=LengthDist(64, 0), output=LengthDist(9, 0))
    assert {(r.num_prompt_tokens, r.num_output_tokens) for r in generate(spec)} == {(64, 9)}


# -- parsing ------------------------------------------------------------------------------------
def test_length_parse() -> None:
    assert LengthDist.parse("512") == LengthDist(512.0, 0.0)
    assert LengthDist.parse(" 512:128 ") == LengthDist(512.0, 128.0)
    assert LengthDist.parse("1024:256", maximum=4096) == LengthDist(1024.0, 256.0, 1, 4096)


@pytest.mark.parametrize("text", ["", "abc", "512:", ":128", "1:2:3", "-5", "0", "512:-1", "nan"])
def test_length_parse_errors(text: str) -> None:
    with pytest.raises(WorkloadError):
        LengthDist.parse(text)


def test_length_bounds_are_validated() -> None:
    with pytest.raises(WorkloadError, match="maximum"):
        LengthDist(10, 1, minimum=5, maximum=4)
    with pytest.raises(WorkloadError, match="minimum"):
        LengthDist(10, 1, minimum=0)


def test_rate_mix_parse_normalises_weights() -> None:
    assert RateMix.parse("20") == RateMix((20.0,), (1.0,))
    mix = RateMix.parse("15:2,20:3")
    assert mix.rates_tps == (15.0, 20.0) and mix.weights == pytest.approx((0.4, 0.6))
    assert RateMix.parse("15, 30").weights == (0.5, 0.5)


@pytest.mark.parametrize(
    "text",
    ["", "0", "-20", "nan", "inf", "fast", "15:0.4,20", "15:-1,20:1", "15:0,20:0", "15:1:2", "15,"],
)
def test_rate_mix_parse_errors(text: str) -> None:
    with pytest.raises(WorkloadError):
        RateMix.parse(text)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"kind": "uniform"}, "unknown workload kind"),
        ({"kind": "burst", "num_requests": 0}, "num_requests"),
        ({"kind": "burst", "num_requests": True}, "num_requests"),
        ({"kind": "poisson", "request_rate": 0.0}, "request_rate"),
        ({"kind": "gamma", "burstiness": -1.0}, "burstiness"),
        ({"kind": "poisson", "burstiness": 0.5}, "burstiness"),
        ({"kind": "trace"}, "trace_path"),
        ({"kind": "burst", "trace_path": "x.jsonl"}, "trace_path"),
        ({"kind": "burst", "seed": 1.5}, "seed"),
    ],
)
def test_spec_validation(kwargs: dict, match: str) -> None:
    with pytest.raises(WorkloadError, match=match):
        WorkloadSpec(**kwargs)


# -- trace files --------------------------------------------------------------------------------
def write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "trace.jsonl"
    path.write_text(text, encoding="utf-8")
    return str(path)


def test_trace_is_read_sorted_stably_and_numbered(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        '{"arrival_s": 2.5, "prompt_tokens": 10, "output_tokens": 20}\n'
        "\n"
        '{"arrival_s": 1, "prompt_tokens": 11, "output_tokens": 21, "rate_tps": 15}\n'
        "   \n"
        '{"arrival_s": 2.5, "prompt_tokens": 12, "output_tokens": 22}\n',
    )
    assert load_trace(path, default_rate_tps=20.0) == [
        WorkloadRequest("req-0", 1.0, 11, 21, 15.0),
        WorkloadRequest("req-1", 2.5, 10, 20, 20.0),
        WorkloadRequest("req-2", 2.5, 12, 22, 20.0),
    ]


def test_generate_trace_fills_missing_rates_from_the_mix(tmp_path: Path) -> None:
    lines = [f'{{"arrival_s": {i}, "prompt_tokens": 5, "output_tokens": 6}}' for i in range(200)]
    lines.append('{"arrival_s": 0.5, "prompt_tokens": 5, "output_tokens": 6, "rate_tps": 7.5}')
    path = write(tmp_path, "\n".join(lines))
    spec = WorkloadSpec("trace", trace_path=path, rates=RateMix.parse("15:0.5,20:0.5"), seed=2)
    requests = generate(spec)
    assert len(requests) == 201 and requests[1].rate_tps == 7.5
    assert {r.rate_tps for r in requests} == {7.5, 15.0, 20.0}
    assert generate(spec) == requests


@pytest.mark.parametrize(
    ("line", "match"),
    [
        ('{"arrival_s": 1, "prompt_tokens": 2', "invalid JSON"),
        ("[1, 2, 3]", "expected a JSON object"),
        ('{"arrival_s": 1, "prompt_tokens": 2}', r"missing key\(s\) \['output_tokens'\]"),
        ('{"arrival_s": 1, "prompt_tokens": 2, "output_tokens": 3, "x": 1}', "unknown key"),
        ('{"arrival_s": 1, "arrival_s": 2, "prompt_tokens": 2, "output_tokens": 3}', "repeated"),
        ('{"arrival_s": -1, "prompt_tokens": 2, "output_tokens": 3}', "arrival_s"),
        ('{"arrival_s": NaN, "prompt_tokens": 2, "output_tokens": 3}', "arrival_s"),
        ('{"arrival_s": Infinity, "prompt_tokens": 2, "output_tokens": 3}', "arrival_s"),
        ('{"arrival_s": "1", "prompt_tokens": 2, "output_tokens": 3}', "arrival_s"),
        ('{"arrival_s": true, "prompt_tokens": 2, "output_tokens": 3}', "arrival_s"),
        ('{"arrival_s": 1, "prompt_tokens": 2.5, "output_tokens": 3}', "prompt_tokens"),
        ('{"arrival_s": 1, "prompt_tokens": 2, "output_tokens": 0}', "output_tokens"),
        ('{"arrival_s": 1, "prompt_tokens": 2, "output_tokens": -3}', "output_tokens"),
        ('{"arrival_s": 1, "prompt_tokens": null, "output_tokens": 3}', "prompt_tokens"),
        ('{"arrival_s": 1, "prompt_tokens": 2, "output_tokens": 3, "rate_tps": 0}', "rate_tps"),
        ('{"arrival_s": 1, "prompt_tokens": 2, "output_tokens": 3, "rate_tps": NaN}', "rate_tps"),
        ('{"arrival_s": 1, "prompt_tokens": 2, "output_tokens": 3, "rate_tps": null}', "rate_tps"),
        ('{"arrival_s": 1, "prompt_tokens": 2, "output_tokens": 3, "rate_tps": "x"}', "rate_tps"),
        (
            '{"arrival_s": 1, "prompt_tokens": 2, "output_tokens": 3, "rate_tps": 2000}',
            r"rate_tps: a reader's rate must be a number of tokens/s in \[0.001, 1000\], got 2000",
        ),
    ],
)
def test_trace_errors_name_file_and_line(tmp_path: Path, line: str, match: str) -> None:
    good = '{"arrival_s": 0, "prompt_tokens": 1, "output_tokens": 1}'
    path = write(tmp_path, f"{good}\n\n{line}\n{good}\n")
    with pytest.raises(WorkloadError, match=match) as caught:
        load_trace(path, default_rate_tps=20.0)
    message = str(caught.value)
    assert message.startswith(f"{path}:3: ") and "\n" not in message


def test_a_rate_the_server_and_the_simulator_refuse_never_makes_a_workload(tmp_path: Path) -> None:
    # (`is_reader_rate`'s bound: the one the server and the simulator's Request hold too)
    with pytest.raises(WorkloadError, match="default_rate_tps: a reader's rate must be"):
        load_trace(
            write(tmp_path, '{"arrival_s": 0, "prompt_tokens": 1, "output_tokens": 1}'), 2000
        )
    with pytest.raises(WorkloadError, match="rate: a reader's rate must be"):
        RateMix.parse("20,2000")
    with pytest.raises(WorkloadError, match="request r: rate_tps: a reader's rate must be"):
        WorkloadRequest("r", 0.0, 1, 1, 2000.0)
    assert WorkloadRequest("r", 0.0, 1, 1, 1000.0, consumption="eager").rate_tps == 1000.0
    with pytest.raises(WorkloadError, match="class must be one of reader, eager, batch"):
        WorkloadRequest("r", 0.0, 1, 1, 4.0, consumption="robot")


def test_trace_file_level_errors(tmp_path: Path) -> None:
    with pytest.raises(WorkloadError, match="cannot read trace file"):
        load_trace(str(tmp_path / "missing.jsonl"), 20.0)
    with pytest.raises(WorkloadError, match="has no requests"):
        load_trace(write(tmp_path, "\n  \n"), 20.0)
    (tmp_path / "latin1.jsonl").write_bytes(b'{"arrival_s": 0}\xff\n')
    with pytest.raises(WorkloadError, match="not UTF-8"):
        load_trace(str(tmp_path / "latin1.jsonl"), 20.0)
    with pytest.raises(WorkloadError, match="default_rate_tps"):
        load_trace(write(tmp_path, '{"arrival_s": 0, "prompt_tokens": 1, "output_tokens": 1}'), 0)
