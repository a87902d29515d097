"""A step's chunks from the residents the scheduler hands over (`update`'s half is appender.py).

Decodes come first, one token per stream, then prompt chunks: prefill-first (whole prompts, in
steps of their own) or chunked (decodes and prompt chunks share one token budget).  The builder
allocates only the prompt chunks' blocks; a decode's next block is the scheduler's to find
before it asks (`Scheduler._grow_decodes`, which retracts a victim when none is free).

Block tables cross the seam as deltas: a chunk carries only the device blocks its request's
table gained since the last plan that included it (`ScheduledChunk.new_block_ids`, from index
`block_table_start`); a table the executor forgot (`forget`) comes again whole.  The chunks'
requests are kept in chunk order (`decoding`, then `prefilling`) for `update`.
"""

from __future__ import annotations

from tokenflow.core.kv_manager import KVTierManager
from tokenflow.core.plan import ScheduledChunk
from tokenflow.core.queues import RequestQueues
from tokenflow.core.request import Request, RequestState


class ChunkBuilder:
    """Builds a step's chunks; owns what the executor knows of each block table and the
    chunks' requests in chunk order."""

    def __init__(self, kv: KVTierManager, queues: RequestQueues) -> None:
        self._kv, self._queues = kv, queues
        self._sent_blocks: dict[str, int] = {}  # leading table entries the executor knows
        self.decoding: list[Request] = []  # the last step's decode chunks' requests, in order
        self.prefilling: list[Request] = []  # its other chunks' requests, in order

    def forget(self, request_id: str) -> None:
        """The executor drops `request_id`'s table (preempted or finished): the next comes whole."""
        self._sent_blocks.pop(request_id, None)

    def residents(self) -> tuple[list[Request], list[Request]]:
        """The running residents (loads wait): (decoding, prefilling), each in running order.

        Only the residents that may not be decoding are looked at
        (`RequestQueues.maybe_prefilling`): every other one is."""
        running, state = self._queues.running, RequestState.RUNNING
        prefilling = [
            r
            for r in self._queues.maybe_prefilling.values()
            if r.state is state and r.is_prefilling
        ]
        if not prefilling:
            if not self._queues.loading:
                return list(running), []
            return [r for r in running if r.state is state], []
        is_prefilling = set(prefilling).__contains__
        decoding = [r for r in running if r.state is state and not is_prefilling(r)]
        return decoding, list(filter(is_prefilling, running))

    def prefill_first(
        self, prefilling: list[Request], max_prefill_tokens: int
    ) -> list[ScheduledChunk]:
        """A step of whole prompts (no decodes), within `max_prefill_tokens` after the first."""
        self.decoding, self.prefilling = [], []
        return self._prefill_chunks(prefilling, max_prefill_tokens, whole=True)

    def build(
        self, decoding: list[Request], prefilling: list[Request], chunk_tokens: int | None
    ) -> list[ScheduledChunk]:
        """One token for each of `decoding` (each holds the block its token needs), then, when
        `chunk_tokens` is given, prompt chunks of `prefilling` within what the decodes leave."""
        self.decoding, self.prefilling = decoding, []
        chunks = [self._decode_chunk(r) for r in decoding]
        if chunk_tokens is not None:
            chunks += self._prefill_chunks(prefilling, chunk_tokens - len(decoding), whole=False)
        return chunks

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

    def _decode_chunk(self, request: Request) -> ScheduledChunk:
        """The stream's newest token, at its position (per stream per step: keep it lean)."""
        rid = request.request_id
        table = self._kv.device_tables[rid]
        sent = self._sent_blocks.get(rid, 0)
        new_blocks: tuple[int, ...] = ()
        if len(table) != sent:
            new_blocks = tuple(table[sent:])
            self._sent_blocks[rid] = len(table)
        outputs = request.output_token_ids
        return ScheduledChunk(
            request_id=rid,
            token_ids=(outputs[-1],),
            start_position=request.num_computed_tokens,
            new_block_ids=new_blocks,
            block_table_start=sent,
            samples_token=True,
            sampling_params=request.sampling_params,
            num_output_tokens=len(outputs),
        )

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
