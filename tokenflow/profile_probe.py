"""The serving path's own cost per step, measured through a real server and the bench client.

Between two engine steps the server delivers the step's tokens to the HTTP thread, which frames
and sends them while the engine thread waits for the interpreter lock, and the bench client
(another process on the same CPU) parses them.  None of it shows in the executor's sweep, so
`tokenflow profile` starts `tokenflow serve` (the same engine flags, FCFS) and streams bursts
of B requests that nobody reads slowly (rate 1000 tok/s): every decode step then carries all B
streams, and the median gap between a stream's tokens is one whole step.  The same burst runs
through the profiled engine's whole step in this process, alternating with the server's, so
both meet the same machine: what the server's step exceeds the in-process one by is the
serving path's cost at batch B (the simulator charges the in-process step already), and two
batch sizes give its fixed and per-stream parts.

The in-process bursts also anchor the sweep in time: a shared CPU's speed drifts by tens of
percent within minutes, so the sweep's fit is scaled by how fast the machine ran the probe's
in-process steps (at the end of the profile, the moment nearest to what is simulated next)
against what the fit predicts for them (`speed_factor`).
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from tokenflow.bench.client import ClientConfig, run_workload
from tokenflow.bench.compare import local_server
from tokenflow.core.request import SamplingParams
from tokenflow.sim.overhead import default_overhead
from tokenflow.sim.profile_costs import StepCosts, nonnegative_lstsq
from tokenflow.sim.profile_file import ProbePoint
from tokenflow.workload import WorkloadRequest

if TYPE_CHECKING:
    from tokenflow.engine.llm_engine import LLMEngine

PROBE_BATCHES = (4, 16)
PROBE_PROMPT_WORDS = 32
_OUTPUT_TOKENS = 48
_SKIP_TOKENS = 8  # the first gaps hold the prefill and the batch filling up
_UNREAD_RATE_TPS = 1000.0


def probe_requests(batch: int) -> list[WorkloadRequest]:
    return [
        WorkloadRequest(f"p{batch}-{i}", 0.0, PROBE_PROMPT_WORDS, _OUTPUT_TOKENS, _UNREAD_RATE_TPS)
        for i in range(batch)
    ]


def median_gap_s(token_times: Sequence[Sequence[float]]) -> float:
    """The median gap between consecutive tokens of a stream, past the first few."""
    gaps = [
        b - a
        for times in token_times
        for a, b in zip(times[_SKIP_TOKENS:], times[_SKIP_TOKENS + 1 :], strict=False)
    ]
    if not gaps:
        raise ValueError("the probe streams returned too few tokens")
    return statistics.median(gaps)


def in_process_step_s(engine: LLMEngine, batch: int, prompt_tokens: int) -> float:
    """The median decode step of the same burst through the profiled engine's whole step
    (scheduler, forward pass, output processing, the stats the server reads), in this process."""
    params = SamplingParams(max_tokens=_OUTPUT_TOKENS, min_tokens=_OUTPUT_TOKENS, ignore_eos=True)
    for i in range(batch):
        prompt = [1000 + (13 * i + j) % 5000 for j in range(prompt_tokens)]
        engine.add_request(f"probe-{batch}-{i}-{time.monotonic_ns()}", prompt, params, 1000.0)
    steps_s, num_steps = [], 0
    while engine.has_work:
        begin = time.perf_counter()
        engine.step()
        engine.stats()
        num_steps += 1
        if num_steps > _SKIP_TOKENS + 1:
            steps_s.append(time.perf_counter() - begin)
    if not steps_s:
        raise ValueError("the in-process probe burst ran too few steps")
    return statistics.median(steps_s)


def probe_serving_path(
    serve_args: Sequence[str],
    engine: LLMEngine,
    prompt_tokens: Callable[[int], int],
    repeats: int = 2,
) -> list[ProbePoint]:
    """Start a server; per probe batch, alternate a burst through it with the same burst
    through `engine` in this process, `repeats` times each (so both meet the same machine)."""
    points = []
    num_prompt = prompt_tokens(PROBE_PROMPT_WORDS)
    with local_server("fcfs", list(serve_args)) as url:
        config = ClientConfig(url=url, show_progress=False, timeout_s=600.0)
        asyncio.run(run_workload(probe_requests(2), config))  # warm the server up
        for batch in PROBE_BATCHES:
            gaps, steps = [], []
            for _ in range(repeats):
                run = asyncio.run(run_workload(probe_requests(batch), config))
                gaps.append(median_gap_s([t.token_times_s for t in run.traces]))
                steps.append(in_process_step_s(engine, batch, num_prompt))
            points.append(ProbePoint(batch, statistics.median(gaps), statistics.median(steps)))
    return points


def in_process_prediction_s(costs: StepCosts, batch: int, prompt_tokens: int) -> float:
    """What `costs` (as fitted, before any speed factor) predict for a step of the in-process
    probe burst: the forward pass at its mean context, the scheduler's charge, the engine's
    own time."""
    context = prompt_tokens + _SKIP_TOKENS + (_OUTPUT_TOKENS - _SKIP_TOKENS) // 2
    fit = costs.compute_fit(batch)
    compute_s = fit.time_s(batch, batch * context, 0, 0)
    engine_s = costs.server_step_s + costs.server_per_chunk_s * batch
    return compute_s + default_overhead("fcfs").step_s(batch) + engine_s


def speed_factor(costs: StepCosts, points: Sequence[ProbePoint], prompt_tokens: int) -> float:
    """How much slower (> 1) or faster the machine ran the probe's in-process steps, at the
    end of the profile, than the sweep's fit predicts: the median over the probe's batches."""
    ratios = [
        p.in_process_step_s / in_process_prediction_s(costs, p.batch, prompt_tokens)
        for p in points
    ]
    return statistics.median(ratios) if ratios else 1.0


def serving_costs(points: Sequence[ProbePoint]) -> tuple[float, float]:
    """(fixed, per stream) seconds of the serving path per step, never below zero."""
    import numpy as np

    rows = np.array([[1.0, float(p.batch)] for p in points])
    serving = np.array([p.step_gap_s - p.in_process_step_s for p in points])
    fixed_s, per_stream_s = nonnegative_lstsq(rows, serving)
    return float(fixed_s), float(per_stream_s)
