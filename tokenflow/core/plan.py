"""The data that crosses the seam between the core and an executor.

Semantics of one step, which every executor (real or simulated) must honour:

1. `host_to_device` and `device_to_host` copies and the forward pass over `chunks` may run
   concurrently: no copy touches a block that the forward pass writes in the same step.
2. All copies of a plan are complete when `execute()` returns.
3. For each chunk the executor computes and stores the KV of `token_ids` at positions
   `start_position ...` into the chunk's device blocks, and, when `samples_token` is true, samples
   one next token from the logits of the chunk's last position.
4. `StepResult.sampled` holds one token per sampling chunk, in the plan's chunk order: the
   scheduler pairs tokens with chunks by position (it checks the count and, of the decodes,
   the first and last token's request id; the executors' tests check the whole order).
5. A row whose sampling failed (a NaN logit, a token its grammar refuses) still has its
   place in `sampled`, with a placeholder token, and is named in `StepResult.failed_rows` with
   why.  The scheduler never appends that token: it ends the request with the reason as an
   error (`RequestOutput.error`), and the other rows go on.

Block tables cross the seam as deltas (as in vLLM v1): a chunk carries only the device blocks
its request's table gained since the plan that last included it, and where they go; a table
that was freed (preemption) comes again whole, from index 0.  An executor that needs tables
keeps them with `BlockTables`.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType

from tokenflow.core.request import FinishReason, SamplingParams


class CopyKind(enum.Enum):
    WRITE_THROUGH = "write_through"  # device -> host, of a running request's full blocks
    EVICT = "evict"  # device -> host, the unsynced rest of a preempted request
    LOAD = "load"  # host -> device, of a resumed request


@dataclass(slots=True)
class BlockCopy:
    """Copy one KV block (all layers, K and V) between tiers.

    Treated as immutable; not frozen because frozen dataclasses are slow to build and a step
    plans dozens of copies (see ScheduledChunk).
    """

    request_id: str
    kind: CopyKind
    src_block_id: int
    dst_block_id: int


def attention_pairs(start_position: int, num_tokens: int) -> int:
    """Causal (query, key) pairs of a chunk of `num_tokens` queries at positions
    start_position ...: each attends to itself and everything before it (what a prefill's
    attention costs grow with)."""
    return num_tokens * start_position + num_tokens * (num_tokens + 1) // 2


@dataclass(slots=True)
class ScheduledChunk:
    """One request's share of a step: a prefill chunk or a single decode token.

    Treated as immutable; not frozen only because frozen dataclasses are slow to build and the
    scheduler builds one per stream per step.
    """

    request_id: str
    token_ids: tuple[int, ...]  # tokens whose KV this step computes
    start_position: int  # sequence position of token_ids[0]
    # The device block table covering [0, start_position + len(token_ids)) is the executor's
    # table for this request cut at block_table_start, then extended by new_block_ids.
    new_block_ids: tuple[int, ...]
    block_table_start: int
    samples_token: bool  # the chunk ends the known sequence: sample the next token
    sampling_params: SamplingParams
    num_output_tokens: int  # tokens generated so far (min_tokens masking, seeded sampling)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def is_decode(self) -> bool:
        return len(self.token_ids) == 1 and self.num_output_tokens > 0


@dataclass(slots=True)
class ChunkCounts:
    """A plan's tokens by kind.  A chunk of one token of a request with output is a decode
    (it reads start_position + 1 context tokens); every other chunk's tokens are prefill."""

    num_prefill_tokens: int
    num_decode_tokens: int
    num_decode_context_tokens: int  # decodes' attention reads, summed

    @classmethod
    def of(cls, chunks: Sequence[ScheduledChunk]) -> ChunkCounts:
        """The counts of `chunks`, summed in one pass."""
        prefill = decode = context = 0
        for chunk in chunks:
            if chunk.is_decode:
                decode += 1
                context += chunk.start_position + 1
            else:
                prefill += len(chunk.token_ids)
        return cls(prefill, decode, context)


