"""TokenFlow's scheduler inside an in-process vLLM: same outputs, rates, aborts, bursts."""

from __future__ import annotations

import pytest
from vllm import SamplingParams

from tests_vllm.conftest import NUM_BLOCKS, close_llm, make_llm, scheduler_of

NUM_STREAMS = 8  # each needs up to 2 blocks; 6 usable blocks hold 3 at the end
MAX_TOKENS = 24


def prompts() -> list[str]:
    return [f"[{i}] Write a short story about a lighthouse keeper and" for i in range(NUM_STREAMS)]


def greedy(rate: float | None) -> SamplingParams:
    extra = None if rate is None else {"stream_rate": rate}
    return SamplingParams(
        temperature=0.0, max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS, ignore_eos=True,
        extra_args=extra,
    )  # fmt: skip


@pytest.fixture(scope="module")
def default_outputs(model_dir):
    llm = make_llm(model_dir, tokenflow=False)
    try:
        outputs = llm.generate(prompts(), greedy(None), use_tqdm=False)
    finally:
        close_llm(llm)
    return [list(o.outputs[0].token_ids) for o in outputs]


@pytest.fixture(scope="module", params=["host-kv", "recompute"])
def tokenflow_llm(request, model_dir, default_outputs):  # after the default engine is gone
    llm = make_llm(model_dir, tokenflow=True, host_kv=request.param == "host-kv")
    yield llm
    close_llm(llm)


def assert_pool_empty(llm) -> None:
    scheduler = scheduler_of(llm)
    assert scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == NUM_BLOCKS - 1
    assert not scheduler.running and not scheduler.waiting
    assert scheduler.bridge.requests == {}
    scheduler.bridge.kv.check_integrity()
    if scheduler.host_kv is not None:  # no host copy outlives its stream
        assert scheduler.host_kv.num_host_copies == 0


def num_pauses(scheduler) -> int:
    """Pauses the policy made: offloads (host KV connector) or offloads recomputed."""
    bridge = scheduler.bridge
    return bridge.num_offloads if scheduler.host_kv else bridge.num_offloads_as_recompute


def test_greedy_outputs_match_vllm_default_under_preemption(tokenflow_llm, default_outputs):
    # Readers at 0.05 tok/s: a stream's buffer covers a safe pause after its first token, so
    # the policy pauses streams for waiting ones (on top of vLLM's out-of-memory preemptions).
    # With the host KV connector, paused streams come back from host memory: identical tokens
    # show that the stored and loaded KV is the KV vLLM computed.
    scheduler = scheduler_of(tokenflow_llm)
    host_kv = scheduler.host_kv
    before, loaded_before = num_pauses(scheduler), host_kv.num_loaded_blocks if host_kv else 0
    outputs = tokenflow_llm.generate(prompts(), greedy(0.05), use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outputs] == default_outputs
    assert num_pauses(scheduler) > before, "the policy never paused a stream"
    if host_kv is not None:
        assert scheduler.bridge.num_offloads_as_recompute == 0
        assert host_kv.num_loaded_blocks > loaded_before, "no paused stream came back by load"
    assert_pool_empty(tokenflow_llm)


def test_abort_of_a_paused_stream_frees_its_kv(tokenflow_llm):
    engine = tokenflow_llm.llm_engine
    scheduler = scheduler_of(tokenflow_llm)
    ids = [  # vLLM's internal request ids
        engine.add_request(f"pause-{i}", prompt, greedy(0.05)) for i, prompt in enumerate(prompts())
    ]
    host_kv = scheduler.host_kv

    def is_paused(request) -> bool:  # by the policy: with a host copy when there is a host tier
        started = request.request_id in ids and bool(request.output_token_ids)
        return started and (host_kv is None or host_kv.host_tokens(request.request_id) > 0)

    paused = None
    for _ in range(200):
        engine.step()
        paused = next((r for r in scheduler.waiting if is_paused(r)), None)
        if paused is not None:
            break
    assert paused is not None, "no stream was paused"
    engine.abort_request([paused.request_id], internal=True)
    engine.step()
    assert paused.request_id not in scheduler.bridge.requests
    if host_kv is not None:
        assert host_kv.host_tokens(paused.request_id) == 0
    engine.abort_request(ids, internal=True)
    while engine.has_unfinished_requests():
        engine.step()
    assert_pool_empty(tokenflow_llm)


def test_burst_loses_no_request(tokenflow_llm):
    # Mixed: rated streams and requests without a rate (left to vLLM's own behaviour).
    params = [greedy(None if i % 3 == 0 else 0.5 + i) for i in range(NUM_STREAMS * 2)]
    many = [f"[{i}] Tell me about the sea and" for i in range(NUM_STREAMS * 2)]
    outputs = tokenflow_llm.generate(many, params, use_tqdm=False)
    assert len(outputs) == len(many)
    assert all(len(o.outputs[0].token_ids) == MAX_TOKENS for o in outputs)
    assert all(o.finished for o in outputs)
    assert_pool_empty(tokenflow_llm)


def test_rate_read_from_vllm_xargs_and_abort_frees_kv(tokenflow_llm):
    engine = tokenflow_llm.llm_engine
    bridge = scheduler_of(tokenflow_llm).bridge
    rated = engine.add_request("rated", {"prompt_token_ids": [1, 2, 3, 4]}, greedy(3.5))
    plain = engine.add_request("plain", {"prompt_token_ids": [5, 6, 7, 8]}, greedy(None))
    assert {r.rate_tps for r in bridge.requests.values()} == {3.5}
    assert rated in bridge.requests and plain not in bridge.requests
    for _ in range(3):  # both prefill and decode: they hold blocks now
        engine.step()
    scheduler = scheduler_of(tokenflow_llm)
    assert scheduler.kv_cache_manager.block_pool.get_num_free_blocks() < NUM_BLOCKS - 1
    engine.abort_request(["rated", "plain"])
    while engine.has_unfinished_requests():
        engine.step()
    assert_pool_empty(tokenflow_llm)
