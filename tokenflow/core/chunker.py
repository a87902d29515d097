"""A step's chunks: the per-stream half of `Scheduler.schedule` (`TokenAppender` is `update`'s).

Decodes come first, one token per stream, then prompt chunks: prefill-first (whole prompts, in
steps of their own) or chunked (decodes and prompt chunks share one token budget).  Block
tables cross the seam as deltas: a chunk carries only the device blocks its request's table
gained since the last plan that included it (`ScheduledChunk.new_block_ids`, from index
`block_table_start`); a table the executor forgot (`forget`) comes again whole.  The chunks'
requests are kept in chunk order (`decoding`, then `prefilling`) for `update`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from tokenflow.core.config import SchedulerConfig
from tokenflow.core.kv_manager import KVTierManager
from tokenflow.core.plan import ChunkCounts, ScheduledChunk
from tokenflow.core.policies.base import Policy, SchedulingView
from tokenflow.core.queues import RequestQueues
from tokenflow.core.request import Request, RequestState

# Gives a decoding stream its next block, retracting victims (and taking their chunks out of
# the list) until one is free; False if the stream itself had to go.
GrowOrRetract = Callable[[Request, list[ScheduledChunk], SchedulingView], bool]


@dataclass(slots=True)
class StepChunks:
    """A step's chunks, decodes first, and their token counts (`StepPlan.counts`)."""

    chunks: list[ScheduledChunk]
    counts: ChunkCounts


class ChunkBuilder:
    """Builds a step's chunks from the residents; keeps their requests in chunk order."""

    def __init__(
        self,
        kv: KVTierManager,
        queues: RequestQueues,
        config: SchedulerConfig,
        policy: Policy,
        grow_or_retract: GrowOrRetract,
    ) -> None:
        self._kv, self._queues, self._config, self._policy = kv, queues, config, policy
        self._grow_or_retract = grow_or_retract
        self._sent_blocks: dict[str, int] = {}  # leading table entries the executor knows
        self.decoding: list[Request] = []  # the last step's decode chunks' requests, in order
        self.prefilling: list[Request] = []  # its other chunks' requests, in order

    def forget(self, request_id: str) -> None:
        """The executor drops `request_id`'s table (preempted or finished): the next comes whole."""
        self._sent_blocks.pop(request_id, None)

    def build(self, view: SchedulingView, chunk_tokens: int | None) -> StepChunks:
        """Prefill-first (`chunk_tokens` None: whole prompts) or chunked (decodes and prefill
        chunks within `chunk_tokens`): the chunks, decodes first, and their counts.  Leaves
        the chunks' requests, in the same order, in `decoding` and `prefilling`."""
        decoding, prefills = self._split_residents()
        self.decoding, self.prefilling = [], []
        if chunk_tokens is None and prefills:
            chunks = self._prefill_chunks(prefills, self._config.max_prefill_tokens, whole=True)
            return StepChunks(chunks, ChunkCounts.of(chunks))
        decodes, context = self._decode_chunks(decoding, view)
        if chunk_tokens is None:
            return StepChunks(decodes, ChunkCounts(0, len(decodes), context))
        prefills = [r for r in prefills if r.state is RequestState.RUNNING]  # (retractions)
        chunks = self._prefill_chunks(prefills, chunk_tokens - len(decodes), whole=False)
        odd = ChunkCounts.of(chunks)  # (a one-token chunk of a recompute counts as a decode)
        counts = ChunkCounts(
            odd.num_prefill_tokens,
            len(decodes) + odd.num_decode_tokens,
            context + odd.num_decode_context_tokens,
        )
        return StepChunks(decodes + chunks, counts)

    def _split_residents(self) -> tuple[list[Request], list[Request]]:
        """(Decoding residents, prefilling ones), each in running order.  Only the unsettled
        residents are looked at: every other one is decoding (`RequestQueues.unsettled`), and
        so is every unsettled one but the loads and the running ones still prefilling."""
        running, state = self._queues.running, RequestState.RUNNING
        prefilling = [
            r
            for r in self._queues.unsettled.values()
            if r.state is state
            and not (r.output_token_ids and r.num_computed_tokens >= r.num_tokens - 1)
        ]
        if not prefilling:
            if not self._queues.loading:
                return list(running), []
            return [r for r in running if r.state is state], []  # (residents load or run)
        odd = set(prefilling)
        decodes = [r for r in running if r.state is state and r not in odd]
        return decodes, list(filter(odd.__contains__, running))

    def _prefill_chunks(
        self, prefills: list[Request], budget: int, whole: bool
    ) -> list[ScheduledChunk]:
        chunks: list[ScheduledChunk] = []
        for request in prefills:
            remaining = request.num_tokens - request.num_computed_tokens
            if whole and chunks and remaining > budget:
                break
            count = remaining if whole else min(remaining, budget)
            if count <= 0:
                break
            if not self._kv.allocate(request.request_id, request.num_computed_tokens + count):
                break
            chunks.append(self._chunk(request, count))
            self.prefilling.append(request)
            budget -= count
        return chunks

    def _decode_chunks(
        self, decodes: list[Request], view: SchedulingView
    ) -> tuple[list[ScheduledChunk], int]:
        """One token per stream; when a block cannot be had, retract a victim and retry.
        Returns the chunks (their requests left in `decoding`) and their context tokens."""
        chunks: list[ScheduledChunk] = []
        tables, block_size, no_table = self._kv.device_tables, self._kv.block_size, ()
        sent_blocks, make, add = self._sent_blocks, ScheduledChunk, chunks.append
        starts = 0  # the chunks' start positions, summed
        retracted = False
        for request in decodes:
            rid = request.request_id
            table = tables.get(rid, no_table)
            num_blocks = len(table)
            if request.num_tokens > num_blocks * block_size:
                num_chunks = len(chunks)
                grown = self._grow_or_retract(request, chunks, view)
                if len(chunks) != num_chunks:  # victims' chunks were taken out: sum again
                    starts = sum(c.start_position for c in chunks)
                if not grown:
                    retracted = True
                    continue
                retracted |= len(chunks) != num_chunks
                table = tables[rid]
                num_blocks = len(table)
            sent = sent_blocks.get(rid, 0)
            new_blocks: tuple[int, ...] = ()
            if num_blocks != sent:
                new_blocks = tuple(table[sent:])
                sent_blocks[rid] = num_blocks
            outputs, start = request.output_token_ids, request.num_computed_tokens
            add(
                make(
                    rid,
                    (outputs[-1],),
                    start,
                    new_blocks,
                    sent,
                    True,
                    request.sampling_params,
                    len(outputs),
                )
            )
            starts += start
        # Every stream that had to go (itself or as a victim) is off the device now.
        running = RequestState.RUNNING
        self.decoding = [r for r in decodes if r.state is running] if retracted else decodes
        return chunks, starts + len(chunks)

    def _chunk(self, request: Request, count: int) -> ScheduledChunk:
        rid, start = request.request_id, request.num_computed_tokens
        table, sent = self._kv.device_tables.get(rid, ()), self._sent_blocks.get(rid, 0)
        self._sent_blocks[rid] = len(table)
        return ScheduledChunk(
            request_id=rid,
            token_ids=request.token_ids_from(start, count),
            start_position=start,
            new_block_ids=tuple(table[sent:]),
            block_table_start=sent,
            samples_token=start + count == request.num_tokens,
            sampling_params=request.sampling_params,
            num_output_tokens=len(request.output_token_ids),
        )
