"""Log-probabilities for the requests that ask: of each sampled token, and of each prompt token.

Both are the log-softmax of the model's raw logits (before penalties, temperature or masks, as
vLLM reports them by default), computed only for the rows of requests that ask, so a batch
without such a request does no extra work at all.

Prompt logprobs need the logits of every prompt position, not only the last: the executor asks
the model for the rows of a first prefill's chunks (`PromptLogprobs.rows_of`) and hands them
back (`PromptLogprobs.record`).  The logits at position p score the token at p + 1; the last row
of a chunk that does not end the prompt scores the next chunk's first token, so its log-softmax
is kept until that chunk comes.  Entries are kept by position, so a prefill restarted from
position 0 (a recompute) or continued after a reload yields the same list.  The list goes out
with the request's first sampled token.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from tokenflow.core.plan import ScheduledChunk, TokenLogprobs
from tokenflow.core.request import SamplingParams


def sampled_logprobs(
    logits: torch.Tensor, params: Sequence[SamplingParams], token_ids: Sequence[int]
) -> list[TokenLogprobs | None]:
    """logits [R, vocab] (raw) -> row i's `TokenLogprobs` for `token_ids[i]` where
    `params[i].logprobs` asks (with that many alternatives), else None."""
    rows = [i for i, p in enumerate(params) if p.logprobs is not None]
    out: list[TokenLogprobs | None] = [None] * len(params)
    if not rows:
        return out
    chosen = torch.tensor([token_ids[i] for i in rows], device=logits.device)
    entries = score_rows(logits[rows], chosen, max(params[i].logprobs or 0 for i in rows))
    for i, entry in zip(rows, entries, strict=True):
        out[i] = _cut(entry, params[i].logprobs or 0)
    return out


def score_rows(logits: torch.Tensor, token_ids: torch.Tensor, num_top: int) -> list[TokenLogprobs]:
    """logits [R, vocab], token_ids [R] -> each row's logprob of its token and its `num_top`
    most likely alternatives (one transfer to the CPU for the batch)."""
    log_probs = torch.log_softmax(logits.float(), dim=-1)  # [R, vocab]
    picked = log_probs.gather(1, token_ids[:, None]).squeeze(1).tolist()  # [R]
    if num_top:
        top = torch.topk(log_probs, num_top, dim=-1)
        top_ids, top_values = top.indices.tolist(), top.values.tolist()
    else:
        top_ids = top_values = [[] for _ in picked]
    ids = token_ids.tolist()
    return [
        TokenLogprobs(ids[r], picked[r], tuple(top_ids[r]), tuple(top_values[r]))
        for r in range(len(picked))
    ]


def _cut(entry: TokenLogprobs, num_top: int) -> TokenLogprobs:
    if len(entry.top_token_ids) == num_top:
        return entry
    top_ids, top_values = entry.top_token_ids[:num_top], entry.top_logprobs[:num_top]
    return TokenLogprobs(entry.token_id, entry.logprob, top_ids, top_values)


def wants_prompt_logprobs(chunk: ScheduledChunk) -> bool:
    """A chunk of a request's first prefill whose request asks for prompt logprobs."""
    return chunk.sampling_params.prompt_logprobs is not None and chunk.num_output_tokens == 0


@dataclass
class _Scoring:
    """One request's prompt logprobs so far."""

    entries: list[TokenLogprobs | None] = field(default_factory=lambda: [None])  # by position
    pending_position: int = -1  # the position whose log-softmax row is kept
    pending_row: torch.Tensor | None = None  # [vocab]: scores the token at pending_position + 1


class PromptLogprobs:
    """Every asking request's prompt logprobs, built chunk by chunk."""

    def __init__(self) -> None:
        self._scoring: dict[str, _Scoring] = {}

    def __len__(self) -> int:
        return len(self._scoring)

    def release(self, request_ids: Sequence[str]) -> None:
        """Forget requests that are gone."""
        for request_id in request_ids:
            self._scoring.pop(request_id, None)

    @staticmethod
    def rows_of(chunk: ScheduledChunk, last_row: int) -> list[int]:
        """The rows (of a flattened batch whose chunk ends at `last_row`) whose logits this
        chunk's prompt logprobs need: all but the sampling row of a chunk that ends the prompt."""
        first_row = last_row - chunk.num_tokens + 1
        end = last_row if chunk.samples_token else last_row + 1
        return list(range(first_row, end))

    def record(self, chunk: ScheduledChunk, logits: torch.Tensor) -> None:
        """Score the chunk's tokens from `logits` [len(rows_of(chunk)), vocab] (raw)."""
        scoring = self._scoring.get(chunk.request_id)
        start, tokens = chunk.start_position, chunk.token_ids
        if scoring is None or start == 0:
            scoring = self._scoring[chunk.request_id] = _Scoring()
        num_top = chunk.sampling_params.prompt_logprobs or 0
        entries = scoring.entries
        del entries[start + 1 :]  # a prefill sent again from `start` scores the same tokens
        if len(entries) == start:  # the previous chunk's last row scores this one's first token
            pending = scoring.pending_row
            if pending is not None and scoring.pending_position == start - 1:
                first = torch.tensor([tokens[0]], device=logits.device)
                entries.extend(score_rows(pending[None], first, num_top))
        entries.extend([None] * (start + 1 - len(entries)))  # (only if a row went missing)
        num_scored = min(len(tokens) - 1, logits.shape[0])
        if num_scored > 0:
            targets = torch.tensor(tokens[1 : num_scored + 1], device=logits.device)
            entries.extend(score_rows(logits[:num_scored], targets, num_top))
        if not chunk.samples_token:
            scoring.pending_position = start + len(tokens) - 1
            scoring.pending_row = logits[-1].clone()

    def take(self, request_id: str) -> tuple[TokenLogprobs | None, ...]:
        """The finished list (one entry per prompt position), forgotten here."""
        scoring = self._scoring.pop(request_id, None)
        return tuple(scoring.entries) if scoring is not None else (None,)
