"""The openai SDK against the live server beyond the answers: the model routes, the fields
accepted as no-ops, the fields refused by name, and one kept-alive connection for many requests."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

from tests_clients.answers import CHAT_MESSAGE, COMPLETION_PROMPT, MAX_TOKENS, greedy_chat
from tests_clients.conftest import MAX_MODEL_LEN

MESSAGES = [{"role": "user", "content": CHAT_MESSAGE}]


def test_models_list_and_retrieve_show_the_served_model(
    client: openai.OpenAI, model_id: str
) -> None:
    assert [model.id for model in client.models.list()] == [model_id]
    card = client.models.retrieve(model_id)
    assert card.id == model_id and card.object == "model"
    assert card.model_extra is not None and card.model_extra["max_model_len"] == MAX_MODEL_LEN
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve(f"{model_id}-not-served")


@pytest.mark.parametrize(
    "fields",
    [
        {"user": "user-1"},
        {"metadata": {"purpose": "test"}},
        {"store": False},
        {"service_tier": "auto"},
        {"reasoning_effort": "low"},
        {"safety_identifier": "user-hash"},
        {"parallel_tool_calls": False},
    ],
    ids=lambda fields: next(iter(fields)),
)
def test_an_accepted_field_that_changes_no_token_leaves_the_answer_unchanged(
    client: openai.OpenAI, model_id: str, fields: dict
) -> None:
    answer = client.chat.completions.create(
        model=model_id, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0, **fields
    )
    assert answer.choices[0].message.content == greedy_chat(
        client, model_id, CHAT_MESSAGE, MAX_TOKENS
    )


@pytest.mark.parametrize(
    ("endpoint", "param", "fields"),
    [
        ("chat", "logit_bias", {"logit_bias": {"100": 5}}),
        ("completions", "logit_bias", {"logit_bias": {"100": 5}}),
        ("completions", "suffix", {"suffix": " and so on."}),
        ("completions", "best_of", {"best_of": 2}),
        ("chat", "allowed_token_ids", {"extra_body": {"allowed_token_ids": [100, 200]}}),
    ],
    ids=lambda value: value if isinstance(value, str) else None,
)
def test_unimplemented_field_that_changes_the_answer_is_a_400_naming_it(
    client: openai.OpenAI, model_id: str, endpoint: str, param: str, fields: dict
) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        if endpoint == "chat":
            client.chat.completions.create(model=model_id, messages=MESSAGES, **fields)
        else:
            client.completions.create(model=model_id, prompt=COMPLETION_PROMPT, **fields)
    assert refused.value.status_code == 400
    assert refused.value.param == param
    assert param in refused.value.message


def _local_port(response: httpx.Response) -> int:
    """The client-side port of the connection that carried `response`."""
    return response.extensions["network_stream"].get_extra_info("client_addr")[1]


def test_one_connection_serves_many_whole_answers(base_url: str, model_id: str) -> None:
    local_ports: list[int] = []
    http = httpx.Client(event_hooks={"response": [lambda r: local_ports.append(_local_port(r))]})
    with openai.OpenAI(base_url=base_url, api_key="none", max_retries=0, http_client=http) as sdk:
        for _ in range(2):
            sdk.chat.completions.create(
                model=model_id, messages=MESSAGES, max_tokens=4, temperature=0
            )
            sdk.completions.create(model=model_id, prompt=COMPLETION_PROMPT, max_tokens=4)
        sdk.models.list()
    assert len(local_ports) == 5
    assert len(set(local_ports)) == 1, f"connections not kept alive: {local_ports}"


def test_one_connection_serves_streams_and_whole_answers(base_url: str, model_id: str) -> None:
    # The async SDK reads a stream to its end after [DONE], so its connection can be reused
    # (the sync SDK closes it there, whatever the server: openai/_streaming.py).
    local_ports: list[int] = []

    async def record(response: httpx.Response) -> None:
        local_ports.append(_local_port(response))

    async def requests() -> None:
        http = httpx.AsyncClient(event_hooks={"response": [record]})
        async with openai.AsyncOpenAI(
            base_url=base_url, api_key="none", max_retries=0, http_client=http
        ) as sdk:
            for stream in (True, False, True):
                answer = await sdk.chat.completions.create(
                    model=model_id, messages=MESSAGES, max_tokens=4, temperature=0, stream=stream
                )
                if stream:
                    assert [chunk async for chunk in answer]
            await sdk.models.list()

    asyncio.run(requests())
    assert len(local_ports) == 4
    assert len(set(local_ports)) == 1, f"connections not kept alive: {local_ports}"


def test_a_prompt_cache_key_keeps_the_answer_and_reports_its_cached_tokens(
    client: openai.OpenAI, model_id: str
) -> None:
    """OpenAI's session hint (it decides how long the prefix cache keeps the session's blocks);
    a repeated prompt reports the full blocks it reused."""
    answers = [
        client.chat.completions.create(
            model=model_id,
            messages=MESSAGES,
            max_tokens=MAX_TOKENS,
            temperature=0,
            prompt_cache_key="conversation-1",
        )
        for _ in range(2)
    ]
    assert answers[0].choices[0].message.content == answers[1].choices[0].message.content
    details = answers[1].usage.prompt_tokens_details
    assert details is not None and details.cached_tokens and details.cached_tokens % 16 == 0
