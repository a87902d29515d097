"""The openai SDK's completions against the live server: every prompt shape, echo with the legacy
logprobs (lm-eval's loglikelihood request), and the penalties."""

from __future__ import annotations

import collections

import httpx
import openai
import pytest
from openai.types import Completion

from tests_clients.answers import COMPLETION_PROMPT, MAX_TOKENS, greedy_completion

PROMPTS = [COMPLETION_PROMPT, "Once upon a time", "def fibonacci(n):"]
REPETITIVE_PROMPT = "one two one two one two one two"


def _token_ids(server_url: str, text: str) -> list[int]:
    """The prompt's token ids, from the server's /tokenize."""
    answer = httpx.post(
        f"{server_url}/tokenize", json={"prompt": text, "add_special_tokens": False}
    )
    answer.raise_for_status()
    return answer.json()["tokens"]


def _texts(answer: Completion, num_choices: int) -> list[str]:
    assert [choice.index for choice in answer.choices] == list(range(num_choices))
    return [choice.text for choice in answer.choices]


def test_completion_of_a_string_streamed_and_not_agree(
    client: openai.OpenAI, model_id: str
) -> None:
    answer = client.completions.create(
        model=model_id,
        prompt=COMPLETION_PROMPT,
        max_tokens=MAX_TOKENS,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert answer.usage.completion_tokens == MAX_TOKENS
    assert answer.choices[0].finish_reason == "length"
    stream = client.completions.create(
        model=model_id,
        prompt=COMPLETION_PROMPT,
        max_tokens=MAX_TOKENS,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    assert "".join(chunk.choices[0].text for chunk in chunks) == answer.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_completion_logprobs_streamed_and_not_agree(client: openai.OpenAI, model_id: str) -> None:
    fields = {"prompt": COMPLETION_PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0}
    answer = client.completions.create(model=model_id, logprobs=2, **fields)
    whole = answer.choices[0].logprobs
    assert whole is not None and "".join(whole.tokens) == answer.choices[0].text
    assert len(whole.tokens) == answer.usage.completion_tokens
    offsets = [len("".join(whole.tokens[:i])) for i in range(len(whole.tokens))]
    assert whole.text_offset == offsets
    streamed = {"tokens": [], "token_logprobs": [], "text_offset": [], "top_logprobs": []}
    for chunk in client.completions.create(model=model_id, logprobs=2, stream=True, **fields):
        for name, values in streamed.items():
            values.extend(getattr(chunk.choices[0].logprobs, name))
    assert streamed["tokens"] == whole.tokens and streamed["text_offset"] == whole.text_offset
    assert [list(top) for top in streamed["top_logprobs"]] == [
        list(top) for top in whole.top_logprobs
    ]
    # float32 rounding differs between batch shapes
    assert streamed["token_logprobs"] == pytest.approx(whole.token_logprobs, rel=1e-3, abs=1e-3)


def test_streamed_completion_n2_names_its_choice_and_counts_usage_once_per_prompt(
    client: openai.OpenAI, model_id: str, server
) -> None:
    fields = {"prompt": COMPLETION_PROMPT, "max_tokens": MAX_TOKENS, "temperature": 1.0}
    extra = {"ignore_eos": True}
    answer = client.completions.create(model=model_id, n=2, seed=5, extra_body=extra, **fields)
    texts: dict[int, str] = collections.defaultdict(str)
    chunks = list(
        client.completions.create(
            model=model_id,
            n=2,
            seed=5,
            stream=True,
            stream_options={"include_usage": True},
            extra_body=extra,
            **fields,
        )
    )
    for chunk in chunks:
        for choice in chunk.choices:
            assert choice.index in (0, 1), chunk  # AttributeError when a chunk lacks it
            texts[choice.index] += choice.text
    assert texts == {choice.index: choice.text for choice in answer.choices}
    assert chunks[-1].usage == answer.usage
    assert answer.usage.completion_tokens == 2 * MAX_TOKENS
    assert answer.usage.prompt_tokens == len(_token_ids(server.url, COMPLETION_PROMPT))


def test_completion_of_a_list_of_strings_answers_each_in_order(
    client: openai.OpenAI, model_id: str
) -> None:
    alone = [greedy_completion(client, model_id, prompt, MAX_TOKENS) for prompt in PROMPTS]
    together = client.completions.create(
        model=model_id, prompt=PROMPTS, max_tokens=MAX_TOKENS, temperature=0
    )
    assert _texts(together, len(PROMPTS)) == alone


def test_completion_of_token_ids_answers_as_its_text(
    client: openai.OpenAI, model_id: str, server
) -> None:
    ids = _token_ids(server.url, COMPLETION_PROMPT)
    assert greedy_completion(client, model_id, ids, MAX_TOKENS) == greedy_completion(
        client, model_id, COMPLETION_PROMPT, MAX_TOKENS
    )


def test_completion_of_token_id_lists_answers_each_in_order(
    client: openai.OpenAI, model_id: str, server
) -> None:
    alone = [greedy_completion(client, model_id, prompt, MAX_TOKENS) for prompt in PROMPTS]
    ids = [_token_ids(server.url, prompt) for prompt in PROMPTS]
    together = client.completions.create(
        model=model_id, prompt=ids, max_tokens=MAX_TOKENS, temperature=0
    )
    assert _texts(together, len(PROMPTS)) == alone


def test_echo_with_max_tokens_0_scores_the_prompt_alone(
    client: openai.OpenAI, model_id: str, server
) -> None:
    num_alternatives = 2
    answer = client.completions.create(
        model=model_id, prompt=COMPLETION_PROMPT, max_tokens=0, echo=True, logprobs=num_alternatives
    )
    choice = answer.choices[0]
    assert choice.text == COMPLETION_PROMPT
    assert answer.usage.completion_tokens == 0
    logprobs = choice.logprobs
    assert logprobs is not None
    num_prompt = len(_token_ids(server.url, COMPLETION_PROMPT))
    assert answer.usage.prompt_tokens == num_prompt == len(logprobs.tokens)
    assert "".join(logprobs.tokens) == COMPLETION_PROMPT
    assert logprobs.text_offset == sorted(logprobs.text_offset) and logprobs.text_offset[0] == 0
    # The first token has nothing before it: no logprob, no alternatives.
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    for token, logprob, alternatives in zip(
        logprobs.tokens[1:], logprobs.token_logprobs[1:], logprobs.top_logprobs[1:], strict=True
    ):
        assert logprob is not None and logprob <= 0.0
        # The most likely alternatives, and the prompt's own token beside them.
        assert alternatives is not None and alternatives[token] == logprob
        assert num_alternatives <= len(alternatives) <= num_alternatives + 1
        assert max(alternatives.values()) >= logprob


def test_echo_with_output_starts_with_the_prompt(client: openai.OpenAI, model_id: str) -> None:
    answer = client.completions.create(
        model=model_id,
        prompt=COMPLETION_PROMPT,
        max_tokens=MAX_TOKENS,
        temperature=0,
        echo=True,
        logprobs=1,
    )
    output = greedy_completion(client, model_id, COMPLETION_PROMPT, MAX_TOKENS)
    assert answer.choices[0].text == COMPLETION_PROMPT + output
    num_tokens = answer.usage.prompt_tokens + answer.usage.completion_tokens
    assert len(answer.choices[0].logprobs.tokens) == num_tokens


def _most_repeated(client: openai.OpenAI, model_id: str, fields: dict, extra: dict) -> int:
    """How often the greedy output's most frequent token occurs in it."""
    answer = client.completions.create(
        model=model_id,
        prompt=REPETITIVE_PROMPT,
        max_tokens=16,
        temperature=0,
        logprobs=0,
        extra_body={"ignore_eos": True, **extra},
        **fields,
    )
    tokens = answer.choices[0].logprobs.tokens
    return collections.Counter(tokens).most_common(1)[0][1]


@pytest.mark.parametrize(
    ("fields", "extra"),
    [
        ({"presence_penalty": 2.0}, {}),
        ({"frequency_penalty": 2.0}, {}),
        ({}, {"repetition_penalty": 2.0}),
    ],
    ids=["presence_penalty", "frequency_penalty", "repetition_penalty"],
)
def test_penalty_makes_greedy_output_repeat_less(
    client: openai.OpenAI, model_id: str, fields: dict, extra: dict
) -> None:
    unpenalized = _most_repeated(client, model_id, {}, {})
    assert unpenalized > 2, "the baseline must repeat itself for a penalty to show"
    assert _most_repeated(client, model_id, fields, extra) < unpenalized
