"""The vLLM bridge's cost per engine step and per decision, on mirrors of fake vLLM requests.

The bridge rebuilds its view of vLLM's queues every step (`PolicyBridge.view`) and the policy
decides about once an interval.  This times, alternated in one process: the view per step,
the decision on it, and the decision on the same view without the residents not decoding
(`unsettled`) and by arrival (the policy then surveys every member, as the bridge's decisions
did before the view named them), with the ratio of the two decisions.

    python benchmarks/bridge_view.py [--running 300] [--waiting 100] [--repeats 200]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from dataclasses import dataclass, field, replace

from tokenflow.core.config import SchedulerConfig, TokenFlowConfig
from tokenflow.core.policies import make_policy
from tokenflow.integrations.vllm.bridge import PolicyBridge, PoolShape, PoolState

BLOCK_SIZE = 16


@dataclass
class FakeVllmRequest:
    """What the bridge reads of a vLLM request (`bridge.VllmRequestLike`)."""

    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int = 2000
    num_computed_tokens: int = 0
    num_preemptions: int = 0
    output_token_ids: list[int] = field(default_factory=list)


def busy_bridge(num_running: int, num_waiting: int, seed: int = 0):
    """A bridge mirroring `num_running` decoding streams (read at 15 tok/s, 1-300 tokens
    out) and `num_waiting` new ones, and what to pass its `view` each step."""
    rng = random.Random(seed)
    config = SchedulerConfig(max_num_seqs=512)
    policy = make_policy("tokenflow", config, TokenFlowConfig())
    bridge = PolicyBridge(policy, config, PoolShape(20000, BLOCK_SIZE, 2.0, 0.01))
    running, waiting = [], []
    for i in range(num_running + num_waiting):
        request = FakeVllmRequest(f"r{i}", [1] * rng.randint(100, 600))
        if i < num_running:
            request.output_token_ids = [1] * rng.randint(1, 300)
            total = len(request.prompt_token_ids) + len(request.output_token_ids)
            request.num_computed_tokens = total - 1
            running.append(request)
        else:
            waiting.append(request)
        bridge.track(request, 15.0, 0.0)
    blocks = {r.request_id: -(-r.num_computed_tokens // BLOCK_SIZE) for r in running}
    return bridge, running, waiting, PoolState(20000 - sum(blocks.values()), blocks)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--running", type=int, default=300)
    parser.add_argument("--waiting", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=200)
    args = parser.parse_args()
    bridge, running, waiting, pool = busy_bridge(args.running, args.waiting)
    counted = make_policy("tokenflow", bridge.config, TokenFlowConfig())
    surveyed = make_policy("tokenflow", bridge.config, TokenFlowConfig())
    samples: dict[str, list[float]] = {"view": [], "counted": [], "surveyed": []}
    for k in range(args.repeats):
        start = time.perf_counter()
        view = bridge.view(running, waiting, pool, now_s=1.0 + 0.01 * k)
        samples["view"].append(time.perf_counter() - start)
        bare = replace(view, unsettled=None, running_by_arrival=None)
        for name, policy, decided in (("counted", counted, view), ("surveyed", surveyed, bare)):
            start = time.perf_counter()
            policy.decide(decided)
            samples[name].append(time.perf_counter() - start)
    ms = {name: statistics.median(values) * 1e3 for name, values in samples.items()}
    print(f"{args.running} running, {args.waiting} waiting mirrors (median of {args.repeats})")
    print(f"view per step {ms['view']:.3f} ms")
    ratio = ms["surveyed"] / ms["counted"]
    counted_ms, surveyed_ms = ms["counted"], ms["surveyed"]
    print(f"decision on the view {counted_ms:.3f} ms, surveyed {surveyed_ms:.3f} ms: {ratio:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
