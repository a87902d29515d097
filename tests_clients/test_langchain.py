"""langchain-openai against the live server: `ChatOpenAI` invoked and streamed, and the
completions LLM `OpenAI`, which sends its prompts as a list; each answers as the openai SDK
does for the same greedy request."""

from __future__ import annotations

import openai
import pytest

from tests_clients.answers import (
    CHAT_MESSAGE,
    COMPLETION_PROMPT,
    MAX_TOKENS,
    greedy_chat,
    greedy_completion,
)

langchain_openai = pytest.importorskip("langchain_openai", reason="the `clients` extra")


def _chat_model(base_url: str, model_id: str) -> langchain_openai.ChatOpenAI:
    return langchain_openai.ChatOpenAI(
        base_url=base_url,
        api_key="none",
        model=model_id,
        max_tokens=MAX_TOKENS,
        temperature=0,
        max_retries=0,
        stream_usage=True,
    )


def _completion_model(base_url: str, model_id: str) -> langchain_openai.OpenAI:
    return langchain_openai.OpenAI(
        base_url=base_url,
        api_key="none",
        model=model_id,
        max_tokens=MAX_TOKENS,
        temperature=0,
        max_retries=0,
    )


def test_chat_openai_invoke_answers_as_the_sdk(
    base_url: str, model_id: str, client: openai.OpenAI
) -> None:
    message = _chat_model(base_url, model_id).invoke(CHAT_MESSAGE)
    assert message.content == greedy_chat(client, model_id, CHAT_MESSAGE, MAX_TOKENS)
    assert message.response_metadata["finish_reason"] in ("stop", "length")
    assert message.usage_metadata is not None
    assert 0 < message.usage_metadata["output_tokens"] <= MAX_TOKENS


def test_chat_openai_stream_joins_to_the_sdk_answer(
    base_url: str, model_id: str, client: openai.OpenAI
) -> None:
    chunks = list(_chat_model(base_url, model_id).stream(CHAT_MESSAGE))
    assert "".join(chunk.content for chunk in chunks) == greedy_chat(
        client, model_id, CHAT_MESSAGE, MAX_TOKENS
    )
    usage = [chunk.usage_metadata for chunk in chunks if chunk.usage_metadata]
    assert len(usage) == 1 and 0 < usage[0]["output_tokens"] <= MAX_TOKENS


def test_completions_llm_answers_each_prompt_of_its_list_in_order(
    base_url: str, model_id: str, client: openai.OpenAI
) -> None:
    prompts = [COMPLETION_PROMPT, "Once upon a time"]
    llm = _completion_model(base_url, model_id)
    alone = [greedy_completion(client, model_id, prompt, MAX_TOKENS) for prompt in prompts]
    assert llm.invoke(prompts[0]) == alone[0]
    result = llm.generate(prompts)  # one request, `prompt` a list of both
    assert [generations[0].text for generations in result.generations] == alone
    assert "".join(llm.stream(prompts[1])) == alone[1]
