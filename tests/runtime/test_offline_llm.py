"""The offline API on a tiny real-format model: prompts, sampling parameters, finish reasons."""

import pytest

from tokenflow import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(model=tiny_model_dir, device="cpu", policy="fcfs")


def test_generate_strings_and_token_ids(llm):
    ids = llm.tokenizer.encode("Hello there")
    outs = llm.generate(["Hello there", ids], SamplingParams(max_tokens=8, temperature=0))
    assert [o.finish_reason for o in outs] == ["length", "length"]
    assert outs[0].token_ids == outs[1].token_ids  # same prompt, greedy
    assert len(outs[0].token_ids) == 8
    assert outs[0].text == llm.tokenizer.decode(outs[0].token_ids)


def test_seeded_sampling_is_reproducible_and_seed_dependent(llm):
    p = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, seed=3)
    a = llm.generate("Tell me", p)[0].token_ids
    b = llm.generate("Tell me", p)[0].token_ids
    c = llm.generate("Tell me", SamplingParams(max_tokens=12, temperature=1.0, seed=4))[0]
    assert a == b and a != c.token_ids


def test_stop_string_cuts_the_text(llm):
    free = llm.generate("abc", SamplingParams(max_tokens=12, temperature=0))[0]
    assert len(free.text) > 3
    stop = free.text[2:4]
    cut = llm.generate("abc", SamplingParams(max_tokens=12, temperature=0, stop=[stop]))[0]
    assert cut.finish_reason == "stop"
    assert cut.text == free.text[: free.text.find(stop)]
    assert stop not in cut.text


def test_stop_token_ids_and_min_tokens(llm):
    free = llm.generate("xyz", SamplingParams(max_tokens=10, temperature=0))[0]
    target = free.token_ids[3]
    first = free.token_ids.index(target)
    out = llm.generate(
        "xyz", SamplingParams(max_tokens=10, temperature=0, stop_token_ids=[target])
    )[0]
    assert out.finish_reason == "stop" and out.token_ids == free.token_ids[: first + 1]


def test_prompt_over_the_context_length_is_a_clear_error(llm):
    too_long = [5] * 1024
    with pytest.raises(ValueError, match="context length"):
        llm.generate([too_long], SamplingParams(max_tokens=1))
    with pytest.raises(ValueError, match="exceed the context length"):
        llm.generate([[5] * 1000], SamplingParams(max_tokens=100))
