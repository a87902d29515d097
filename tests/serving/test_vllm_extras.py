"""vLLM's request extras on the OpenAI endpoints: honoured, mapped, or accepted and ignored."""

from __future__ import annotations

import logging

import httpx
import pytest

from tests.serving.fake_engine import FakeEngine
from tests.serving.test_errors import assert_error

pytestmark = pytest.mark.anyio

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MESSAGES = [{"role": "user", "content": "hi"}]


async def _chat(client: httpx.AsyncClient, **extra: object) -> httpx.Response:
    return await client.post(CHAT, json={"messages": MESSAGES, "max_tokens": 2, **extra})


def _prompt(engine: FakeEngine) -> str:
    return engine.tokenizer.decode(engine.prompts[-1]).strip()


async def test_chat_template_kwargs_reach_the_template(client, engine) -> None:
    assert (await _chat(client)).status_code == 200
    assert _prompt(engine) == "<|user|> hi <|assistant|>"
    kwargs = {"enable_thinking": False}
    assert (await _chat(client, chat_template_kwargs=kwargs)).status_code == 200
    assert _prompt(engine) == "<|enable_thinking=False|> <|user|> hi <|assistant|>"


async def test_no_generation_prompt_and_a_continued_final_message(client, engine) -> None:
    assert (await _chat(client, add_generation_prompt=False)).status_code == 200
    assert _prompt(engine) == "<|user|> hi"
    messages = [*MESSAGES, {"role": "assistant", "content": "The"}]
    body = {"messages": messages, "max_tokens": 2}
    extra = {"add_generation_prompt": False, "continue_final_message": True}
    assert (await client.post(CHAT, json={**body, **extra})).status_code == 200
    assert _prompt(engine) == "<|user|> hi <|assistant...|> The"


async def test_both_generation_prompt_and_continued_message_are_refused(client, engine) -> None:
    body = {"add_generation_prompt": True, "continue_final_message": True}
    error = assert_error(await _chat(client, **body), 400, "continue_final_message")
    assert error["message"] == (
        "Cannot set both `continue_final_message` and `add_generation_prompt` to True."
    )
    assert engine.submitted == []


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
async def test_output_extras_travel_in_the_sampling_params(client, engine, path) -> None:
    body = {"messages": MESSAGES} if path == CHAT else {"prompt": "x"}
    extra = {
        "skip_special_tokens": False,
        "spaces_between_special_tokens": False,
        "include_stop_str_in_output": True,
    }
    assert (await client.post(path, json={**body, "max_tokens": 2})).status_code == 200
    assert (await client.post(path, json={**body, "max_tokens": 2, **extra})).status_code == 200
    (_, default, _), (_, given, _) = engine.submitted
    assert (default.skip_special_tokens, default.spaces_between_special_tokens) == (True, True)
    assert default.include_stop_str_in_output is False
    assert (given.skip_special_tokens, given.spaces_between_special_tokens) == (False, False)
    assert given.include_stop_str_in_output is True


@pytest.mark.parametrize(
    ("extra", "kind", "text", "origin"),
    [
        ({"guided_choice": ["yes", 'n"o']}, "grammar", 'root ::= "yes" | "n\\"o"', "guided_choice"),
        ({"guided_regex": "[0-9]+"}, "regex", "[0-9]+", "guided_regex"),
        ({"guided_grammar": 'root ::= "a"'}, "grammar", 'root ::= "a"', "guided_grammar"),
        ({"guided_json": {"type": "integer"}}, "json_schema", '{"type": "integer"}', "guided_json"),
        ({"structured_outputs": {"choice": ["a"]}}, "grammar", 'root ::= "a"', None),
        ({"structured_outputs": {"regex": "a+"}}, "regex", "a+", "structured_outputs.regex"),
        ({"structured_outputs": {"json": {"type": "integer"}}}, "json_schema", None, None),
        ({"structured_outputs": {"json_object": True}}, "json_schema", '{"type": "object"}', None),
    ],
)
@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
async def test_vllm_constraints_become_the_structured_output(
    client, engine, path, extra, kind, text, origin
) -> None:
    body = {"messages": MESSAGES} if path == CHAT else {"prompt": "x"}
    response = await client.post(path, json={**body, "max_tokens": 2, **extra})
    assert response.status_code == 200, response.text
    assert engine.num_compiles == 1  # compiled before it was submitted, off the loop
    spec = engine.submitted[-1][1].structured_output
    assert spec is not None and spec.kind == kind
    assert text is None or spec.json_schema == text
    assert origin is None or spec.origin == origin


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"guided_choice": ["a"], "guided_regex": "a"}, "guided_choice"),
        ({"response_format": {"type": "json_object"}, "guided_json": {}}, "guided_json"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
        ({"structured_outputs": {"grammar": "root ::= x"}, "guided_regex": "a"}, "guided_regex"),
    ],
)
async def test_two_constraints_are_refused_naming_them(client, engine, extra, param) -> None:
    error = assert_error(await _chat(client, **extra), 400, param)
    assert "at most one structured output constraint" in error["message"]
    assert all(name.split("_")[0] in error["message"] for name in extra)
    assert engine.submitted == []


async def test_a_constraint_with_a_forced_tool_call_is_refused(client, engine) -> None:
    tool = {"type": "function", "function": {"name": "f"}}
    extra = {"tools": [tool], "tool_choice": "required", "guided_regex": "a"}
    error = assert_error(await _chat(client, **extra), 400, "tool_choice")
    assert "guided_regex" in error["message"]


async def test_priority_is_accepted_and_does_not_change_the_request(client, engine, caplog) -> None:
    with caplog.at_level(logging.DEBUG, logger="tokenflow.serving.openai_serving"):
        assert (await _chat(client, priority=-5)).status_code == 200
    assert (await _chat(client)).status_code == 200
    (_, first, first_rate), (_, second, second_rate) = engine.submitted
    assert (first, first_rate) == (second, second_rate)
    assert any("priority=-5" in r.getMessage() for r in caplog.records)
    assert_error(await _chat(client, priority=1.5), 400, "priority")


async def test_no_op_extras_are_accepted_without_a_log(client, engine, caplog) -> None:
    extra = {
        "use_beam_search": False,
        "length_penalty": 1.0,
        "guided_decoding_backend": "xgrammar",
        "top_k": 5,
        "min_p": 0.1,
        "repetition_penalty": 1.1,
    }
    with caplog.at_level(logging.WARNING, logger="tokenflow.serving.openai_serving"):
        assert (await _chat(client, **extra)).status_code == 200
    assert not [r for r in caplog.records if "ignored" in r.getMessage()]
    params = engine.submitted[-1][1]
    assert (params.top_k, params.min_p, params.repetition_penalty) == (5, 0.1, 1.1)


@pytest.mark.parametrize(
    ("field", "value"),
    [("allowed_token_ids", [1, 2]), ("bad_words", ["no"]), ("truncate_prompt_tokens", 8),
     ("echo", True)],
)  # fmt: skip
async def test_a_vllm_field_that_would_change_the_answer_is_refused_by_name(
    client, engine, field, value
) -> None:
    assert_error(await _chat(client, **{field: value}), 400, field)
    assert engine.submitted == []


@pytest.mark.parametrize(
    ("field", "value"), [("allowed_token_ids", []), ("bad_words", None), ("echo", False)]
)
async def test_the_same_fields_at_their_neutral_value_are_served(client, field, value) -> None:
    assert (await _chat(client, **{field: value})).status_code == 200
