"""Reading a server's preemption counters from its Prometheus text, ours and vLLM's."""

from __future__ import annotations

from tokenflow.eval.server_counters import counted_during, parse_counters

OURS = """\
# HELP tokenflow_preemptions_total Preemptions since start.
# TYPE tokenflow_preemptions_total counter
tokenflow_preemptions_total 20.0
# HELP tokenflow_kv_loads_total Host-to-device KV loads since start.
# TYPE tokenflow_kv_loads_total counter
tokenflow_kv_loads_total 18.0
"""

VLLM = """\
# HELP vllm:num_preemptions_total Cumulative number of preemption from the engine.
# TYPE vllm:num_preemptions_total counter
vllm:num_preemptions_total{engine="0",model_name="a"} 4.0
vllm:num_preemptions_total{engine="1",model_name="a"} 3.0
# HELP vllm:num_preemptions_created Cumulative number of preemption from the engine.
# TYPE vllm:num_preemptions_created gauge
vllm:num_preemptions_created{engine="0",model_name="a"} 1.7e9
"""


def test_our_counters_are_read_by_name() -> None:
    assert parse_counters(OURS) == {"preemptions": 20.0, "kv_loads": 18.0}


def test_vllms_preemptions_are_summed_over_engines_without_the_created_stamp() -> None:
    assert parse_counters(VLLM) == {"preemptions": 7.0}


def test_a_text_without_counters_gives_none() -> None:
    assert parse_counters("# nothing here\n") == {}


def test_only_counters_read_both_times_are_differenced() -> None:
    before = {"preemptions": 20.0, "kv_loads": 18.0}
    after = {"preemptions": 26.0, "recomputes": 2.0}
    assert counted_during(before, after) == {"preemptions": 6}
