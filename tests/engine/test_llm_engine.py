"""`LLMEngine` on the tiny model: a request's session hint reaches the core `Request`, and the
prefix cache's counters and cached blocks per tier reach `stats()` and the streams snapshot."""

from __future__ import annotations

import pytest

from tokenflow.core.request import Request, SamplingParams
from tokenflow.engine.engine_args import EngineArgs
from tokenflow.engine.llm_engine import LLMEngine
from tokenflow.llm import LLM

PARAMS = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
PROMPT = list(range(100, 148))  # three full blocks of 16


@pytest.fixture
def engine(tiny_model_dir) -> LLMEngine:
    args = EngineArgs(model=tiny_model_dir, device="cpu", max_model_len=256, policy="fcfs")
    return LLMEngine(args)


def run(engine: LLMEngine) -> None:
    while engine.has_work:
        engine.step()


def test_add_request_gives_the_core_request_its_session_key(engine):
    engine.add_request("keyed", PROMPT, PARAMS, session_key="conversation-1")
    engine.add_request("plain", PROMPT, PARAMS)
    requests = engine.scheduler.requests
    assert requests["keyed"].session_key == "conversation-1"
    assert requests["plain"].session_key is None
    run(engine)


def test_stats_and_the_snapshot_report_the_prefix_cache_per_tier(engine):
    for request_id in ("first", "second"):  # the second finds the first's full blocks
        engine.add_request(request_id, PROMPT, PARAMS)
        run(engine)
    scheduler = engine.scheduler
    scheduler.num_prefix_host_hit_tokens = 16  # (the host tier's cache is not built yet)
    stats = engine.stats()
    assert stats.prefix_cache_queries_total == scheduler.num_prefix_queried_tokens > 0
    assert stats.prefix_cache_hits_total == scheduler.num_prefix_hit_tokens > 0
    assert stats.prefix_cache_host_hits_total == 16
    assert stats.num_cached_device_blocks == scheduler.kv.num_cached_device_blocks >= 2
    assert stats.num_cached_host_blocks == scheduler.kv.num_cached_host_blocks
    snapshot = engine.streams(limit=8)
    assert snapshot.num_cached_device_blocks == stats.num_cached_device_blocks
    assert snapshot.num_cached_host_blocks == stats.num_cached_host_blocks
    assert snapshot.num_prefix_queried_tokens == stats.prefix_cache_queries_total
    assert snapshot.num_prefix_hit_tokens == stats.prefix_cache_hits_total
    assert snapshot.num_prefix_host_hit_tokens == 16


def test_the_offline_api_passes_the_session_key(tiny_model_dir):
    llm = LLM(tiny_model_dir, device="cpu", max_model_len=256)
    keys: list[str | None] = []
    add = llm.engine.core.add_request

    def recording(request: Request) -> None:
        keys.append(request.session_key)
        add(request)

    llm.engine.core.add_request = recording  # type: ignore[method-assign]
    llm.generate([PROMPT, PROMPT[:20]], PARAMS, session_key="batch-7")
    llm.generate(PROMPT, PARAMS)
    assert keys == ["batch-7", "batch-7", None]
