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
against what the fit predicts for them: decode by the bursts' decode steps (`speed_factor`),
prefill by a lone request's first step (`prefill_speed_factor`; one factor for both predicted
prefills 12% short when the decode fit alone was off).  The lone request's prompt is as long as
the engine's smallest prefill chunk (128 tokens, so it is prefilled in one step), the size of
the prefill steps a workload makes: a factor taken from a 62-token prompt, where the sweep's
line fits worst, made the simulator's 1024-token prompts 13-47% late.  The lone request also
prices the serving path once per request (`request_path_s`): its time to first token through
the server and the client beyond the same request's in-process one (HTTP, tokenizing, the
template, the first delta's way out), which no per-step charge holds.

The in-process steps hold the simulator's scheduling charge for the probe server's policy
(`PROBE_POLICY`), which the sweep's fit does not; the caller passes that charge in
(`scheduler_step_s`, seconds per step of n requests), since the simulator's table of charges
lies above calibration.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from tokenflow.calibrate.costs import StepCosts, nonnegative_lstsq
from tokenflow.calibrate.profile_file import ProbePoint
from tokenflow.core.request import SamplingParams
from tokenflow.eval.client import ClientConfig, run_workload
from tokenflow.eval.local_server import local_server
from tokenflow.eval.workload import WorkloadRequest

if TYPE_CHECKING:
    from tokenflow.engine.llm_engine import LLMEngine

PROBE_POLICY = "fcfs"  # the probe server's policy, so the scheduling charge its steps hold
PROBE_BATCHES = (1, 4, 16)  # 1: the lone request
PROBE_PROMPT_WORDS = 32  # the bursts' streams: short, so their prefill ends in a few steps
LONE_PROMPT_WORDS = 96  # the lone request: 126 tokens with the chat template (see above)
_OUTPUT_TOKENS = 48
_SKIP_TOKENS = 8  # the first gaps hold the prefill and the batch filling up
_UNREAD_RATE_TPS = 1000.0


def prompt_words(batch: int) -> int:
    """The prompt (words) of each stream of a probe burst of `batch`."""
    return LONE_PROMPT_WORDS if batch == 1 else PROBE_PROMPT_WORDS


