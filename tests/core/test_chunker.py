"""A step's chunks (`ChunkBuilder`): decodes first, block tables as deltas, retractions."""

from __future__ import annotations

from tests.core.helpers import make_request
from tokenflow.core.chunker import ChunkBuilder
from tokenflow.core.config import SchedulerConfig
from tokenflow.core.kv_manager import KVConfig, KVTierManager
from tokenflow.core.plan import ScheduledChunk
from tokenflow.core.policies.base import Policy, SchedulingView
from tokenflow.core.queues import RequestQueues
from tokenflow.core.request import Request, RequestState

BLOCK = 4
CHUNK_TOKENS = 6  # the chunked steps' token budget


class _Chunked(Policy):
    prefill_chunk_tokens = 6


def _residents(kv: KVTierManager, queues: RequestQueues, prompts: dict[str, int]) -> None:
    for rid, num_prompt in prompts.items():
        request = make_request(rid, num_prompt=num_prompt, max_tokens=20)
        queues.add_waiting(request)
        assert kv.allocate(rid, request.num_tokens)
        queues.enter_device(request, RequestState.RUNNING)


def _decoded(request: Request, kv: KVTierManager, queues: RequestQueues) -> None:
    """As `update` leaves a request whose prompt was computed and whose first token came."""
    request.num_computed_tokens = request.num_tokens
    request.append_token(7, 0.0)
    queues.token_appended(request)
    assert kv.allocate(request.request_id, request.num_tokens)


def _builder(policy: Policy, grow=None) -> tuple[ChunkBuilder, KVTierManager, RequestQueues]:
    kv = KVTierManager(KVConfig(num_device_blocks=32, num_host_blocks=32, block_size=BLOCK))
    queues = RequestQueues()
    config = SchedulerConfig(max_prefill_tokens=64)

    def grow_or_retract(request: Request, chunks: list[ScheduledChunk], view) -> bool:
        return kv.allocate(request.request_id, request.num_tokens)

    return ChunkBuilder(kv, queues, config, policy, grow or grow_or_retract), kv, queues


def _view() -> SchedulingView:
    return None  # type: ignore[return-value]  (only a retraction reads it)


def test_prefill_first_builds_whole_prompts_and_keeps_their_requests_in_order() -> None:
    builder, kv, queues = _builder(Policy())
    _residents(kv, queues, {"a": 5, "b": 9})
    built = builder.build(_view(), None)
    chunks, counts = built.chunks, built.counts
    assert [(c.request_id, c.num_tokens, c.start_position) for c in chunks] == [
        ("a", 5, 0),
        ("b", 9, 0),
    ]
    assert [r.request_id for r in builder.prefilling] == ["a", "b"] and builder.decoding == []
    assert counts.num_prefill_tokens == 14 and counts.num_decode_tokens == 0


def test_tables_cross_as_deltas_and_come_whole_after_forget() -> None:
    builder, kv, queues = _builder(Policy())
    _residents(kv, queues, {"a": 7})
    (first,) = builder.build(_view(), None).chunks
    assert first.block_table_start == 0 and len(first.new_block_ids) == 2
    request = queues.running[0]
    _decoded(request, kv, queues)  # 8 tokens: still two blocks
    built = builder.build(_view(), None)
    (second,), counts = built.chunks, built.counts
    assert second.block_table_start == 2 and second.new_block_ids == ()
    assert [r.request_id for r in builder.decoding] == ["a"] and counts.num_decode_tokens == 1
    request.num_computed_tokens += 1
    request.append_token(8, 0.0)  # 9 tokens: the next decode needs a third block
    (third,) = builder.build(_view(), None).chunks
    assert third.block_table_start == 2 and len(third.new_block_ids) == 1
    builder.forget("a")
    (again,) = builder.build(_view(), None).chunks
    assert again.block_table_start == 0
    assert list(again.new_block_ids) == list(kv.device_block_ids("a"))


def test_chunked_puts_decodes_first_and_prompt_chunks_within_the_budget() -> None:
    builder, kv, queues = _builder(_Chunked())
    _residents(kv, queues, {"a": 4, "b": 9, "d": 4, "c": 9})
    for request in queues.running:
        if request.request_id in "ad":
            _decoded(request, kv, queues)
    built = builder.build(_view(), CHUNK_TOKENS)
    chunks, counts = built.chunks, built.counts
    # two decodes in running order, then 4 of the 6-token budget to b's prompt; none for c
    assert [(c.request_id, c.num_tokens) for c in chunks] == [("a", 1), ("d", 1), ("b", 4)]
    assert [r.request_id for r in builder.decoding] == ["a", "d"]
    assert [r.request_id for r in builder.prefilling] == ["b"]
    assert counts.num_decode_tokens == 2 and counts.num_prefill_tokens == 4


def test_a_stream_that_finds_no_block_and_goes_leaves_no_chunk() -> None:
    def retract(request: Request, chunks: list[ScheduledChunk], view) -> bool:
        queues.pause(request)  # the scheduler preempts it: off the device
        return False

    builder, kv, queues = _builder(Policy(), grow=retract)
    _residents(kv, queues, {"a": 8, "b": 4})
    a, b = queues.running
    _decoded(b, kv, queues)
    a.num_computed_tokens = a.num_tokens
    a.append_token(7, 0.0)  # 9 tokens: its decode needs a block it will not get
    queues.token_appended(a)
    chunks = builder.build(_view(), None).chunks
    assert [c.request_id for c in chunks] == ["b"]
    assert [r.request_id for r in builder.decoding] == ["b"]
