"""The profiled workloads TokenFlow is held to against FCFS: `benchmarks/profiled_workloads.py`.

The five fidelity workloads (`tokenflow.eval.fidelity.WORKLOADS`) and three more, each played
on a profiled CPU engine (`tokenflow simulate --profile`) at several workload seeds.  A run is
scored on its readers (the class mix's eager and batch requests are left out of stall, TTFT and
QoE, as `benchmarks/class_mix.py` scores them), and on all its tokens for raw throughput.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from tokenflow.calibrate.profile_file import Profile
from tokenflow.eval.fidelity import WORKLOADS, Workload
from tokenflow.eval.metrics import RequestTrace, summarize, summarize_by_class
from tokenflow.eval.workload import ClassMix, LengthDist, RateMix, WorkloadSpec, generate
from tokenflow.sim.profiled import ProfiledDeployment, build_profiled_engine
from tokenflow.sim.runner import SimConfig, run_engine


def _burst(n: int, prompt: str, output: str, rates: str, classes: str = "reader") -> WorkloadSpec:
    return WorkloadSpec(
        kind="burst",
        num_requests=n,
        prompt=LengthDist.parse(prompt, minimum=8),
        output=LengthDist.parse(output, minimum=8),
        rates=RateMix.parse(rates),
        classes=ClassMix.parse(classes),
    )


_LONG_PROMPTS = WorkloadSpec(
    kind="poisson",
    num_requests=20,
    request_rate=0.5,
    prompt=LengthDist.parse("1024:256", minimum=8),
    output=LengthDist.parse("64:16", minimum=8),
    rates=RateMix.parse("4"),
)

SUITE = (
    *WORKLOADS,
    Workload("burst-40", "burst of 40, prompt 128 / output 160, readers 2-4 tok/s, device KV "
             "1664 tokens", _burst(40, "128", "160", "2:0.5,4:0.5"), 1664),
    Workload("long-prompts-20", "Poisson 0.5 req/s x 20, prompt 1024:256 / output 64:16, "
             "readers 4 tok/s", _LONG_PROMPTS, 4096),
    Workload("class-mix-40", "burst of 40, prompt 96 / output 160, 60% readers at 4-8 tok/s, 30% "
             "eager, 10% batch, device KV 1664 tokens",
             _burst(40, "96", "160", "4:0.5,8:0.5", "reader:0.6,eager:0.3,batch:0.1"), 1664),
)  # fmt: skip


def suite_workload(name: str) -> Workload:
    """The suite's workload called `name`."""
    for workload in SUITE:
        if workload.name == name:
            return workload
    raise ValueError(f"unknown workload {name!r}; choose from {[w.name for w in SUITE]}")


def run_suite_workload(profile: Profile, workload: Workload, policy: str, seed: int) -> dict:
    """One simulated run, scored by `suite_score`."""
    requests = generate(replace(workload.spec, seed=seed))
    deployment = ProfiledDeployment(profile, device_kv_tokens=workload.device_kv_tokens)
    engine = build_profiled_engine(deployment, policy)
    return suite_score(run_engine(requests, policy, engine, SimConfig()).traces)


def suite_score(traces: Sequence[RequestTrace]) -> dict:
    """How the suite scores a run, simulated or real: the readers' summary, with the whole
    run's raw throughput and preemptions."""
    readers = summarize_by_class(traces)["reader"].to_dict()
    whole = summarize(traces).to_dict()
    return {
        **readers,
        "throughput_tps": whole["throughput_tps"],
        "num_preemptions": whole["num_preemptions"],
    }
