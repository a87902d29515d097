"""Structured outputs and tool calls on the live server with the embedded SmolLM2, through the
clients users bring: the `openai` SDK (`chat.completions.parse`, json_object, json_schema on
completions, forced tool calls whole and streamed, the 400 for tool_choice "auto" without a
parser) and langchain-openai's `with_structured_output` in both of its modes."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from pydantic import BaseModel, Field

from tokenflow.eval.local_server import RunningServer


class Person(BaseModel):
    name: str = Field(max_length=16)
    age: int = Field(ge=0, le=120)


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 16},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "maxLength": 8}},
            "required": ["zone"],
        },
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris? Use the tool."}]
GREEDY = {"temperature": 0, "max_tokens": 64}


@pytest.fixture(scope="module")
def url(server: RunningServer) -> str:
    """The live server's root URL (conftest.py)."""
    return server.url


def test_chat_completions_parse_returns_the_pydantic_model(client, model_id):
    completion = client.chat.completions.parse(
        model=model_id,
        messages=[{"role": "user", "content": "Invent a person: a name and an age."}],
        response_format=Person,
        **GREEDY,
    )
    message = completion.choices[0].message
    assert completion.choices[0].finish_reason == "stop"
    assert isinstance(message.parsed, Person)
    assert Person.model_validate_json(message.content) == message.parsed


def test_json_object_is_one_json_object(client, model_id):
    completion = client.chat.completions.create(
        model=model_id,
        messages=[{"role": "user", "content": "Describe a cat as JSON."}],
        response_format={"type": "json_object"},
        temperature=0,
        max_tokens=200,
    )
    assert completion.choices[0].finish_reason in ("stop", "length")
    text = completion.choices[0].message.content
    assert text.startswith("{")
    if completion.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)


def test_completions_take_response_format_and_guided_json(url):
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    bodies = [
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "n", "schema": schema},
            }
        },
        {"guided_json": schema},
    ]
    for extra in bodies:
        body = {"prompt": "A number as JSON:", **GREEDY, **extra}
        reply = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
        assert reply.status_code == 200, reply.text
        choice = reply.json()["choices"][0]
        assert choice["finish_reason"] == "stop"
        assert isinstance(json.loads(choice["text"])["n"], int)


def test_a_named_tool_choice_returns_a_call_matching_its_schema(client, model_id):
    completion = client.chat.completions.create(
        model=model_id,
        messages=ASK,
        tools=[WEATHER, TIME],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        **GREEDY,
    )
    assert isinstance(completion, ChatCompletion)
    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"
    arguments = json.loads(call.function.arguments)
    assert set(arguments) == {"city", "unit"} and arguments["unit"] in ("celsius", "fahrenheit")


def test_required_calls_one_of_the_tools(client, model_id):
    completion = client.chat.completions.create(
        model=model_id,
        messages=ASK,
        tools=[WEATHER, TIME],
        tool_choice="required",
        **GREEDY,
    )
    (call,) = completion.choices[0].message.tool_calls
    assert call.function.name in ("get_weather", "get_time")
    assert isinstance(json.loads(call.function.arguments), dict)


def test_a_streamed_call_accumulates_into_the_same_call(client, url, model_id):
    request = {
        "model": model_id,
        "messages": ASK,
        "tools": [WEATHER],
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        **GREEDY,
    }
    whole = client.chat.completions.create(**request).choices[0].message.tool_calls[0]
    with client.chat.completions.stream(**request) as stream:
        for _ in stream:
            pass
        final = stream.get_final_completion()
    (call,) = final.choices[0].message.tool_calls
    assert final.choices[0].finish_reason == "tool_calls"
    assert call.function.name == "get_weather"
    assert call.function.arguments == whole.function.arguments  # greedy: the same call
    # The raw chunks: the call's id and name first, then fragments of its arguments.
    with httpx.stream("POST", f"{url}/v1/chat/completions", json={**request, "stream": True}) as r:
        data = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    chunks = [ChatCompletionChunk.model_validate_json(d) for d in data[:-1]]
    pieces = [
        c.choices[0].delta.tool_calls for c in chunks if c.choices and c.choices[0].delta.tool_calls
    ]
    first = pieces[0][0]
    assert first.index == 0 and first.id and first.function.name == "get_weather"
    assert all(p[0].id is None and p[0].function.name is None for p in pieces[1:])
    assert len(pieces) > 2  # the arguments come in fragments
    assert "".join(p[0].function.arguments for p in pieces) == whole.function.arguments


@pytest.mark.parametrize(
    ("extra", "problem"),
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "bogus"}},
                }
            },
            "bogus",
        ),
        (
            {
                "tools": [
                    {**WEATHER, "function": {**WEATHER["function"], "parameters": {"$ref": "#/no"}}}
                ],
                "tool_choice": "required",
            },
            "tools",
        ),
    ],
)
def test_a_schema_the_library_cannot_compile_is_a_400_naming_it(client, extra, problem, model_id):
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=model_id, messages=ASK, **GREEDY, **extra)
    message = caught.value.body["message"]
    assert "cannot be compiled" in message and problem in message


def test_tool_choice_auto_without_a_parser_is_a_400_naming_the_flags(client, model_id):
    for extra in ({"tool_choice": "auto"}, {}):  # "auto" is the default with tools
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(
                model=model_id, messages=ASK, tools=[WEATHER], **GREEDY, **extra
            )
        assert "--enable-auto-tool-choice --tool-call-parser hermes" in str(caught.value)


def test_langchain_with_structured_output_in_both_modes(url, model_id):
    langchain_openai = pytest.importorskip("langchain_openai", reason="the `clients` extra")
    model = langchain_openai.ChatOpenAI(
        base_url=f"{url}/v1",
        api_key="unused",
        model=model_id,
        temperature=0,
        max_tokens=64,
    )
    prompt = "Invent a person: a name and an age."
    for method in ("json_schema", "function_calling"):
        person = model.with_structured_output(Person, method=method).invoke(prompt)
        assert isinstance(person, Person), method
