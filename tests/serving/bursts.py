"""A reading burst played by the bench client in a background thread, while a test polls."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor

from tokenflow.eval.client import BenchRun, ClientConfig, run_workload
from tokenflow.eval.workload import LengthDist, RateMix, WorkloadSpec, generate


def burst_spec(num_requests: int, output_tokens: int, rate_tps: float) -> WorkloadSpec:
    """`num_requests` readers at `rate_tps`, all arriving at once, 24-token prompts."""
    return WorkloadSpec(
        kind="burst",
        num_requests=num_requests,
        prompt=LengthDist(24, 0),
        output=LengthDist(output_tokens, 0),
        rates=RateMix.parse(f"{rate_tps:g}"),
        seed=0,
    )


@contextlib.contextmanager
def burst_in_thread(
    url: str, spec: WorkloadSpec, api_key: str | None = None
) -> Iterator[Future[BenchRun]]:
    """Start the burst; yield its future (done once every stream ended); wait for it on exit."""
    config = ClientConfig(
        url=url, endpoint="completions", api_key=api_key, show_progress=False, timeout_s=600
    )
    with ThreadPoolExecutor(max_workers=1) as pool:
        future = pool.submit(asyncio.run, run_workload(generate(spec), config, name="burst"))
        yield future
        future.result()
