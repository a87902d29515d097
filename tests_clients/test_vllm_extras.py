"""vLLM's request extras sent the way vLLM's users send them: the openai SDK's `extra_body`,
against the live server with the embedded SmolLM2 (docs/usage.md, "vLLM request extras")."""

from __future__ import annotations

import re

import openai
import pytest

ASK = [{"role": "user", "content": "Is the sky blue? Answer yes or no."}]
GREEDY = {"temperature": 0, "max_tokens": 16}


def test_guided_choice_and_structured_outputs_choice_hold_the_answer(client, model_id):
    for extra in (
        {"guided_choice": ["yes", "no"]},
        {"structured_outputs": {"choice": ["yes", "no"]}},
    ):
        answer = client.chat.completions.create(
            model=model_id, messages=ASK, extra_body=extra, **GREEDY
        )
        assert answer.choices[0].message.content in ("yes", "no")


def test_guided_regex_holds_a_completion(client, model_id):
    answer = client.completions.create(
        model=model_id, prompt="The year is", extra_body={"guided_regex": "[0-9]{4}"}, **GREEDY
    )
    assert re.fullmatch("[0-9]{4}", answer.choices[0].text)


def test_template_and_output_extras_with_unknown_fields_are_served(client, model_id):
    """The stop string is kept with include_stop_str_in_output; the other extras, the vLLM
    fields served as unknown ones included, leave the greedy answer as it is."""
    ask = [{"role": "user", "content": "Write two sentences about cats."}]
    plain = {"stop": ["."], "top_k": 5, "repetition_penalty": 1.05}
    extra = {
        **plain,
        "chat_template_kwargs": {"enable_thinking": False},
        "add_generation_prompt": True,
        "skip_special_tokens": True,
        "spaces_between_special_tokens": False,
        "include_stop_str_in_output": True,
        "priority": 3,
        "truncate_prompt_tokens": None,
        "vllm_xargs": {"x": 1},
    }
    texts = [
        client.chat.completions.create(
            model=model_id, messages=ask, extra_body=body, temperature=0, max_tokens=48
        )
        .choices[0]
        .message.content
        for body in (plain, extra)
    ]
    assert texts[1] in (texts[0] + ".", texts[0])  # the second: the answer ended by EOS
    assert texts[1].endswith(".") or "." not in texts[1]


def test_two_constraints_are_a_400(client, model_id):
    extra = {"guided_choice": ["a"], "guided_regex": "a"}
    with pytest.raises(openai.BadRequestError, match="at most one structured output"):
        client.chat.completions.create(model=model_id, messages=ASK, extra_body=extra, **GREEDY)
