"""A sweep of step shapes through an executor, each step timed on an injected clock.

`tokenflow profile` runs it on the real engine's `ModelExecutor`; the tests run it on a
synthetic executor whose step times are known.  It only builds `StepPlan`s by hand (no
scheduler: the shapes are chosen, not decided) and reads the clock around `execute()`, so it
needs neither torch nor the wall clock itself.

Shapes (`SweepSpec`):

- decode steps of B streams, each at a context of C tokens (B x C points);
- prefill chunks of T tokens, from position 0 and after S cached tokens (the quadratic
  attention term of a chunked prompt), alone and beside a few decodes (mixed steps);
- block copies of k blocks device -> host and host -> device, with no compute.

Every point is stepped `warmup_steps` untimed, then `repeats` timed; the whole sweep runs in
`rounds` rounds in alternating order, so a slow spell of a shared machine lands on several
points rather than on one.  Request i owns a contiguous range of device blocks (wrapping
around the tier when the tier is smaller than the sweep), and its whole table is sent with
every chunk (the executor replaces its copy).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

from tokenflow.core.plan import (
    BlockCopy,
    CopyKind,
    ScheduledChunk,
    StepPlan,
    StepResult,
    attention_pairs,
)
from tokenflow.core.request import SamplingParams

_TOKEN_ID = 1000  # an ordinary token of any supported vocabulary (the values do not matter)


class SweepExecutor(Protocol):
    def execute(self, plan: StepPlan) -> StepResult:
        """Run one step (tokenflow.core.plan's contract)."""
        ...


@dataclass(frozen=True)
class SweepSpec:
    """Which shapes to time, and how often."""

    decode_batches: tuple[int, ...] = (1, 2, 4, 6, 8, 12, 16, 24, 32)
    decode_contexts: tuple[int, ...] = (64, 320, 640, 1280)  # whole blocks (of up to 64 tokens)
    # Prefill chunks: the engine's are >= 128 tokens but for short prompts (a 32-token step ran
    # ~25% under the line through the larger ones).  Deep starts: on the project's CPU a
    # 160-token chunk after 1120 cached tokens took 380 ms against 214 fresh; after 384 a chunk
    # costs only 2-13% more, within a shared CPU's noise, which left the attention term unfitted.
    prefill_tokens: tuple[int, ...] = (64, 128, 256, 512)
    prefill_starts: tuple[int, ...] = (0, 384, 1024)  # cached tokens before the chunk
    mixed_decodes: tuple[int, ...] = (4, 16)  # decodes beside a prefill chunk
    copy_blocks: tuple[int, ...] = (1, 8, 32, 96)
    warmup_steps: int = 1
    repeats: int = 3
    rounds: int = 2

    def __post_init__(self) -> None:
        for name in ("decode_batches", "decode_contexts", "prefill_tokens", "copy_blocks"):
            values = getattr(self, name)
            if not values or min(values) < 1:
                raise ValueError(f"{name} must be non-empty, every value >= 1")
        if self.repeats < 1 or self.rounds < 1 or self.warmup_steps < 0:
            raise ValueError("repeats and rounds must be >= 1, warmup_steps >= 0")

    def shapes(self) -> list[StepShape]:
        """Every point of one round, in a fixed order."""
        shapes = [
            StepShape(num_decode_seqs=b, context_tokens_per_seq=c)
            for c in self.decode_contexts
            for b in self.decode_batches
        ]
        mixed_context = self.decode_contexts[0]
        shapes += [
            StepShape(
                num_prefill_tokens=t,
                prefill_start=start,
                num_decode_seqs=d,
                context_tokens_per_seq=mixed_context if d else 0,
            )
            for start in self.prefill_starts
            for t in self.prefill_tokens
            for d in (0, *(self.mixed_decodes if start == 0 else ()))
        ]
        shapes += [StepShape(num_d2h_blocks=k) for k in self.copy_blocks]
        shapes += [StepShape(num_h2d_blocks=k) for k in self.copy_blocks]
        return shapes

    @property
    def num_steps(self) -> int:
        """Steps the whole sweep executes (for a progress bar)."""
        return len(self.shapes()) * self.rounds * (self.warmup_steps + self.repeats)


@dataclass(frozen=True)
class StepShape:
    """One point of the sweep."""

    num_decode_seqs: int = 0
    context_tokens_per_seq: int = 0  # every decode attends to this many tokens (itself included)
    num_prefill_tokens: int = 0
    prefill_start: int = 0  # cached tokens before the prefill chunk
    num_d2h_blocks: int = 0
    num_h2d_blocks: int = 0

    @property
    def max_tokens_per_seq(self) -> int:
        return max(self.context_tokens_per_seq, self.prefill_start + self.num_prefill_tokens)


@dataclass(frozen=True)
class StepSample:
    """One timed step: what it computed and copied, and how long `execute()` took."""

    num_decode_seqs: int
    decode_context_tokens: int  # summed over the decodes
    num_prefill_tokens: int
    prefill_attention_pairs: int  # causal (query, key) pairs of the prefill chunk
    num_d2h_blocks: int
    num_h2d_blocks: int
    duration_s: float

    @property
    def num_tokens(self) -> int:
        """Tokens of the forward pass (what decides one thread or all, on a CPU)."""
        return self.num_decode_seqs + self.num_prefill_tokens

    @classmethod
    def of(cls, shape: StepShape, duration_s: float) -> StepSample:
        t, s = shape.num_prefill_tokens, shape.prefill_start
        return cls(
            num_decode_seqs=shape.num_decode_seqs,
            decode_context_tokens=shape.num_decode_seqs * shape.context_tokens_per_seq,
            num_prefill_tokens=t,
            prefill_attention_pairs=attention_pairs(s, t),
            num_d2h_blocks=shape.num_d2h_blocks,
            num_h2d_blocks=shape.num_h2d_blocks,
            duration_s=duration_s,
        )


class _PlanBuilder:
    """Hand-built plans over a device tier of `num_device_blocks` and a host tier."""

    def __init__(self, block_size: int, num_device_blocks: int, num_host_blocks: int) -> None:
        self.block_size = block_size
        self.num_device_blocks = num_device_blocks
        self.num_host_blocks = num_host_blocks
        self.params = SamplingParams(max_tokens=8192, min_tokens=8192, ignore_eos=True)
        self.step_index = 0

    def table(self, index: int, num_tokens: int) -> tuple[int, ...]:
        """Request `index`'s blocks for `num_tokens` tokens (wrapping around the tier)."""
        num_blocks = -(-num_tokens // self.block_size)
        first = index * num_blocks
        return tuple((first + i) % self.num_device_blocks for i in range(num_blocks))

    def plan(self, shape: StepShape) -> StepPlan:
        context = shape.context_tokens_per_seq
        chunks = [self._decode(i, context) for i in range(shape.num_decode_seqs)]
        if shape.num_prefill_tokens:
            chunks.append(self._prefill(shape))
        device, host = self.num_device_blocks, max(self.num_host_blocks, 1)
        d2h = [
            BlockCopy(f"c{i}", CopyKind.WRITE_THROUGH, i % device, i % host)
            for i in range(shape.num_d2h_blocks)
        ]
        h2d = [
            BlockCopy(f"c{i}", CopyKind.LOAD, i % host, i % device)
            for i in range(shape.num_h2d_blocks)
        ]
        self.step_index += 1
        return StepPlan(
            step_index=self.step_index,
            chunks=tuple(chunks),
            device_to_host=tuple(d2h),
            host_to_device=tuple(h2d),
            released_request_ids=(),
        )

    def _decode(self, index: int, context_tokens: int) -> ScheduledChunk:
        return ScheduledChunk(
            request_id=f"d{index}",
            token_ids=(_TOKEN_ID,),
            start_position=context_tokens - 1,
            new_block_ids=self.table(index, context_tokens),
            block_table_start=0,
            samples_token=True,
            sampling_params=self.params,
            num_output_tokens=1,
        )

    def _prefill(self, shape: StepShape) -> ScheduledChunk:
        end = shape.prefill_start + shape.num_prefill_tokens
        return ScheduledChunk(
            request_id="p",
            token_ids=(_TOKEN_ID,) * shape.num_prefill_tokens,
            start_position=shape.prefill_start,
            new_block_ids=self.table(shape.num_decode_seqs, end),
            block_table_start=0,
            samples_token=True,
            sampling_params=self.params,
            num_output_tokens=0,
        )


def run_sweep(
    executor: SweepExecutor,
    clock: Callable[[], float],
    spec: SweepSpec,
    tiers: tuple[int, int, int],
    on_step: Callable[[], None] | None = None,
) -> list[StepSample]:
    """Time every shape of `spec` through `executor`; `tiers` = (block size, device blocks,
    host blocks).  `on_step` is called after every executed step (a progress bar)."""
    builder = _PlanBuilder(*tiers)
    samples: list[StepSample] = []
    for shape in _rounds(spec):
        for step in range(spec.warmup_steps + spec.repeats):
            plan = builder.plan(shape)
            started = clock()
            executor.execute(plan)
            duration_s = clock() - started
            if step >= spec.warmup_steps:
                samples.append(StepSample.of(shape, duration_s))
            if on_step is not None:
                on_step()
    return samples


def _rounds(spec: SweepSpec) -> Iterator[StepShape]:
    """The shapes of every round, odd rounds in reverse order."""
    shapes = spec.shapes()
    for round_index in range(spec.rounds):
        yield from (shapes if round_index % 2 == 0 else reversed(shapes))


def sweep_device_blocks(spec: SweepSpec, block_size: int) -> int:
    """Device blocks that give every request of the largest point its own blocks."""
    shapes: Sequence[StepShape] = spec.shapes()
    return max((s.num_decode_seqs + 1) * -(-s.max_tokens_per_seq // block_size) for s in shapes)