def probe_requests(batch: int) -> list[WorkloadRequest]:
    words = prompt_words(batch)
    return [
        WorkloadRequest(f"p{batch}-{i}", 0.0, words, _OUTPUT_TOKENS, _UNREAD_RATE_TPS)
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


def in_process_burst(engine: LLMEngine, batch: int, prompt_tokens: int) -> tuple[float, float]:
    """The same burst through the profiled engine's whole step (scheduler, forward pass, output
    processing, the stats the server reads), in this process: the median decode step, and the
    median time from a request's arrival to its first token."""
    params = SamplingParams(max_tokens=_OUTPUT_TOKENS, min_tokens=_OUTPUT_TOKENS, ignore_eos=True)
    added_s: dict[str, float] = {}
    for i in range(batch):
        prompt = [1000 + (13 * i + j) % 5000 for j in range(prompt_tokens)]
        request_id = f"probe-{batch}-{i}-{time.monotonic_ns()}"
        added_s[request_id] = time.perf_counter()
        engine.add_request(request_id, prompt, params, 1000.0)
    steps_s, ttfts_s, num_steps = [], [], 0
    while engine.has_work:
        begin = time.perf_counter()
        _, deltas = engine.step()
        engine.stats()
        end = time.perf_counter()
        num_steps += 1
        if num_steps > _SKIP_TOKENS + 1:
            steps_s.append(end - begin)
        for delta in deltas:
            if delta.token_ids and delta.request_id in added_s:
                ttfts_s.append(end - added_s.pop(delta.request_id))
    if not steps_s or not ttfts_s:
        raise ValueError("the in-process probe burst ran too few steps")
    return statistics.median(steps_s), statistics.median(ttfts_s)


def probe_serving_path(
    serve_args: Sequence[str],
    engine: LLMEngine,
    prompt_tokens: Callable[[int], int],
    repeats: int = 2,
) -> list[ProbePoint]:
    """Start a server; per probe batch, alternate a burst through it with the same burst
    through `engine` in this process, `repeats` times each (so both meet the same machine)."""
    points = []
    with local_server(PROBE_POLICY, list(serve_args)) as url:
        config = ClientConfig(url=url, show_progress=False, timeout_s=600.0)
        asyncio.run(run_workload(probe_requests(2), config))  # warm the server up
        for batch in PROBE_BATCHES:
            num_prompt = prompt_tokens(prompt_words(batch))
            gaps, ttfts, steps, in_process_ttfts = [], [], [], []
            for _ in range(repeats * 2 if batch == 1 else repeats):  # (lone: cheap, noisy)
                traces = asyncio.run(run_workload(probe_requests(batch), config)).traces
                gaps.append(median_gap_s([t.token_times_s for t in traces]))
                ttfts.append(statistics.median(t.token_times_s[0] - t.arrival_s for t in traces))
                step_s, ttft_s = in_process_burst(engine, batch, num_prompt)
                steps.append(step_s)
                in_process_ttfts.append(ttft_s)
            median = statistics.median
            points.append(
                ProbePoint(
                    batch=batch,
                    step_gap_s=median(gaps),
                    in_process_step_s=median(steps),
                    ttft_s=median(ttfts),
                    in_process_ttft_s=median(in_process_ttfts),
                    prompt_tokens=num_prompt,
                )
            )
    return points


def in_process_prediction_s(
    costs: StepCosts, batch: int, prompt_tokens: int, scheduler_step_s: Callable[[int], float]
) -> float:
    """What `costs` (as fitted, before any speed factor) predict for a step of the in-process
    probe burst: the forward pass at its mean context, the scheduler's charge, the engine's
    own time."""
    context = prompt_tokens + _SKIP_TOKENS + (_OUTPUT_TOKENS - _SKIP_TOKENS) // 2
    fit = costs.compute_fit(batch)
    compute_s = fit.time_s(batch, batch * context, 0, 0)
    engine_s = costs.server_step_s + costs.server_per_chunk_s * batch
    return compute_s + scheduler_step_s(batch) + engine_s


def speed_factor(
    costs: StepCosts, points: Sequence[ProbePoint], scheduler_step_s: Callable[[int], float]
) -> float:
    """How much slower (> 1) or faster the machine ran the probe's in-process steps, at the
    end of the profile, than the sweep's fit predicts: the median over the probe's batches."""
    ratios = [
        p.in_process_step_s
        / in_process_prediction_s(costs, p.batch, p.prompt_tokens, scheduler_step_s)
        for p in points
    ]
    return statistics.median(ratios) if ratios else 1.0


def lone_point(points: Sequence[ProbePoint]) -> ProbePoint | None:
    """The probe's lone request (batch 1, both times to first token measured), if any."""
    lone = [p for p in points if p.batch == 1 and p.ttft_s > 0 and p.in_process_ttft_s > 0]
    return lone[0] if lone else None


def prefill_speed_factor(
    costs: StepCosts,
    points: Sequence[ProbePoint],
    decode_factor: float,
    scheduler_step_s: Callable[[int], float],
) -> float:
    """How much slower (> 1) the lone request's in-process first step ran its prefill than the
    fit predicts, once the step's base (at `decode_factor`), the scheduler's charge and the
    engine's own time are taken off; 1.0 without a lone request."""
    lone = lone_point(points)
    if lone is None:
        return 1.0
    prompt_tokens = lone.prompt_tokens
    fit = costs.compute_fit(prompt_tokens)
    base_s = fit.time_s(0, 0, 0, 0)
    pairs = prompt_tokens * (prompt_tokens + 1) // 2
    prefill_s = fit.time_s(0, 0, prompt_tokens, pairs) - base_s
    engine_s = costs.server_step_s + costs.server_per_chunk_s
    fixed_s = base_s * decode_factor + scheduler_step_s(1) + engine_s
    measured_s = lone.in_process_ttft_s - fixed_s
    return max(measured_s / prefill_s, 0.1) if prefill_s > 0 else 1.0


def request_path_s(points: Sequence[ProbePoint]) -> float:
    """The serving path's time per request: the lone request's time to first token through the
    server and the client beyond its in-process one, never below zero; 0 without one."""
    lone = lone_point(points)
    return max(lone.ttft_s - lone.in_process_ttft_s, 0.0) if lone else 0.0


def serving_costs(points: Sequence[ProbePoint]) -> tuple[float, float]:
    """(fixed, per stream) seconds of the serving path per step, never below zero."""
    import numpy as np

    rows = np.array([[1.0, float(p.batch)] for p in points])
    serving = np.array([p.step_gap_s - p.in_process_step_s for p in points])
    fixed_s, per_stream_s = nonnegative_lstsq(rows, serving)
    return float(fixed_s), float(per_stream_s)
