"""The data that crosses the seam between the core and an executor.

Semantics of one step, which every executor (real or simulated) must honour:

1. `host_to_device` and `device_to_host` copies and the forward pass over `chunks` may run
   concurrently: no copy touches a block that the forward pass writes in the same step.
2. All copies of a plan are complete when `execute()` returns.
3. For each chunk the executor computes and stores the KV of `token_ids` at positions
   `start_position ...` into the chunk's device blocks, and, when `samples_token` is true, samples
   one next token from the logits of the chunk's last position.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from tokenflow.core.request import FinishReason, SamplingParams


class CopyKind(enum.Enum):
    WRITE_THROUGH = "write_through"  # device -> host, of a running request's full blocks
    EVICT = "evict"  # device -> host, the unsynced rest of a preempted request
    LOAD = "load"  # host -> device, of a resumed request


@dataclass(frozen=True)
class BlockCopy:
    """Copy one KV block (all layers, K and V) between tiers."""

    request_id: str
    kind: CopyKind
    src_block_id: int
    dst_block_id: int


@dataclass(slots=True)
class ScheduledChunk:
    """One request's share of a step: a prefill chunk or a single decode token.

    Treated as immutable; not frozen only because frozen dataclasses are slow to build and the
    scheduler builds one per stream per step.
    """

    request_id: str
    token_ids: tuple[int, ...]  # tokens whose KV this step computes
    start_position: int  # sequence position of token_ids[0]
    block_ids: tuple[int, ...]  # device block table covering [0, start_position + len(token_ids))
    samples_token: bool  # the chunk ends the known sequence: sample the next token
    sampling_params: SamplingParams
    num_output_tokens: int  # tokens generated so far (min_tokens masking, seeded sampling)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def is_decode(self) -> bool:
        return len(self.token_ids) == 1 and self.num_output_tokens > 0


@dataclass(frozen=True)
class StepPlan:
    """Everything an executor does in one step."""

    step_index: int
    chunks: tuple[ScheduledChunk, ...]
    device_to_host: tuple[BlockCopy, ...]  # write-through and eviction copies
    host_to_device: tuple[BlockCopy, ...]  # loads
    released_request_ids: tuple[str, ...]  # requests gone since the last plan: drop their state

    @property
    def num_prefill_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks if not c.is_decode)

    @property
    def num_decode_tokens(self) -> int:
        return sum(1 for c in self.chunks if c.is_decode)

    @property
    def num_decode_context_tokens(self) -> int:
        """Tokens the decoding streams attend to, summed (the step's attention reads)."""
        return sum(c.start_position + 1 for c in self.chunks if c.is_decode)

    @property
    def is_empty(self) -> bool:
        return not (self.chunks or self.device_to_host or self.host_to_device)


@dataclass(slots=True)
class SampledToken:  # treated as immutable (built per token: see ScheduledChunk)
    request_id: str
    token_id: int


@dataclass(frozen=True)
class StepResult:
    """What an executor returns: one sampled token per chunk with `samples_token`."""

    sampled: tuple[SampledToken, ...]


@dataclass(slots=True)
class RequestOutput:
    """What the core reports about a request after a step (treated as immutable)."""

    request_id: str
    new_token_ids: tuple[int, ...]
    num_output_tokens: int
    finish_reason: FinishReason | None

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None
