"""Preemption is exact on the real engine: streams that are offloaded and reloaded (or dropped
and recomputed) produce exactly the tokens they produce when run alone (greedy), on the CPU
and (a `gpu` test) on CUDA, with real copies to the pinned host tier, in float32."""

import pytest

from tests.model.helpers import DEVICES
from tokenflow.core.request import SamplingParams
from tokenflow.engine.engine_args import EngineArgs
from tokenflow.engine.llm_engine import LLMEngine

PROMPTS = [f"Story number {i}: once upon a time" for i in range(6)]
PARAMS = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
DTYPE = {"cpu": None, "cuda": "float32"}  # the CPU's default; CUDA's (bfloat16) is not exact


class StepClock:
    """Deterministic time: each engine step takes 50 ms, whatever the machine's speed."""

    def __init__(self) -> None:
        self.t = 0.0

    def now(self) -> float:
        return self.t


def run(engine: LLMEngine, rate_tps: float) -> dict[str, list[int]]:
    clock = StepClock()
    engine.core.clock = clock
    tokens: dict[str, list[int]] = {}
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"r{i}", engine.tokenizer.encode(prompt), PARAMS, rate_tps)
        tokens[f"r{i}"] = []
    steps = 0
    while engine.has_work:
        _, deltas = engine.step()
        clock.t += 0.05
        engine.scheduler.kv.check_integrity()
        for d in deltas:
            tokens[d.request_id].extend(d.token_ids)
        steps += 1
        assert steps < 20_000
    return tokens


def run_alone(model_dir: str, device: str) -> dict[str, list[int]]:
    args = EngineArgs(model=model_dir, device=device, dtype=DTYPE[device], policy="fcfs")
    engine = LLMEngine(args)
    result = {}
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"r{i}", engine.tokenizer.encode(prompt), PARAMS)
        out = []
        while engine.has_work:
            out.extend(t for d in engine.step()[1] for t in d.token_ids)
        result[f"r{i}"] = out
    return result


@pytest.fixture(scope="module", params=DEVICES)
def device(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def alone(tiny_model_dir, device):
    return run_alone(tiny_model_dir, device)


def test_offload_and_reload_many_times_is_exact(tiny_model_dir, device, alone):
    # 12 blocks of 8 tokens hold two of six ~50-token streams; slow readers build big buffers.
    args = EngineArgs(
        model=tiny_model_dir,
        device=device,
        dtype=DTYPE[device],
        policy="tokenflow",
        block_size=8,
        device_kv_tokens=96,
        host_kv_tokens=4096,
    )
    engine = LLMEngine(args)
    tokens = run(engine, rate_tps=2.0)
    s = engine.scheduler
    assert s.num_loads_total >= 4, "the setup must reload streams from the host tier"
    assert s.num_preemptions_total >= 4
    assert tokens == alone


def test_recompute_after_oom_retraction_is_exact(tiny_model_dir, device, alone):
    args = EngineArgs(
        model=tiny_model_dir,
        device=device,
        dtype=DTYPE[device],
        policy="fcfs",
        block_size=8,
        device_kv_tokens=96,
        host_kv_tokens=0,
    )
    engine = LLMEngine(args)
    engine.scheduler.new_token_ratio = 0.0  # admit optimistically so decode growth hits OOM
    tokens = run(engine, rate_tps=2.0)
    assert engine.scheduler.num_recomputes_total >= 1
    assert tokens == alone
