"""The reference answers other clients are compared with: one greedy request through the openai
SDK, the prompt alone."""

from __future__ import annotations

import openai

CHAT_MESSAGE = "What is the capital of France?"
COMPLETION_PROMPT = "The three primary colors are"
MAX_TOKENS = 12


def greedy_chat(client: openai.OpenAI, model_id: str, message: str, max_tokens: int) -> str:
    """The greedy chat answer to one user message."""
    answer = client.chat.completions.create(
        model=model_id,
        messages=[{"role": "user", "content": message}],
        max_tokens=max_tokens,
        temperature=0,
    )
    return answer.choices[0].message.content or ""


def greedy_completion(
    client: openai.OpenAI,
    model_id: str,
    prompt: str | list[int],
    max_tokens: int,
    stop: list[str] | None = None,
) -> str:
    """The greedy continuation of one prompt (a text or token ids)."""
    answer = client.completions.create(
        model=model_id, prompt=prompt, max_tokens=max_tokens, temperature=0, stop=stop
    )
    assert len(answer.choices) == 1
    return answer.choices[0].text
