"""The llama.cpp executor runs the core's plans to the letter: its greedy tokens follow
llama.cpp's own for each prompt alone (up to llama.cpp's batch-dependent rounding, see
conftest.NEAR_TIE) batched, chunked, after a save and restore, and after a recompute."""

from __future__ import annotations

import pytest

from tests.model.helpers import GREEDY_NO_EOS, chunk, greedy_generate, plan
from tests_llamacpp.conftest import agrees_but_at_a_near_tie, make_executor
from tokenflow.core.request import SamplingParams

TEXTS = [
    "The capital of France is Paris. The capital of Germany is",
    "Write a short poem about the sea:",
    "def fibonacci(n):",
]


@pytest.fixture(scope="module")
def executor(gguf):
    executor = make_executor(gguf)
    yield executor
    executor.close()


@pytest.fixture(scope="module")
def prompts(gguf):
    return [gguf.tokenizer.encode(text) for text in TEXTS]


def test_batched_greedy_equals_each_prompt_alone(executor, prompts, oracle):
    outputs = greedy_generate(executor, prompts, [[]] * len(prompts), num_new=16)
    for prompt, output in zip(prompts, outputs, strict=True):
        assert agrees_but_at_a_near_tie(output, *oracle.with_margins(prompt, 16))
    executor.execute(plan([], released=[f"r{i}" for i in range(len(prompts))]))


def test_prefill_in_chunks_equals_whole(executor, prompts, oracle):
    outputs = greedy_generate(executor, prompts, [[]] * len(prompts), 12, prefill_chunk=5)
    for prompt, output in zip(prompts, outputs, strict=True):
        assert agrees_but_at_a_near_tie(output, *oracle.with_margins(prompt, 12))
    executor.execute(plan([], released=[f"r{i}" for i in range(len(prompts))]))


def _continue(executor, request_id, tokens, start, num_out, num_new):
    """Greedy tokens of one request from a chunk of `tokens` at `start`."""
    out = []
    for _ in range(num_new):
        step = chunk(request_id, tokens, start, [], num_out, params=GREEDY_NO_EOS)
        [sampled] = executor.execute(plan([step])).sampled
        out.append(sampled.token_id)
        start, tokens, num_out = start + len(tokens), [sampled.token_id], num_out + 1
    return out


def test_a_full_pool_saves_the_idle_sequence_and_restores_it(gguf, prompts, oracle):
    executor = make_executor(gguf, num_ctx_tokens=256, num_seqs=4)
    a, b = prompts[0], (prompts[1] * 40)[:240]  # b alone needs almost all of the pool
    first = _continue(executor, "a", a, 0, 0, 6)
    _continue(executor, "b", b, 0, 0, 2)
    assert executor.num_saves >= 1  # "a" went to host memory to make room for "b"
    executor.execute(plan([], released=["b"]))
    known = a + first[:-1]  # KV computed so far; the last sampled token is fed next
    rest = _continue(executor, "a", [first[-1]], len(known), 6, 6)
    assert executor.num_restores == 1
    assert agrees_but_at_a_near_tie(first + rest, *oracle.with_margins(a, 12))
    executor.close()


def test_a_chunk_that_starts_earlier_recomputes_from_there(executor, prompts, oracle):
    prompt = prompts[2]
    first = _continue(executor, "c", prompt, 0, 0, 5)
    # Resume by recompute: the core replays the prompt's tail and the tokens so far.
    replay = (prompt + first)[4:]
    rest = _continue(executor, "c", replay, 4, 5, 5)
    assert agrees_but_at_a_near_tie(first + rest, *oracle.with_margins(prompt, 10))
    executor.execute(plan([], released=["c"]))


def test_a_resume_past_what_was_computed_is_refused(executor):
    with pytest.raises(RuntimeError, match="never computed"):
        executor.execute(plan([chunk("ghost", [5], 10, [], 3)]))
    with pytest.raises(ValueError, match="two chunks"):
        executor.execute(plan([chunk("x", [1, 2], 0, []), chunk("x", [3], 2, [])]))


def test_one_failing_row_fails_alone(executor, prompts, oracle, monkeypatch):
    sample = executor.sampler.sample

    def fails_for_bad(logits, rows):
        if any(row.request_id == "bad" for row in rows):
            raise RuntimeError("boom")
        return sample(logits, rows)

    monkeypatch.setattr(executor.sampler, "sample", fails_for_bad)
    good = chunk("good", prompts[0], 0, [], params=GREEDY_NO_EOS)
    bad = chunk("bad", prompts[1], 0, [], params=SamplingParams(max_tokens=4))
    result = executor.execute(plan([good, bad]))
    assert [s.request_id for s in result.sampled] == ["good", "bad"]
    assert result.sampled[0].token_id == oracle(prompts[0], 1)[0]
    assert set(result.failed_rows) == {"bad"} and "boom" in result.failed_rows["bad"]
    executor.execute(plan([], released=["good", "bad"]))