@dataclass(frozen=True)
class StepPlan:
    """Everything an executor does in one step."""

    step_index: int
    chunks: tuple[ScheduledChunk, ...]
    device_to_host: tuple[BlockCopy, ...]  # write-through and eviction copies
    host_to_device: tuple[BlockCopy, ...]  # loads
    released_request_ids: tuple[str, ...]  # requests gone since the last plan: drop their state
    # Derived from chunks (`ChunkCounts.of`):
    num_prefill_tokens: int = field(init=False)
    num_decode_tokens: int = field(init=False)
    num_decode_context_tokens: int = field(init=False)  # decodes' attention reads, summed

    def __post_init__(self) -> None:
        counts = ChunkCounts.of(self.chunks)
        object.__setattr__(self, "num_prefill_tokens", counts.num_prefill_tokens)
        object.__setattr__(self, "num_decode_tokens", counts.num_decode_tokens)
        object.__setattr__(self, "num_decode_context_tokens", counts.num_decode_context_tokens)

    @property
    def is_empty(self) -> bool:
        return not (self.chunks or self.device_to_host or self.host_to_device)


class BlockTables:
    """An executor's copy of every request's device block table, kept from the plans' deltas."""

    def __init__(self) -> None:
        self._tables: dict[str, list[int]] = {}

    def apply(self, plan: StepPlan) -> None:
        """Bring the tables up to `plan` (call once per plan, in order, before executing it)."""
        tables = self._tables
        for request_id in plan.released_request_ids:
            tables.pop(request_id, None)
        for chunk in plan.chunks:
            table = tables.get(chunk.request_id)
            if table is None:
                table = tables[chunk.request_id] = []
            if chunk.new_block_ids or len(table) != chunk.block_table_start:
                del table[chunk.block_table_start :]
                table.extend(chunk.new_block_ids)

    def __getitem__(self, request_id: str) -> list[int]:
        """The device block table of a request in the last applied plan (do not modify)."""
        return self._tables[request_id]

    def __len__(self) -> int:
        return len(self._tables)


@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    """One token's log-probability under the model (its raw logits' log-softmax) and the most
    likely alternatives at that position, most likely first."""

    token_id: int
    logprob: float
    top_token_ids: tuple[int, ...]
    top_logprobs: tuple[float, ...]


@dataclass(slots=True)
class SampledToken:  # treated as immutable (built per token: see ScheduledChunk)
    request_id: str
    token_id: int
    logprobs: TokenLogprobs | None = None  # when the request asks (SamplingParams.logprobs)
    # With a request's first token, when it asks (SamplingParams.prompt_logprobs): one entry
    # per prompt position, None for the first (nothing predicts it).
    prompt_logprobs: tuple[TokenLogprobs | None, ...] | None = None


@dataclass(frozen=True)
class StepResult:
    """What an executor returns: one sampled token per chunk with `samples_token`, and the
    rows whose sampling failed (step semantics 5)."""

    sampled: tuple[SampledToken, ...]
    failed_rows: Mapping[str, str] = field(default_factory=dict)  # request id -> why it failed

    def __post_init__(self) -> None:
        # A read-only copy: the executor may go on to reuse the mapping it passed.
        object.__setattr__(self, "failed_rows", MappingProxyType(dict(self.failed_rows)))


@dataclass(slots=True)
class RequestOutput:
    """What the core reports about a request after a step (treated as immutable)."""

    request_id: str
    new_token_ids: tuple[int, ...]
    num_output_tokens: int
    finish_reason: FinishReason | None
    new_logprobs: tuple[TokenLogprobs, ...] = ()  # of new_token_ids, when the request asks
    prompt_logprobs: tuple[TokenLogprobs | None, ...] | None = None  # with the first token
    num_cached_tokens: int = 0  # prompt tokens whose KV a prefix-cache hit gave the request
    error: str | None = None  # why its sampling row failed (it ended as an abort: no token)

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None
