"""What each chunk, and the whole answer, says of one choice: its text and scored tokens.

With `echo` a choice's answer begins with its prompt (and, with logprobs, the prompt's tokens,
the first unscored); when only the prompt is scored (`max_tokens: 0`), the one token the engine
sampled is dropped from the text, the tokens and the usage.
"""

from __future__ import annotations

from tokenflow.engine.client import GenerationDelta
from tokenflow.serving.prepared import Piece, PreparedChoice, PreparedRequest, Progress, ShownToken


def record_scores(
    prepared: PreparedRequest, choice: PreparedChoice, progress: Progress, delta: GenerationDelta
) -> None:
    """Keep the delta's scored tokens (and, on the first, the prompt's) where asked."""
    progress.num_deltas += 1
    if not prepared.has_logprobs:
        return
    if prepared.echo and delta.prompt_logprobs is not None:
        progress.prompt_tokens = [
            ShownToken(token_id, entry)
            for token_id, entry in zip(choice.prompt_token_ids, delta.prompt_logprobs, strict=True)
        ]
    progress.tokens.extend(
        ShownToken(token_id, entry)
        for token_id, entry in zip(delta.token_ids, delta.logprobs, strict=True)
    )


def delta_piece(
    prepared: PreparedRequest, choice: PreparedChoice, progress: Progress, delta: GenerationDelta
) -> Piece:
    """The chunk of a delta just recorded (`record_scores`); advances the text offset."""
    text = delta.text
    tokens = progress.tokens[len(progress.tokens) - len(delta.logprobs) :]
    if prepared.scores_prompt_only:
        text, tokens = "", []
    if prepared.echo and progress.num_deltas == 1:
        text = choice.prompt_text + text
        tokens = progress.prompt_tokens + tokens
    offset = progress.num_sent_chars
    progress.num_sent_chars += len(text)
    return Piece(text, delta.finish_reason, tokens if prepared.has_logprobs else None, offset)


def whole_piece(prepared: PreparedRequest, choice: PreparedChoice, progress: Progress) -> Piece:
    """A finished choice in one piece (the non-streaming answer)."""
    text = "".join(progress.text_parts)
    tokens = progress.tokens
    if prepared.scores_prompt_only:
        text, tokens = "", []
    if prepared.echo:
        text = choice.prompt_text + text
        tokens = progress.prompt_tokens + tokens
    return Piece(text, progress.finish_reason, tokens if prepared.has_logprobs else None)
