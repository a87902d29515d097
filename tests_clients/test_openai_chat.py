"""The openai SDK's chat completions against the live server: streamed and not, `n`, logprobs,
penalties and vLLM's sampling extras, each parsed with the SDK's own types."""

from __future__ import annotations

import collections

import openai
import pytest
from openai.types.chat import ChatCompletion, ChatCompletionChunk, ChatCompletionTokenLogprob

from tests_clients.answers import CHAT_MESSAGE, MAX_TOKENS, greedy_chat

MESSAGES = [{"role": "user", "content": CHAT_MESSAGE}]
TOP_LOGPROBS = 3


def _stream(client: openai.OpenAI, model_id: str, **fields) -> list[ChatCompletionChunk]:
    return list(
        client.chat.completions.create(model=model_id, messages=MESSAGES, stream=True, **fields)
    )


def test_streamed_chat_joins_to_the_answer_not_streamed(
    client: openai.OpenAI, model_id: str
) -> None:
    answer = client.chat.completions.create(
        model=model_id, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0
    )
    assert isinstance(answer, ChatCompletion) and answer.choices[0].message.role == "assistant"
    chunks = _stream(
        client,
        model_id,
        max_tokens=MAX_TOKENS,
        temperature=0,
        stream_options={"include_usage": True},
    )
    with_choices = [chunk for chunk in chunks if chunk.choices]
    assert with_choices[0].choices[0].delta.role == "assistant"
    text = "".join(chunk.choices[0].delta.content or "" for chunk in with_choices)
    assert text == answer.choices[0].message.content
    finish_reasons = [
        c.choices[0].finish_reason for c in with_choices if c.choices[0].finish_reason
    ]
    assert finish_reasons == [answer.choices[0].finish_reason]
    assert chunks[-1].usage == answer.usage  # the usage chunk comes last


def test_chat_n2_choice_j_draws_from_seed_plus_j(client: openai.OpenAI, model_id: str) -> None:
    fields = {"max_tokens": MAX_TOKENS, "temperature": 1.0}
    both = client.chat.completions.create(model=model_id, messages=MESSAGES, n=2, seed=7, **fields)
    assert [choice.index for choice in both.choices] == [0, 1]
    for index, seed in enumerate((7, 8)):
        alone = client.chat.completions.create(
            model=model_id, messages=MESSAGES, seed=seed, **fields
        )
        assert both.choices[index].message.content == alone.choices[0].message.content


def test_streamed_chat_n2_names_its_choice_on_every_chunk(
    client: openai.OpenAI, model_id: str
) -> None:
    fields = {"max_tokens": MAX_TOKENS, "temperature": 1.0, "seed": 3}
    answer = client.chat.completions.create(model=model_id, messages=MESSAGES, n=2, **fields)
    texts: dict[int, str] = collections.defaultdict(str)
    finish_reasons: dict[int, list[str]] = collections.defaultdict(list)
    for chunk in _stream(client, model_id, n=2, **fields):
        for choice in chunk.choices:
            assert choice.index in (0, 1), chunk  # AttributeError when a chunk lacks it
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason is not None:
                finish_reasons[choice.index].append(choice.finish_reason)
    assert texts == {c.index: c.message.content for c in answer.choices}
    assert finish_reasons == {c.index: [c.finish_reason] for c in answer.choices}


def _check_greedy_logprobs(entries: list[ChatCompletionTokenLogprob], content: str) -> None:
    """Greedy entries: each token is its own top alternative, TOP_LOGPROBS of them in order,
    and the tokens' bytes are the answer's text."""
    assert entries
    for entry in entries:
        alternatives = entry.top_logprobs
        assert len(alternatives) == TOP_LOGPROBS
        assert [a.logprob for a in alternatives] == sorted(
            (a.logprob for a in alternatives), reverse=True
        )
        assert (entry.token, entry.logprob) == (alternatives[0].token, alternatives[0].logprob)
        assert entry.logprob <= 0.0
    assert b"".join(bytes(entry.bytes or ()) for entry in entries).decode() == content


def test_chat_logprobs_streamed_and_not_agree(client: openai.OpenAI, model_id: str) -> None:
    fields = {"max_tokens": MAX_TOKENS, "temperature": 0, "logprobs": True}
    answer = client.chat.completions.create(
        model=model_id, messages=MESSAGES, top_logprobs=TOP_LOGPROBS, **fields
    )
    choice = answer.choices[0]
    assert choice.logprobs is not None and choice.logprobs.content is not None
    _check_greedy_logprobs(choice.logprobs.content, choice.message.content or "")
    assert len(choice.logprobs.content) == answer.usage.completion_tokens

    streamed: list[ChatCompletionTokenLogprob] = []
    for chunk in _stream(client, model_id, top_logprobs=TOP_LOGPROBS, **fields):
        for streamed_choice in chunk.choices:
            if streamed_choice.logprobs is not None:
                streamed.extend(streamed_choice.logprobs.content or ())
    _check_same_logprobs(streamed, choice.logprobs.content)


def _check_same_logprobs(
    got: list[ChatCompletionTokenLogprob], expected: list[ChatCompletionTokenLogprob]
) -> None:
    """The same tokens and alternatives; the same logprobs up to float32 rounding, which
    differs between batch shapes (a token's logprob is rarely under -1e-3 apart from another's)."""

    def tokens(entries: list[ChatCompletionTokenLogprob]) -> list[tuple]:
        return [(e.token, e.bytes, [a.token for a in e.top_logprobs]) for e in entries]

    def logprobs(entries: list[ChatCompletionTokenLogprob]) -> list[float]:
        return [v for e in entries for v in (e.logprob, *(a.logprob for a in e.top_logprobs))]

    assert tokens(got) == tokens(expected)
    assert logprobs(got) == pytest.approx(logprobs(expected), rel=1e-3, abs=1e-3)


def test_chat_min_tokens_holds_back_the_end_of_an_answer(
    client: openai.OpenAI, model_id: str
) -> None:
    room = 64
    short = client.chat.completions.create(
        model=model_id, messages=MESSAGES, max_tokens=room, temperature=0
    )
    assert short.choices[0].finish_reason == "stop", "the baseline must end before max_tokens"
    at_least = short.usage.completion_tokens + 4
    longer = client.chat.completions.create(
        model=model_id,
        messages=MESSAGES,
        max_tokens=room,
        temperature=0,
        extra_body={"min_tokens": at_least},
    )
    assert longer.usage.completion_tokens >= at_least


@pytest.mark.parametrize("extra", [{"top_k": 1}, {"min_p": 1.0}], ids=["top_k=1", "min_p=1"])
def test_chat_sampling_that_keeps_one_token_is_greedy(
    client: openai.OpenAI, model_id: str, extra: dict
) -> None:
    greedy = greedy_chat(client, model_id, CHAT_MESSAGE, MAX_TOKENS)
    sampled = client.chat.completions.create(
        model=model_id,
        messages=MESSAGES,
        max_tokens=MAX_TOKENS,
        temperature=1.0,
        seed=11,
        extra_body=extra,
    )
    assert sampled.choices[0].message.content == greedy
