import asyncio

import pytest

from tokenflow.engine.client import GenerationDelta, RequestFailed
from tokenflow.engine.commands import DeltaSink


def delta(token_id: int, finish_reason: str | None = None) -> GenerationDelta:
    return GenerationDelta("r", (token_id,), str(token_id), 3, token_id, finish_reason)


def test_a_slow_reader_gets_the_pending_deltas_merged_then_the_error():
    async def read() -> None:
        sink = DeltaSink()
        sink.put(delta(1))
        sink.put(delta(2))
        sink.put(RequestFailed("gone"))
        merged = await sink.get()
        assert merged.token_ids == (1, 2) and merged.text == "12"
        assert merged.num_output_tokens == 2  # (the counts are the later delta's)
        with pytest.raises(RequestFailed):
            await sink.get()

    asyncio.run(read())


def test_the_reader_waits_until_the_next_delta_arrives():
    async def read() -> None:
        sink = DeltaSink()
        sink.put(delta(1))
        assert (await sink.get()).token_ids == (1,)
        waiting = asyncio.ensure_future(sink.get())
        await asyncio.sleep(0)
        assert not waiting.done()
        sink.put(delta(2, "stop"))
        assert (await waiting).finish_reason == "stop"

    asyncio.run(read())
