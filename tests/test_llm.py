"""The offline API (`tokenflow.LLM`) on a tiny real-format model: vLLM's output shape, chat
through the model's template, sampling parameters, finish reasons, the executor by name and
the deprecated top-level readings."""

from __future__ import annotations

import pytest

from tokenflow import LLM, CompletionOutput, RequestOutput, SamplingParams

GREEDY = SamplingParams(max_tokens=8, temperature=0)
CHAT = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Name a colour."},
]
OTHER_CHAT = [{"role": "user", "content": "Count to three."}]


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(model=tiny_model_dir, device="cpu", policy="fcfs")


def test_one_request_output_per_prompt_in_vllms_shape(llm):
    ids = llm.tokenizer.encode("Hello there")
    outs = llm.generate(["Hello there", ids, "Bye"], GREEDY)
    assert [type(o) for o in outs] == [RequestOutput] * 3
    assert len({o.request_id for o in outs}) == 3
    assert [o.prompt for o in outs] == ["Hello there", None, "Bye"]
    assert outs[0].prompt_token_ids == ids == outs[1].prompt_token_ids
    assert outs[2].prompt_token_ids == llm.tokenizer.encode("Bye")
    for out in outs:
        assert out.finished and out.prompt_logprobs is None
        [choice] = out.outputs
        assert isinstance(choice, CompletionOutput) and choice.index == 0
        assert choice.finish_reason == "length" and choice.finished()
        assert len(choice.token_ids) == 8 and all(isinstance(t, int) for t in choice.token_ids)
        assert choice.text == llm.tokenizer.decode(choice.token_ids)
        assert choice.cumulative_logprob is None and choice.logprobs is None
    assert outs[0].outputs[0].token_ids == outs[1].outputs[0].token_ids  # same prompt, greedy


def test_logprobs_in_vllms_shape(llm):
    params = SamplingParams(max_tokens=4, temperature=0, logprobs=2, prompt_logprobs=1)
    [out] = llm.generate("Hello there", params)
    choice = out.outputs[0]
    assert choice.logprobs is not None and len(choice.logprobs) == 4
    chosen = []
    for token_id, position in zip(choice.token_ids, choice.logprobs, strict=True):
        first_id, first = next(iter(position.items()))
        assert first_id == token_id and first.rank == 1  # greedy: the most likely
        assert first.decoded_token == llm.tokenizer.decode([token_id])
        assert len(position) == 2  # the chosen token is one of the two alternatives
        assert sorted(p.rank for p in position.values()) == [1, 2]
        chosen.append(first.logprob)
    assert choice.cumulative_logprob == pytest.approx(sum(chosen))
    assert out.prompt_logprobs is not None
    assert len(out.prompt_logprobs) == len(out.prompt_token_ids)
    assert out.prompt_logprobs[0] is None  # the first prompt token has none
    assert out.prompt_token_ids[1] in out.prompt_logprobs[1]


def test_chat_on_one_conversation_is_generate_on_its_template(llm):
    [out] = llm.chat(CHAT, GREEDY)
    assert out.prompt == llm.tokenizer.render_chat(CHAT)
    assert out.prompt.endswith("assistant\n")  # the turn opener (SmolLM2's template)
    assert out.prompt_token_ids == llm.tokenizer.apply_chat_template(CHAT)
    [plain] = llm.generate([out.prompt_token_ids], GREEDY)
    assert out.outputs[0].token_ids == plain.outputs[0].token_ids
    assert out.outputs[0].text == plain.outputs[0].text


def test_chat_on_a_list_of_conversations(llm):
    outs = llm.chat([CHAT, OTHER_CHAT], GREEDY)
    assert len(outs) == 2
    for conversation, out in zip([CHAT, OTHER_CHAT], outs, strict=True):
        assert out.prompt_token_ids == llm.tokenizer.apply_chat_template(conversation)
        [alone] = llm.chat(conversation, GREEDY)
        assert out.outputs[0].token_ids == alone.outputs[0].token_ids
    assert outs[0].prompt_token_ids != outs[1].prompt_token_ids


