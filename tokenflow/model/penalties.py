"""Presence, frequency and repetition penalties, from the tokens each request has seen.

What a penalty needs is derived from the plans' chunks, which carry the core's own tokens: a
request's prompt tokens (for the repetition penalty) and how often each token occurs in its
output (for all three).  A chunk's tokens at positions below the prompt's length are prompt
tokens, the rest are outputs; a stream resumed by recompute sends its prompt and outputs again,
which changes nothing here (positions already counted are skipped), and one resumed by a reload
sends nothing new.  So a paused stream keeps its counts exactly, and only requests that ask for
a penalty are tracked (`SamplingParams.has_penalties`): the others cost nothing.  A stream that
arrives with outputs (moved here from another engine, tokenflow/core/migration.py) is recomputed
from position 0 in chunks; where the prompt ends is known only at the chunk that samples (it
ends the known sequence), so the chunks before it are held until then and counted with it.

The penalties are vLLM's (and OpenAI's), applied to the logits before temperature and greedy:
`repetition_penalty` divides a positive logit of any token seen in the prompt or output (and
multiplies a negative one); `frequency_penalty` is subtracted once per occurrence in the
output, `presence_penalty` once for any.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from tokenflow.core.plan import ScheduledChunk
from tokenflow.core.request import SamplingParams


@dataclass
class SeenTokens:
    """One request's tokens as penalties see them (tensors on the logits' device)."""

    output_counts: torch.Tensor  # [vocab] float32: occurrences of each token in the output
    in_prompt: torch.Tensor  # [vocab] bool: the token occurs in the prompt
    num_prompt_tokens: int | None = None  # known from the first chunk that samples
    num_counted_positions: int = 0  # outputs at positions below this are counted
    # An arrived stream's recompute chunks that came before its prompt's end was known.
    held_chunks: list[ScheduledChunk] = field(default_factory=list)


class TokenCounts:
    """The `SeenTokens` of every penalised request, kept from the plans' chunks."""

    def __init__(self, vocab_size: int, device: torch.device | str) -> None:
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self._seen: dict[str, SeenTokens] = {}

    def __len__(self) -> int:
        return len(self._seen)

    def release(self, request_ids: Sequence[str]) -> None:
        """Forget requests that are gone."""
        for request_id in request_ids:
            self._seen.pop(request_id, None)

    def get(self, request_id: str) -> SeenTokens | None:
        """The request's counts (None unless it asks for a penalty and has had a chunk)."""
        return self._seen.get(request_id)

    def observe(self, chunks: Sequence[ScheduledChunk]) -> None:
        """Count the tokens of a plan's chunks (call once per plan, before sampling it)."""
        for chunk in chunks:
            if chunk.sampling_params.has_penalties:
                self._observe(chunk)

    def _observe(self, chunk: ScheduledChunk) -> None:
        seen = self._seen.get(chunk.request_id)
        if seen is None:
            seen = self._seen[chunk.request_id] = SeenTokens(
                torch.zeros(self.vocab_size, dtype=torch.float32, device=self.device),
                torch.zeros(self.vocab_size, dtype=torch.bool, device=self.device),
            )
        end = chunk.start_position + chunk.num_tokens
        if chunk.num_output_tokens == 0:  # the first prefill: every token is the prompt's
            num_prompt = end
        elif seen.num_prompt_tokens is not None:
            num_prompt = seen.num_prompt_tokens
        elif chunk.samples_token:  # a sampling chunk ends the known sequence: prompt + outputs
            num_prompt = end - chunk.num_output_tokens
        else:  # an arrived stream's recompute, before the chunk that tells where its prompt ends
            seen.held_chunks.append(chunk)
            return
        if chunk.samples_token:
            seen.num_prompt_tokens = num_prompt
        for held in (*seen.held_chunks, chunk):
            self._count(seen, held, num_prompt)
        seen.held_chunks.clear()

    def _count(self, seen: SeenTokens, chunk: ScheduledChunk, num_prompt: int) -> None:
        """Add `chunk`'s tokens: those below `num_prompt` to the prompt's, the rest (the ones
        not counted yet) to the output counts."""
        start, end = chunk.start_position, chunk.start_position + chunk.num_tokens
        tokens = chunk.token_ids
        if start < num_prompt:
            prompt_ids = tokens[: min(end, num_prompt) - start]
            seen.in_prompt[torch.tensor(prompt_ids, device=self.device)] = True
        first_new = max(start, num_prompt, seen.num_counted_positions)
        if first_new < end:
            new_ids = torch.tensor(tokens[first_new - start :], device=self.device)
            seen.output_counts.index_add_(0, new_ids, torch.ones_like(new_ids, dtype=torch.float32))
            seen.num_counted_positions = end


def apply_penalties(
    logits: torch.Tensor, params: Sequence[SamplingParams], seen: Sequence[SeenTokens | None]
) -> torch.Tensor:
    """logits [R, vocab] -> the penalised logits (a new tensor; `logits` when no row asks).

    `params[i]` is row i's SamplingParams, `seen[i]` its counts (None: no penalty applies)."""
    rows = [i for i, s in enumerate(seen) if s is not None]
    if not rows:
        return logits
    out = logits.clone()
    index = torch.tensor(rows, device=logits.device)
    counts = torch.stack([seen[i].output_counts for i in rows])  # [P, vocab]
    in_prompt = torch.stack([seen[i].in_prompt for i in rows])  # [P, vocab]
    sub = out[index].float()  # [P, vocab]
    repetition = _column([params[i].repetition_penalty for i in rows], sub)
    frequency = _column([params[i].frequency_penalty for i in rows], sub)
    presence = _column([params[i].presence_penalty for i in rows], sub)
    is_seen = in_prompt | (counts > 0)
    penalised = torch.where(sub > 0, sub / repetition, sub * repetition)
    sub = torch.where(is_seen, penalised, sub)
    sub = sub - frequency * counts - presence * (counts > 0).float()
    out[index] = sub.to(out.dtype)
    return out


def _column(values: list[float], like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32, device=like.device)[:, None]
