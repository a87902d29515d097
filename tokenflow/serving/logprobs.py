"""Logprobs in OpenAI's two shapes: the legacy one of /v1/completions and chat's per-token list.

A token's text is its own decoding (as vLLM shows it), so a token that holds part of a UTF-8
character shows as U+FFFD; chat's `bytes` are that text's UTF-8 bytes.  A completion's
`text_offset` counts those texts' characters from the choice's text offset, and its
`top_logprobs` dict holds the chosen token as well as the alternatives (as vLLM's does).
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenflow.engine.client import Tokenizer
from tokenflow.serving.prepared import ShownToken
from tokenflow.serving.protocol import (
    ChatLogprobs,
    ChatTokenLogprob,
    CompletionLogprobs,
    TopLogprob,
)


class TokenTexts:
    """Each token's own text, decoded once per token id (at most the vocabulary's size)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._texts: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            text = self._texts[token_id] = self._tokenizer.decode([token_id])
        return text


def completion_logprobs(
    tokens: Sequence[ShownToken], texts: TokenTexts, text_offset: int
) -> CompletionLogprobs:
    """The legacy shape of `tokens`, offsets counted from `text_offset`."""
    strings, token_logprobs, tops, offsets = [], [], [], []
    for shown in tokens:
        text = texts(shown.token_id)
        strings.append(text)
        offsets.append(text_offset)
        text_offset += len(text)
        entry = shown.logprobs
        if entry is None:
            token_logprobs.append(None)
            tops.append(None)
            continue
        token_logprobs.append(entry.logprob)
        top = {texts(t): lp for t, lp in zip(entry.top_token_ids, entry.top_logprobs, strict=True)}
        top.setdefault(text, entry.logprob)
        tops.append(top)
    return CompletionLogprobs(
        tokens=strings, token_logprobs=token_logprobs, top_logprobs=tops, text_offset=offsets
    )


def chat_logprobs(tokens: Sequence[ShownToken], texts: TokenTexts) -> ChatLogprobs:
    """Chat's shape of `tokens` (every one of them has logprobs: outputs only)."""
    content = []
    for shown in tokens:
        entry = shown.logprobs
        if entry is None:
            continue
        tops = [
            TopLogprob(token=texts(t), logprob=lp, bytes=list(texts(t).encode()))
            for t, lp in zip(entry.top_token_ids, entry.top_logprobs, strict=True)
        ]
        text = texts(shown.token_id)
        content.append(
            ChatTokenLogprob(
                token=text, logprob=entry.logprob, bytes=list(text.encode()), top_logprobs=tops
            )
        )
    return ChatLogprobs(content=content)
