"""Token selection per request: greedy, or temperature / top-k / top-p from a counter-based draw.

All sampled rows of a step go through one vectorized pass: temperature, top-k (one `topk` to the
largest k of the batch), top-p (one sort, only over rows that ask for it), softmax, then an
inverse-CDF draw (cumsum + searchsorted) with one uniform number per row.

A row's uniform is a function of its stream's seed and its output position alone
(`position_uniform`: a hash of both, as counter-based generators such as Philox draw), not the
state of a generator that has drawn the earlier tokens.  So a request's draws never depend on
which other requests share the batch, the sampler keeps no per-request state, and a stream that
resumes elsewhere (moved to another engine, tokenflow/core/migration.py) draws at its next
position what it would have drawn where it was: a seeded stream continues exactly.  Unseeded
requests draw from a key derived from the engine seed and the request id (the same on every
engine started with the same seed).
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tokenflow.core.request import SamplingParams
from tokenflow.model.penalties import SeenTokens, apply_penalties

logger = logging.getLogger(__name__)
PLACEHOLDER_TOKEN_ID = 0  # stands in for a row whose sampling failed (the request is ended)


@dataclass(frozen=True)
class SamplingRow:
    """One row of logits to sample from, and what governs it."""

    request_id: str
    params: SamplingParams
    num_output_tokens: int  # tokens generated before this one
    seen: SeenTokens | None = None  # the counts its penalties need (None: it asks for none)


class Sampler:
    """Chooses one token per logits row; stateless across steps (see the module docstring)."""

    def __init__(self, eos_token_ids: Sequence[int], seed: int = 0) -> None:
        self.eos_token_ids = tuple(eos_token_ids)
        self.seed = seed

    def sample(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> list[int]:
        """logits [num_rows, vocab] (float32) -> one token id per row."""
        if logits.shape[0] != len(rows):
            raise ValueError(f"{logits.shape[0]} logits rows for {len(rows)} sampling rows")
        if not rows:
            return []
        logits = self._mask_min_tokens(logits, rows)
        logits = apply_penalties(logits, [row.params for row in rows], [row.seen for row in rows])
        # Greedy for every row at once; max().indices is argmax (first maximum on ties) and
        # measured 1.7x faster than argmax() on CPU for [32, 49152].
        tokens = logits.max(dim=-1).indices.tolist()
        random_rows = [i for i, row in enumerate(rows) if row.params.temperature > 0]
        if random_rows:
            picked = logits[random_rows].float().cpu()  # [R, vocab]
            drawn = self._sample_rows(picked, [rows[i] for i in random_rows])
            for index, token in zip(random_rows, drawn, strict=True):
                tokens[index] = token
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

    def _sample_rows(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> list[int]:
        """logits [R, vocab] float32 on CPU -> one token per row, each from its own generator."""
        temperatures = torch.tensor([row.params.temperature for row in rows])
        scaled = logits / temperatures[:, None]
        scaled = _top_k(scaled, [row.params.top_k for row in rows])
        probs = torch.softmax(scaled, dim=-1)
        probs = drop_below_min_p(probs, [row.params.min_p for row in rows])
        top_p = [row.params.top_p for row in rows]
        if min(top_p) < 1.0:
            probs = _top_p(probs, top_p)
        uniforms = torch.tensor(
            [position_uniform(self._stream_key(row), row.num_output_tokens) for row in rows],
            dtype=torch.float64,
        )
        return draw_inverse_cdf(probs, uniforms).tolist()

    def _stream_key(self, row: SamplingRow) -> str:
        """What a row's draws are keyed by: its seed, else the engine seed and its request id."""
        if row.params.seed is not None:
            return f"seed:{row.params.seed}"
        return f"engine:{self.seed}:{row.request_id}"


def position_uniform(stream_key: str, position: int) -> float:
    """The uniform number in [0, 1) that stream `stream_key` draws for its output token at
    `position` (0 for the first): 53 bits of a BLAKE2b hash of both, so every position of every
    stream gets an independent, reproducible draw (a microsecond each, no generator state)."""
    digest = hashlib.blake2b(f"{stream_key}#{position}".encode(), digest_size=8).digest()
    return (int.from_bytes(digest, "little") >> 11) * 2.0**-53


