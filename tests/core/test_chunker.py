"""A step's chunks (`ChunkBuilder`): decodes first, prompt chunks within the budget, block
tables as deltas."""

from __future__ import annotations

from tests.core.helpers import make_request
from tokenflow.core.chunker import ChunkBuilder
from tokenflow.core.kv_manager import KVConfig, KVTierManager
from tokenflow.core.plan import ScheduledChunk
from tokenflow.core.queues import RequestQueues
from tokenflow.core.request import Request, RequestState

BLOCK = 4
CHUNK_TOKENS = 6  # the chunked steps' token budget


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


def _builder() -> tuple[ChunkBuilder, KVTierManager, RequestQueues]:
    kv = KVTierManager(KVConfig(num_device_blocks=32, num_host_blocks=32, block_size=BLOCK))
    queues = RequestQueues()
    return ChunkBuilder(kv, queues), kv, queues


def _build(builder: ChunkBuilder, chunk_tokens: int | None) -> list[ScheduledChunk]:
    """As the scheduler builds a step (its blocks already grown for the decodes)."""
    decoding, prefilling = builder.residents()
    if chunk_tokens is None and prefilling:
        return builder.prefill_first(prefilling, max_prefill_tokens=64)
    return builder.build(decoding, prefilling, chunk_tokens)


def test_prefill_first_builds_whole_prompts_and_keeps_their_requests_in_order() -> None:
    builder, kv, queues = _builder()
    _residents(kv, queues, {"a": 5, "b": 9})
    chunks = _build(builder, None)
    assert [(c.request_id, c.num_tokens, c.start_position) for c in chunks] == [
        ("a", 5, 0),
        ("b", 9, 0),
    ]
    assert [r.request_id for r in builder.prefilling] == ["a", "b"] and builder.decoding == []


def test_tables_cross_as_deltas_and_come_whole_after_forget() -> None:
    builder, kv, queues = _builder()
    _residents(kv, queues, {"a": 7})
    (first,) = _build(builder, None)
    assert first.block_table_start == 0 and len(first.new_block_ids) == 2
    request = queues.running[0]
    _decoded(request, kv, queues)  # 8 tokens: still two blocks
    (second,) = _build(builder, None)
    assert second.block_table_start == 2 and second.new_block_ids == ()
    assert [r.request_id for r in builder.decoding] == ["a"] and second.is_decode
    request.num_computed_tokens += 1
    request.append_token(8, 0.0)  # 9 tokens: the next decode needs a third block
    assert kv.allocate("a", request.num_tokens)  # (the scheduler's decode-block phase)
    (third,) = _build(builder, None)
    assert third.block_table_start == 2 and len(third.new_block_ids) == 1
    builder.forget("a")
    (again,) = _build(builder, None)
    assert again.block_table_start == 0
    assert list(again.new_block_ids) == list(kv.device_block_ids("a"))


def test_chunked_puts_decodes_first_and_prompt_chunks_within_the_budget() -> None:
    builder, kv, queues = _builder()
    _residents(kv, queues, {"a": 4, "b": 9, "d": 4, "c": 9})
    for request in queues.running:
        if request.request_id in "ad":
            _decoded(request, kv, queues)
    chunks = _build(builder, CHUNK_TOKENS)
    # two decodes in running order, then 4 of the 6-token budget to b's prompt; none for c
    assert [(c.request_id, c.num_tokens) for c in chunks] == [("a", 1), ("d", 1), ("b", 4)]
    assert [r.request_id for r in builder.decoding] == ["a", "d"]
    assert [r.request_id for r in builder.prefilling] == ["b"]
    assert [c.is_decode for c in chunks] == [True, True, False]
