"""The scheduler keeps its promise for structured outputs: a greedy json_schema stream that is
paused mid-answer (offloaded and reloaded, or dropped and recomputed) produces exactly the
tokens it produces when never paused, because its grammar state lives outside the KV cache and
a recompute does not advance it again."""

from __future__ import annotations

import json

import pytest

from tests.runtime.test_preemption_exact import StepClock
from tokenflow.core.request import SamplingParams, StructuredOutput
from tokenflow.engine.engine_args import EngineArgs
from tokenflow.engine.llm_engine import LLMEngine

PROMPTS = [f"Record {i}: the user's profile as JSON" for i in range(6)]
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "score": {"type": "number"},
    },
    "required": ["name", "tags", "score"],
}
PARAMS = SamplingParams(
    max_tokens=40, temperature=0, structured_output=StructuredOutput(json.dumps(SCHEMA))
)


def _run(engine: LLMEngine, rate_tps: float | None) -> dict[str, list[int]]:
    clock = StepClock()
    engine.core.clock = clock
    tokens: dict[str, list[int]] = {}
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"r{i}", engine.tokenizer.encode(prompt), PARAMS, rate_tps)
        tokens[f"r{i}"] = []
    for _ in range(20_000):
        if not engine.has_work:
            break
        _, deltas = engine.step()
        clock.t += 0.05
        engine.scheduler.kv.check_integrity()
        for delta in deltas:
            assert delta.finish_reason != "error", delta.error
            tokens[delta.request_id].extend(delta.token_ids)
    assert not engine.has_work
    return tokens


@pytest.fixture(scope="module")
def unpaused(tiny_model_dir) -> dict[str, list[int]]:
    engine = LLMEngine(EngineArgs(model=tiny_model_dir, device="cpu", policy="fcfs"))
    tokens = _run(engine, None)
    assert engine.scheduler.num_preemptions_total == 0
    for ids in tokens.values():  # constrained: every stream is the start of a JSON object
        assert engine.tokenizer.decode(ids).startswith('{"name": "')
    return tokens


def test_offloaded_and_reloaded_constrained_streams_are_exact(tiny_model_dir, unpaused):
    args = EngineArgs(
        model=tiny_model_dir,
        device="cpu",
        policy="tokenflow",
        block_size=8,
        device_kv_tokens=96,
        host_kv_tokens=4096,
    )
    engine = LLMEngine(args)
    tokens = _run(engine, rate_tps=2.0)
    assert engine.scheduler.num_loads_total >= 4, "streams must be reloaded mid-answer"
    assert tokens == unpaused
    assert engine.grammars.num_matchers <= len(PROMPTS)  # released with their requests


def test_recomputed_constrained_streams_are_exact(tiny_model_dir, unpaused):
    args = EngineArgs(
        model=tiny_model_dir,
        device="cpu",
        policy="fcfs",
        block_size=8,
        device_kv_tokens=96,
        host_kv_tokens=0,
    )
    engine = LLMEngine(args)
    engine.scheduler.new_token_ratio = 0.0  # admit optimistically so decode growth hits OOM
    tokens = _run(engine, rate_tps=2.0)
    assert engine.scheduler.num_recomputes_total >= 1, "streams must be recomputed mid-answer"
    assert tokens == unpaused
