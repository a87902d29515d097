"""The prefix cache on the real engine (tiny model, float32 on the CPU): a prompt that begins as
an earlier one reuses its full blocks' KV, and its greedy tokens equal those with caching off,
whatever the block boundaries and the prefill chunking; the reused count is reported."""

from __future__ import annotations

from dataclasses import replace

import pytest

from tokenflow.core.policies import make_policy
from tokenflow.core.request import SamplingParams
from tokenflow.engine.engine_args import EngineArgs
from tokenflow.engine.llm_engine import LLMEngine

SYSTEM = "You are a careful assistant who answers in short sentences. " * 6
PARAMS = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


def run_in_turn(engine: LLMEngine, prompts: list[list[int]]) -> list[tuple[list[int], int]]:
    """Each prompt alone after the previous one finished: (its tokens, its cached count)."""
    results = []
    for index, prompt in enumerate(prompts):
        engine.add_request(f"r{index}", prompt, PARAMS)
        tokens, cached = [], 0
        while engine.has_work:
            for delta in engine.step()[1]:
                tokens.extend(delta.token_ids)
                cached = max(cached, delta.num_cached_tokens)
            engine.scheduler.kv.check_integrity()
        results.append((tokens, cached))
    return results


def engine_of(model_dir: str, caching: bool, max_prefill_tokens: int = 4096) -> LLMEngine:
    args = EngineArgs(
        model=model_dir,
        device="cpu",
        dtype="float32",
        policy="fcfs",
        enable_prefix_caching=caching,
        max_prefill_tokens=max_prefill_tokens,
    )
    return LLMEngine(args)


@pytest.fixture(scope="module")
def prompts(tiny_model_dir) -> list[list[int]]:
    tokenizer = engine_of(tiny_model_dir, caching=False).tokenizer
    system = tokenizer.encode(SYSTEM)
    # Turns that share the system prompt, then a conversation's history: the cut points fall
    # inside blocks and on their edges.
    return [
        system + tokenizer.encode(" What is a cat?"),
        system + tokenizer.encode(" What is a dog? Answer briefly."),
        system + tokenizer.encode(" What is a cat?") + tokenizer.encode(" A pet. And a dog?"),
        system[:48],  # exactly three blocks: the last one must be computed, not reused
    ]


@pytest.mark.parametrize("max_prefill_tokens", [4096, 24])
def test_greedy_tokens_are_the_same_with_caching_on_and_off(
    tiny_model_dir, prompts, max_prefill_tokens
):
    off = run_in_turn(engine_of(tiny_model_dir, False, max_prefill_tokens), prompts)
    on = run_in_turn(engine_of(tiny_model_dir, True, max_prefill_tokens), prompts)
    assert [tokens for tokens, _ in on] == [tokens for tokens, _ in off]
    block = 16
    shared = (len(prompts[0]) - 1) // block * block  # whole blocks of the first prompt
    assert on[0][1] == 0  # nothing cached yet
    assert on[1][1] > 0 and on[1][1] % block == 0  # the system prompt's full blocks
    assert on[2][1] >= shared  # the first turn's whole history
    assert on[3][1] == 32  # 48 tokens: two blocks reused, the third computed
    assert all(cached == 0 for _, cached in off)


def flush_device_cache(engine: LLMEngine) -> None:
    """Other work takes every free device block for a moment: the device's cached blocks are
    reused, their host copies stay."""
    kv = engine.scheduler.kv
    assert kv.allocate("other", kv.num_free_device_blocks * kv.block_size)
    kv.drop("other")
    assert kv.num_cached_device_blocks == 0


@pytest.mark.parametrize("link_bytes_per_s", [1e12, 1.0], ids=["reloaded", "recomputed"])
def test_a_host_tier_hit_gives_the_same_tokens_reloaded_or_recomputed(
    tiny_model_dir, prompts, link_bytes_per_s, monkeypatch
):
    """A finished stream's written-through blocks stay in the host tier; a later prompt on them
    loads them when the link is faster than computing them, else computes them.  (Computing is
    priced at 1 ms a token here, not by the measured steps, so the choice is the link's.)"""
    engine = engine_of(tiny_model_dir, True)
    engine.scheduler.config = replace(engine.scheduler.config, link_bytes_per_s=link_bytes_per_s)
    engine.scheduler.policy = make_policy("tokenflow", engine.scheduler.config)  # writes through
    monkeypatch.setattr(type(engine.scheduler.estimator), "prefill_time_s", lambda _, n: n / 1e3)
    [(first, _)] = run_in_turn(engine, prompts[:1])
    assert engine.scheduler.kv.num_cached_host_blocks > 0
    flush_device_cache(engine)
    [(again, cached)] = run_in_turn(engine, prompts[:1])
    host_hits = engine.scheduler.num_prefix_host_hit_tokens
    assert again == first
    if link_bytes_per_s > 1.0:
        assert cached == host_hits > 0 and engine.scheduler.num_loads_total == 1
    else:
        assert cached == host_hits == 0
