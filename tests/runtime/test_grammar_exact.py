"""The scheduler keeps its promise for structured outputs: a greedy json_schema stream with
penalties, asking for logprobs, that is paused mid-answer (offloaded and reloaded, or dropped
and recomputed) produces exactly the tokens, alternatives and logprobs (to float32 rounding) it
produces when never paused, because its grammar state and its penalties' counts live outside the
KV cache and a recompute advances neither again."""

from __future__ import annotations

import json

import pytest

from tests.runtime.test_preemption_exact import StepClock
from tests.runtime.test_preemption_exact_scores import same_scores
from tokenflow.core.request import SamplingParams, StructuredOutput
from tokenflow.engine.client import GenerationDelta
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
    max_tokens=40,
    temperature=0,
    presence_penalty=0.5,
    frequency_penalty=0.3,
    repetition_penalty=1.3,
    logprobs=3,
    prompt_logprobs=2,
    structured_output=StructuredOutput(json.dumps(SCHEMA)),
)


def _run(engine: LLMEngine, rate_tps: float | None) -> dict[str, tuple]:
    """Per request: (tokens, their logprobs, [the prompt's logprobs])."""
    clock = StepClock()
    engine.core.clock = clock
    seen: dict[str, tuple[list, list, list]] = {}
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"r{i}", engine.tokenizer.encode(prompt), PARAMS, rate_tps)
        seen[f"r{i}"] = ([], [], [])
    for _ in range(20_000):
        if not engine.has_work:
            break
        _, deltas = engine.step()
        clock.t += 0.05
        engine.scheduler.kv.check_integrity()
        record(seen, deltas)
    assert not engine.has_work
    return seen


def record(seen: dict[str, tuple[list, list, list]], deltas: list[GenerationDelta]) -> None:
    """Add each delta's tokens, their logprobs and its prompt's logprobs to its request's
    (tokens, logprobs, [prompt logprobs]) in `seen`; no delta may be an error."""
    for delta in deltas:
        assert delta.finish_reason != "error", delta.error
        tokens, logprobs, prompt = seen[delta.request_id]
        tokens.extend(delta.token_ids)
        logprobs.extend(delta.logprobs)
        if delta.prompt_logprobs is not None:
            prompt.append(delta.prompt_logprobs)


@pytest.fixture(scope="module")
def unpaused(tiny_model_dir) -> dict[str, tuple]:
    engine = LLMEngine(EngineArgs(model=tiny_model_dir, device="cpu", policy="fcfs"))
    seen = _run(engine, None)
    assert engine.scheduler.num_preemptions_total == 0
    for tokens, logprobs, _ in seen.values():  # constrained: each starts a JSON object
        assert engine.tokenizer.decode(tokens).startswith('{"name": "')
        assert len(logprobs) == len(tokens)
    return seen


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
    seen = _run(engine, rate_tps=2.0)
    assert engine.scheduler.num_loads_total >= 4, "streams must be reloaded mid-answer"
    assert same_scores(seen, unpaused)
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
    seen = _run(engine, rate_tps=2.0)
    assert engine.scheduler.num_recomputes_total >= 1, "streams must be recomputed mid-answer"
    assert same_scores(seen, unpaused)