def test_chat_template_options(llm):
    [closed] = llm.chat(CHAT, GREEDY, add_generation_prompt=False)
    assert closed.prompt == llm.tokenizer.render_chat(CHAT, add_generation_prompt=False)
    assert not closed.prompt.endswith("assistant\n")
    partial = [*CHAT, {"role": "assistant", "content": "Blu"}]
    [continued] = llm.chat(
        partial, GREEDY, add_generation_prompt=False, continue_final_message=True
    )
    assert continued.prompt.endswith("Blu")
    with pytest.raises(ValueError, match="continue_final_message"):
        llm.chat(partial, GREEDY, continue_final_message=True)


@pytest.mark.parametrize("name", ["text", "token_ids", "finish_reason"])
def test_top_level_readings_warn_and_still_work(llm, name):
    [out] = llm.generate("Hello", GREEDY)
    with pytest.warns(DeprecationWarning, match=rf"\.outputs\[0\]\.{name}"):
        value = getattr(out, name)
    assert value == getattr(out.outputs[0], name)


def test_an_unknown_executor_is_a_clear_error(tiny_model_dir):
    with pytest.raises(ValueError, match="executor must be one of .*'vllm'"):
        LLM(model=tiny_model_dir, device="cpu", executor="vllm")


def test_seeded_sampling_is_reproducible_and_seed_dependent(llm):
    p = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, seed=3)
    a = llm.generate("Tell me", p)[0].outputs[0].token_ids
    b = llm.generate("Tell me", p)[0].outputs[0].token_ids
    c = llm.generate("Tell me", SamplingParams(max_tokens=12, temperature=1.0, seed=4))[0]
    assert a == b and a != c.outputs[0].token_ids


def test_sampling_params_per_prompt(llm):
    short, long = SamplingParams(max_tokens=2), SamplingParams(max_tokens=5)
    outs = llm.generate(["a", "b"], [short, long])
    assert [len(o.outputs[0].token_ids) for o in outs] == [2, 5]
    with pytest.raises(ValueError, match="2 prompts but 1 sampling params"):
        llm.generate(["a", "b"], [short])


def test_stop_string_cuts_the_text(llm):
    free = llm.generate("abc", SamplingParams(max_tokens=12, temperature=0))[0].outputs[0]
    assert len(free.text) > 3
    stop = free.text[2:4]
    params = SamplingParams(max_tokens=12, temperature=0, stop=[stop])
    cut = llm.generate("abc", params)[0].outputs[0]
    assert cut.finish_reason == "stop"
    assert cut.text == free.text[: free.text.find(stop)]
    assert stop not in cut.text


def test_stop_token_ids_and_min_tokens(llm):
    free = llm.generate("xyz", SamplingParams(max_tokens=10, temperature=0))[0].outputs[0]
    target = free.token_ids[3]
    first = free.token_ids.index(target)
    params = SamplingParams(max_tokens=10, temperature=0, stop_token_ids=[target])
    out = llm.generate("xyz", params)[0].outputs[0]
    assert out.finish_reason == "stop" and out.token_ids == free.token_ids[: first + 1]


def test_prompt_over_the_context_length_is_a_clear_error(llm):
    too_long = [5] * 1024
    with pytest.raises(ValueError, match="context length"):
        llm.generate([too_long], SamplingParams(max_tokens=1))
    with pytest.raises(ValueError, match="exceed the context length"):
        llm.generate([[5] * 1000], SamplingParams(max_tokens=100))


def test_a_refused_prompt_refuses_its_whole_batch(llm):
    with pytest.raises(ValueError, match="context length"):
        llm.generate(["fits", [5] * 1024], GREEDY)
    assert not llm.engine.has_work  # the prompt queued before it was taken back
    [out] = llm.generate("fits", GREEDY)
    assert out.outputs[0].finish_reason == "length"