def sample_isolated(
    sampler: Sampler, logits: torch.Tensor, rows: list[SamplingRow], failed_rows: dict[str, str]
) -> list[int]:
    """Sample the batch; if that raises, row by row, so one bad row fails only its request.

    A row that still fails gets PLACEHOLDER_TOKEN_ID and its reason in `failed_rows`.
    """
    try:
        return sampler.sample(logits, rows)
    except Exception:  # noqa: BLE001 - retried per row below
        logger.debug("batch sampling failed; retrying row by row", exc_info=True)
    token_ids: list[int] = []
    for index, row in enumerate(rows):
        try:
            token_ids.extend(sampler.sample(logits[index : index + 1], [row]))
        except Exception as err:  # noqa: BLE001 - attributed to this request alone
            failed_rows[row.request_id] = f"sampling failed: {err}"
            token_ids.append(PLACEHOLDER_TOKEN_ID)
    return token_ids


def _top_k(scaled: torch.Tensor, top_k: Sequence[int]) -> torch.Tensor:
    """Mask all but each row's k best logits (k = 0 or >= vocab: keep all); ties at the kth kept."""
    vocab = scaled.shape[-1]
    ks = [k if 0 < k < vocab else 0 for k in top_k]
    if not any(ks):
        return scaled
    values = torch.topk(scaled, max(ks), dim=-1).values  # [R, max_k], descending
    kth = values.gather(1, torch.tensor([max(k, 1) - 1 for k in ks])[:, None])  # [R, 1]
    kth[torch.tensor([k == 0 for k in ks])] = float("-inf")
    return scaled.masked_fill(scaled < kth, float("-inf"))


def drop_below_min_p(probs: torch.Tensor, min_p: Sequence[float]) -> torch.Tensor:
    """Drop each row's tokens less likely than its min_p times its most likely token's
    probability (min_p = 0: keep all); probs [R, vocab], not renormalised (see `_top_p`)."""
    if not any(min_p):
        return probs
    limits = (
        torch.tensor(min_p, dtype=probs.dtype)[:, None] * probs.max(dim=-1, keepdim=True).values
    )
    return probs.masked_fill(probs < limits, 0.0)


def _top_p(probs: torch.Tensor, top_p: Sequence[float]) -> torch.Tensor:
    """Keep each row's smallest set of most likely tokens whose mass reaches its top_p.

    probs [R, vocab]; only rows with top_p < 1 are sorted.  The kept mass is not renormalised:
    the inverse-CDF draw scales by each row's total.
    """
    needs = [i for i, p in enumerate(top_p) if p < 1.0]
    sub = probs[needs]
    sorted_probs, order = torch.sort(sub, dim=-1, descending=True)
    mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
    limits = torch.tensor([top_p[i] for i in needs])[:, None]
    sorted_probs = sorted_probs.masked_fill(mass_before >= limits, 0.0)  # the top token survives
    out = probs.clone()
    out[needs] = torch.zeros_like(sub).scatter_(1, order, sorted_probs)
    return out


def draw_inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """probs [R, vocab] (unnormalised, >= 0), uniforms [R] in [0, 1) -> token ids [R].

    Token i is drawn with probability probs[i] / sum(probs): the first index whose cumulative
    mass exceeds u * total.  A zero-probability token is never the answer (its cdf is flat).
    """
    cdf = torch.cumsum(probs.double(), dim=-1)  # [R, vocab]; float64 keeps the tail exact
    total = cdf[:, -1]
    # Strictly below the total even when u * total rounds up to it.
    targets = torch.minimum(uniforms * total, torch.nextafter(total, torch.zeros_like(total)))
    targets = targets[:, None]  # [R, 1]
    tokens = torch.searchsorted(cdf, targets, right=True).squeeze(1)
    return tokens.clamp_(max=probs.shape[-1] - 1)
