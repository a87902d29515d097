"""The pure parts of the integration (no vLLM engine): bridge, settings, middleware, launcher."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field

import pytest

from tokenflow.core.config import SchedulerConfig, TokenFlowConfig, tokenflow_defaults
from tokenflow.core.policies import make_policy
from tokenflow.core.policies.pricing import Prices, is_pausable, recompute_price_s, unsynced_blocks
from tokenflow.core.request import RequestState
from tokenflow.integrations.vllm.bridge import OTHER_OWNER, PolicyBridge, PoolShape, PoolState
from tokenflow.integrations.vllm.middleware import move_stream_rate
from tokenflow.integrations.vllm.serve import (
    MIDDLEWARE,
    SCHEDULER_CLS,
    connector_args,
    host_kv_transfer_config,
    offloading_transfer_config,
    vllm_offloads_here,
    vllm_server_args,
)
from tokenflow.integrations.vllm.settings import IntegrationSettings


@dataclass
class FakeRequest:
    request_id: str
    prompt_token_ids: list[int] = field(default_factory=lambda: [1] * 20)
    num_computed_tokens: int = 0
    max_tokens: int = 40
    num_preemptions: int = 0
    output_token_ids: list[int] = field(default_factory=list)


def make_bridge(
    default_rate: float | None = None,
    offload_block_bytes: int | None = None,
    vllm_pool: bool = False,
) -> PolicyBridge:
    """A bridge over 10 device blocks of 16 tokens and 20 host blocks: virtual (no connector),
    the host KV connector's (`offload_block_bytes`), or vLLM's offloading pool (`vllm_pool`)."""
    config = SchedulerConfig(max_num_seqs=8)
    policy = make_policy("tokenflow", config, TokenFlowConfig())
    shape = PoolShape(
        num_device_blocks=10,
        block_size=16,
        host_factor=2.0,
        recompute_block_s=0.01,
        offload_block_bytes=offload_block_bytes,
        write_through=vllm_pool,
        copies_may_be_evicted=vllm_pool,
    )
    return PolicyBridge(policy, config, shape, default_rate)


def test_rate_from_extra_args_else_default():
    bridge = make_bridge(default_rate=7.0)
    assert bridge.rate_of({"stream_rate": 2.5}) == 2.5
    assert bridge.rate_of({"stream_rate": "3"}) == 3.0
    assert bridge.rate_of(None) == 7.0
    for bad in ("fast", -1, 0, float("inf"), float("nan"), 1e-309, 5000):
        assert bridge.rate_of({"stream_rate": bad}) == 7.0
    assert make_bridge().rate_of({}) is None  # no default: vLLM's own behaviour


def test_view_mirrors_queues_tokens_and_free_blocks():
    bridge = make_bridge()
    running = FakeRequest("a", num_computed_tokens=21, output_token_ids=[5, 6])
    resumed = FakeRequest("b", num_preemptions=1, output_token_ids=[7])
    waiting = FakeRequest("c")
    unrated = FakeRequest("d")  # never tracked: its blocks are charged to the placeholder
    for i, request in enumerate((running, resumed, waiting)):
        bridge.track(request, rate_tps=2.0, now_s=float(i))
    view = bridge.view([running, unrated], [resumed, waiting], PoolState(4, {"a": 2}), now_s=5.0)
    assert [r.request_id for r in view.running] == ["a"]
    assert [r.request_id for r in view.preempted] == ["b"]
    assert [r.request_id for r in view.waiting] == ["c"]
    mirror = bridge.requests["a"]
    assert mirror.output_token_ids == [5, 6] and mirror.token_times_s == [5.0, 5.0]
    assert mirror.state is RequestState.RUNNING and mirror.num_computed_tokens == 21
    assert view.kv.num_free_device_blocks == 4  # = vLLM's free blocks
    assert view.kv.num_device_blocks_of("a") == 2
    assert view.kv.num_device_blocks_of(OTHER_OWNER) == 4
    view.kv.check_integrity()


def test_preemption_and_finish_release_mirror_blocks():
    bridge = make_bridge()
    request = FakeRequest("a", num_computed_tokens=30, output_token_ids=[1] * 10)
    bridge.track(request, 1.0, 0.0)
    bridge.view([request], [], PoolState(8, {"a": 2}), now_s=1.0)
    bridge.preempted("a")
    assert bridge.kv.num_device_blocks_of("a") == 0
    assert bridge.requests["a"].state is RequestState.PREEMPTED
    view = bridge.view([], [request], PoolState(10, {}), now_s=2.0)
    assert [r.request_id for r in view.preempted] == ["a"]
    bridge.forget("a")
    assert bridge.requests == {} and bridge.kv.num_free_device_blocks == 10
    bridge.kv.check_integrity()


def test_policy_pauses_a_full_buffer_for_a_waiting_stream():
    # One slow reader far ahead holds the whole pool; a newcomer waits: the core policy (not a
    # copy of it) preempts the reader and starts the newcomer, by recompute (no host copy).
    bridge = make_bridge()
    ahead = FakeRequest("ahead", num_computed_tokens=139, output_token_ids=[1] * 120,
                        prompt_token_ids=[1] * 20, max_tokens=140)  # fmt: skip
    bridge.track(ahead, rate_tps=1.0, now_s=0.0)
    bridge.view([ahead], [], PoolState(1, {"ahead": 9}), now_s=0.0)  # 120 tokens at t=0
    newcomer = FakeRequest("new")
    bridge.track(newcomer, rate_tps=1.0, now_s=1.0)
    view = bridge.view([ahead], [newcomer], PoolState(1, {"ahead": 9}), now_s=1.0)
    moves = bridge.plan(view)
    assert [p.request_id for p in moves.preemptions] == ["ahead"]
    assert [(s.request_id, s.by_load) for s in moves.starts] == [("new", False)]


def test_reserve_decays_each_plan_and_resets_when_vllm_runs_out_of_memory():
    bridge = make_bridge()  # SGLang's reserve: from 0.7 to 0.1 in 600 steps
    request = FakeRequest("a", num_computed_tokens=21, output_token_ids=[5, 6])
    bridge.track(request, rate_tps=10.0, now_s=0.0)
    view = bridge.view([request], [], PoolState(8, {"a": 2}), now_s=1.0)
    assert view.new_token_ratio == 0.7
    assert view.num_reserved_blocks == 2  # 0.7 x 38 output tokens left = 26 tokens: 2 blocks
    bridge.plan(view)
    bridge.plan(view)
    assert bridge.reserve.value == pytest.approx(0.7 - 2 * 0.6 / 600)
    bridge.out_of_memory()
    assert bridge.reserve.value == 0.7


def test_settings_from_additional_config():
    settings = IntegrationSettings.from_additional_config(
        {"tokenflow": {"default_rate": 5, "host_factor": 1, "policy": {"critical_slack_s": 1.0}}}
    )
    assert settings.default_rate_tps == 5.0 and settings.host_factor == 1.0
    assert settings.policy_config("cuda").critical_slack_s == 1.0  # the override wins
    defaults = IntegrationSettings()
    assert defaults.policy_config("cpu") == tokenflow_defaults("cpu")  # every command's
    assert defaults.policy_config("cuda") == tokenflow_defaults("cuda")
    assert defaults.policy_config("cpu") != defaults.policy_config("cuda")
    assert IntegrationSettings.from_additional_config({}).default_rate_tps is None
    with pytest.raises(ValueError, match="unknown"):
        IntegrationSettings.from_additional_config({"tokenflow": {"rate": 1}})
    with pytest.raises(ValueError, match="overrides"):
        IntegrationSettings.from_additional_config({"tokenflow": {"policy": {"nope": 1}}})
    with pytest.raises(ValueError):
        IntegrationSettings(default_rate_tps=-1.0)
    reserve = IntegrationSettings().core_config(
        max_num_seqs=4, max_prefill_tokens=64, max_model_len=9
    )
    assert reserve.init_new_token_ratio == reserve.min_new_token_ratio == 0.01  # vLLM-like
    assert reserve.max_num_seqs == 4
    custom = IntegrationSettings.from_additional_config(
        {"tokenflow": {"scheduler": {"init_new_token_ratio": 0.7}}}
    ).core_config(max_num_seqs=4, max_prefill_tokens=64, max_model_len=9)
    assert (custom.init_new_token_ratio, custom.min_new_token_ratio) == (0.7, 0.01)
    with pytest.raises(ValueError, match="scheduler overrides"):
        IntegrationSettings.from_additional_config(
            {"tokenflow": {"scheduler": {"max_num_seqs": 1}}}
        )


def test_middleware_moves_stream_rate_into_vllm_xargs():
    moved = json.loads(move_stream_rate(b'{"prompt": "x", "stream_rate": 4}'))
    assert moved == {"prompt": "x", "vllm_xargs": {"stream_rate": 4}}
    both = json.loads(move_stream_rate(b'{"stream_rate": 4, "vllm_xargs": {"stream_rate": 2}}'))
    assert both == {"vllm_xargs": {"stream_rate": 2}}  # the explicit vLLM field wins
    for body in (b'{"prompt": "x"}', b"not json", b'["stream_rate"]'):
        assert move_stream_rate(body) == body


def test_launcher_arguments():
    args = vllm_server_args(["--model", "m", "--default-rate", "3", "--port", "1"])
    assert args[:4] == ["--scheduler-cls", SCHEDULER_CLS, "--middleware", MIDDLEWARE]
    assert args[4:8] == ["--model", "m", "--port", "1"]
    assert json.loads(args[args.index("--additional-config") + 1]) == {
        "tokenflow": {"default_rate": 3.0}
    }
    merged = vllm_server_args(["--additional-config", '{"x": 1}', "--default-rate", "2"])
    assert json.loads(merged[-1]) == {"x": 1, "tokenflow": {"default_rate": 2.0}}
    assert "--additional-config" not in vllm_server_args(["--model", "m"])


def test_launcher_adds_the_host_kv_connector_unless_told_otherwise():
    args = vllm_server_args(["--model", "m"])
    assert json.loads(args[args.index("--kv-transfer-config") + 1]) == host_kv_transfer_config()
    assert "--kv-transfer-config" not in vllm_server_args(["--model", "m", "--no-host-kv"])
    own = vllm_server_args(["--kv-offloading-size", "4"])
    assert "--kv-transfer-config" not in own and own[-2:] == ["--kv-offloading-size", "4"]
    given = vllm_server_args(["--kv-transfer-config={}"])
    assert given.count("--kv-transfer-config={}") == 1 and "--kv-transfer-config" not in given


def test_launcher_picks_vllms_offloading_connector_where_it_runs():
    args = vllm_server_args(["--model", "m"], vllm_offloads=True)
    assert json.loads(args[args.index("--kv-transfer-config") + 1]) == offloading_transfer_config()
    assert offloading_transfer_config()["kv_connector_extra_config"] == {
        "offload_prompt_only": False  # vLLM's default (true) would store prompt blocks only
    }
    assert args[args.index("--kv-offloading-size") + 1] == "16.0"
    assert "--enable-prefix-caching" in args
    sized = vllm_server_args(["--kv-offloading-size=64", "--no-enable-prefix-caching"], True)
    assert "--kv-offloading-size" not in sized and "--kv-offloading-size=64" in sized
    assert "--enable-prefix-caching" not in sized and "--kv-transfer-config" in sized
    for own in (["--kv-transfer-config", "{}"], ["--kv-offloading-backend", "lmcache"]):
        assert connector_args(own, vllm_offloads=True) == []  # the user's connector
    assert "--kv-transfer-config" not in vllm_server_args(["--no-host-kv"], vllm_offloads=True)
    cpu = vllm_server_args(["--model", "m"], vllm_offloads=False)
    assert json.loads(cpu[cpu.index("--kv-transfer-config") + 1]) == host_kv_transfer_config()


@dataclass
class FakePlatform:
    cuda_alike: bool = False
    xpu: bool = False

    def is_cuda_alike(self) -> bool:
        return self.cuda_alike

    def is_xpu(self) -> bool:
        return self.xpu


def test_vllm_offloads_on_cuda_alike_and_xpu_platforms_only():
    assert vllm_offloads_here(FakePlatform(cuda_alike=True))
    assert vllm_offloads_here(FakePlatform(xpu=True))
    assert not vllm_offloads_here(FakePlatform())
    assert not vllm_offloads_here()  # this machine: vLLM's CPU platform


def test_offloaded_pause_resumes_by_load_then_the_host_copy_goes():
    bridge = make_bridge(offload_block_bytes=4096)
    request = FakeRequest("a", num_computed_tokens=30, output_token_ids=[1] * 10)
    bridge.track(request, 1.0, 0.0)
    bridge.view([request], [], PoolState(8, {"a": 2}), now_s=1.0)
    bridge.preempted("a", num_offloaded_tokens=30)
    assert bridge.num_offloads == 1 and bridge.kv.has_host_copy("a", 30)
    assert bridge.kv.num_device_blocks_of("a") == 0 and bridge.kv.config.block_bytes == 4096
    view = bridge.view([], [request], PoolState(10, {}), now_s=2.0)
    assert view.kv.num_free_device_blocks == 10
    assert view.preempted[0].num_computed_tokens == 30  # resumes from its host copy
    assert view.start_for(view.preempted[0]).by_load
    view.kv.check_integrity()
    bridge.view([request], [], PoolState(8, {"a": 2}), now_s=3.0)  # resumed: copy released
    assert bridge.kv.synced_tokens("a") == 0 and bridge.kv.num_free_host_blocks == 20
    bridge.kv.check_integrity()


def test_discarded_host_copy_means_recompute():
    bridge = make_bridge(offload_block_bytes=4096)
    request = FakeRequest("a", num_computed_tokens=30, output_token_ids=[1] * 10)
    bridge.track(request, 1.0, 0.0)
    bridge.view([request], [], PoolState(8, {"a": 2}), now_s=1.0)
    bridge.preempted("a", num_offloaded_tokens=30)
    bridge.discarded("a")
    view = bridge.view([], [request], PoolState(10, {}), now_s=2.0)
    assert not view.start_for(view.preempted[0]).by_load
    assert bridge.kv.num_free_host_blocks == 20
    bridge.forget("a")
    bridge.kv.check_integrity()


def test_offload_prices_pauses_at_the_copy_not_the_recompute():
    bridge = make_bridge(offload_block_bytes=4096)
    for _ in range(8):
        bridge.observe_step(num_decode=1, num_prefill_tokens=64, duration_s=1.0)
    bridge.view([], [], PoolState(10, {}), now_s=0.0)
    assert bridge.kv.config.block_bytes == 4096


def test_pause_is_priced_at_the_measured_recompute():
    bridge = make_bridge()
    cheap = bridge.kv.config.block_bytes
    for _ in range(8):  # prefills of 64 tokens that take 1 s beside a decode step
        bridge.observe_step(num_decode=1, num_prefill_tokens=64, duration_s=1.0)
    bridge.view([], [], PoolState(10, {}), now_s=0.0)
    seconds_per_block = bridge.kv.config.block_bytes / bridge.config.link_bytes_per_s
    assert bridge.kv.config.block_bytes > 10 * cheap
    per_block_s = bridge.estimator.prefill_time_s(64) / 4  # 64-token prefills: 4 blocks of 16
    assert seconds_per_block == pytest.approx(per_block_s / 2, rel=0.01)


def _paused_in_the_pool(bridge: PolicyBridge, held_tokens: int) -> FakeRequest:
    """A stream of 30 computed tokens that ran (its full block written through), then was
    paused with `held_tokens` in vLLM's offloading pool."""
    request = FakeRequest("a", num_computed_tokens=30, output_token_ids=[1] * 10)
    bridge.track(request, 1.0, 0.0)
    bridge.view([request], [], PoolState(8, {"a": 2}), now_s=1.0)
    bridge.preempted("a", num_offloaded_tokens=held_tokens)
    request.num_computed_tokens, request.num_preemptions = 0, 1
    return request


def test_vllm_pool_writes_running_streams_through_so_a_pause_costs_its_tail():
    pool = make_bridge(vllm_pool=True, offload_block_bytes=4096)
    host_kv = make_bridge(offload_block_bytes=4096)
    for bridge in (pool, host_kv):
        request = FakeRequest("a", num_computed_tokens=30, output_token_ids=[1] * 10)
        bridge.track(request, 1.0, 0.0)
        bridge.view([request], [], PoolState(8, {"a": 2}), now_s=1.0)
    assert pool.kv.synced_tokens("a") == 16  # its one full block is on the host already
    assert unsynced_blocks(pool.kv, pool.requests["a"]) == 1
    assert host_kv.kv.synced_tokens("a") == 0  # the host KV connector stores on the pause
    assert unsynced_blocks(host_kv.kv, host_kv.requests["a"]) == 2
    pool.kv.check_integrity()


def test_a_paused_copy_the_pool_still_holds_resumes_by_load():
    bridge = make_bridge(vllm_pool=True, offload_block_bytes=4096)
    request = _paused_in_the_pool(bridge, held_tokens=16)
    assert bridge.paused_copy_ids == ["a"] and bridge.num_offloads == 1
    view = bridge.view([], [request], PoolState(10, {}, {"a": 16}), now_s=2.0)
    assert view.preempted[0].num_computed_tokens == 16  # the tail is recomputed
    assert view.start_for(view.preempted[0]).by_load
    load_s = Prices.at(TokenFlowConfig(), view).resume_s["a"]
    assert load_s < recompute_price_s(view.estimator, view.preempted[0])
    assert bridge.num_copies_lost == 0
    view.kv.check_integrity()


def test_a_paused_copy_the_pool_evicted_is_priced_as_a_recompute():
    bridge = make_bridge(vllm_pool=True, offload_block_bytes=4096)
    request = _paused_in_the_pool(bridge, held_tokens=16)
    view = bridge.view([], [request], PoolState(10, {}, {"a": 0}), now_s=2.0)  # LRU evicted it
    paused = view.preempted[0]
    assert not view.start_for(paused).by_load and paused.num_computed_tokens == 0
    assert Prices.at(TokenFlowConfig(), view).resume_s["a"] == recompute_price_s(
        view.estimator, paused
    )
    assert bridge.num_copies_lost == 1 and bridge.paused_copy_ids == []
    assert bridge.kv.num_free_host_blocks == 20
    view.kv.check_integrity()


def test_a_pause_the_pool_holds_nothing_of_is_a_recompute_and_drops_the_written_copy():
    bridge = make_bridge(vllm_pool=True, offload_block_bytes=4096)
    _paused_in_the_pool(bridge, held_tokens=0)  # e.g. the pool had no room for its stores
    assert bridge.num_offloads == 0 and bridge.paused_copy_ids == []
    assert bridge.kv.synced_tokens("a") == 0 and bridge.kv.num_free_host_blocks == 20
    bridge.kv.check_integrity()


def _sharing_a_prefix(bridge: PolicyBridge) -> tuple[FakeRequest, FakeRequest]:
    """Two streams of 64 computed tokens (4 blocks each) whose first 3 blocks vLLM's prefix
    cache shares: 5 blocks in use, each stream holding 1 of them alone."""
    prompt = [1] * 60
    a = FakeRequest("a", prompt, num_computed_tokens=64, output_token_ids=[1] * 10)
    b = FakeRequest("b", prompt, num_computed_tokens=64, output_token_ids=[2] * 10)
    for request in (a, b):
        bridge.track(request, 1.0, 0.0)
    return a, b


def test_blocks_shared_through_the_prefix_cache_are_the_placeholders():
    bridge = make_bridge(offload_block_bytes=4096)
    a, b = _sharing_a_prefix(bridge)
    view = bridge.view([a, b], [], PoolState(5, {"a": 1, "b": 1}), now_s=1.0)
    assert view.kv.num_free_device_blocks == 5  # = vLLM's, each shared block counted once
    assert view.kv.num_device_blocks_of("a") == view.kv.num_device_blocks_of("b") == 1
    assert view.kv.num_device_blocks_of(OTHER_OWNER) == 3
    view.kv.check_integrity()


def test_a_paused_sharer_offloads_its_whole_computed_kv():
    # The host KV connector stores all 4 blocks of the paused stream, the shared ones too: the
    # mirror's copy covers them although the stream held one block alone (and none was free).
    bridge = make_bridge(offload_block_bytes=4096)
    a, b = _sharing_a_prefix(bridge)
    bridge.view([a, b], [], PoolState(0, {"a": 1, "b": 1}), now_s=1.0)
    bridge.preempted("a", num_offloaded_tokens=64)
    assert bridge.num_offloads == 1 and bridge.kv.has_host_copy("a", 64)
    assert bridge.kv.num_device_blocks_of("a") == 0
    view = bridge.view([b], [a], PoolState(1, {"b": 4}), now_s=2.0)  # b alone holds the prefix
    assert view.kv.num_free_device_blocks == 1 and view.start_for(view.preempted[0]).by_load
    view.kv.check_integrity()


def test_vllm_pool_writes_through_only_the_blocks_a_sharer_holds_alone():
    bridge = make_bridge(vllm_pool=True, offload_block_bytes=4096)
    a, b = _sharing_a_prefix(bridge)
    view = bridge.view([a, b], [], PoolState(5, {"a": 1, "b": 1}), now_s=1.0)
    assert bridge.kv.synced_tokens("a") == bridge.kv.synced_tokens("b") == 16
    assert unsynced_blocks(view.kv, bridge.requests["a"]) == 3  # priced as the larger pause
    view.kv.check_integrity()


def _random_run_bridge(offload: str) -> PolicyBridge:
    config = SchedulerConfig(max_num_seqs=8)
    is_pool = offload == "pool"
    shape = PoolShape(
        48,
        16,
        2.0,
        0.01,
        offload_block_bytes=None if offload == "none" else 4096,
        write_through=is_pool,
        copies_may_be_evicted=is_pool,
    )
    return PolicyBridge(make_policy("tokenflow", config, TokenFlowConfig()), config, shape)


def _views_of_a_random_run(seed: int, offload: str, num_steps: int = 120):
    """Bridge views of a random run: 14 streams read at 1-8 tok/s from a slow engine, some
    prefilling in chunks, decoding, paused (offloaded or not), resumed and finished, in a pool
    of 48 blocks; `offload`: "none", "host_kv", or "pool" (vLLM's, which at random holds less
    of a paused copy than it stored: the LRU pool evicts from the front, all, or the back)."""
    rng = random.Random(seed)
    bridge = _random_run_bridge(offload)
    fakes = [
        FakeRequest(f"r{i}", [1] * rng.randint(8, 60), max_tokens=rng.randint(20, 90))
        for i in range(14)
    ]
    running: list[FakeRequest] = []
    waiting: list[FakeRequest] = []
    for step in range(num_steps):
        now = step * 0.1
        if fakes and rng.random() < 0.3:
            fake = fakes.pop(0)
            bridge.track(fake, rate_tps=rng.choice((1.0, 2.0, 8.0)), now_s=now)
            waiting.append(fake)
        for fake in list(running):
            total = len(fake.prompt_token_ids) + len(fake.output_token_ids)
            if fake.num_computed_tokens < total - 1:  # prefilling, in chunks of up to 32
                fake.num_computed_tokens = min(total - 1, fake.num_computed_tokens + 32)
            if fake.num_computed_tokens >= total - 1:
                fake.output_token_ids.append(1)
                fake.num_computed_tokens = total
            if len(fake.output_token_ids) >= fake.max_tokens:
                running.remove(fake)
                bridge.forget(fake.request_id)
            elif rng.random() < 0.05:  # vLLM pauses it (the policy's move or its own)
                running.remove(fake)
                stored = offload != "none" and rng.random() < 0.7
                computed = fake.num_computed_tokens if stored else 0
                bridge.preempted(fake.request_id, computed)
                fake.num_preemptions += 1
                fake.num_computed_tokens = computed
                waiting.append(fake)
        while waiting and len(running) < 6 and rng.random() < 0.5:
            running.append(waiting.pop(rng.randrange(len(waiting))))
        # A slow engine (about 20-30 tok/s at 6 streams): demand crosses capacity at times.
        bridge.observe_step(len(running), 0, 0.05 + 0.03 * len(running))
        blocks = {f.request_id: -(-max(f.num_computed_tokens, 1) // 16) for f in running}
        free = 48 - sum(blocks.values())
        kept = {i: bridge.kv.synced_tokens(i) for i in bridge.paused_copy_ids}
        held = {i: rng.choice((n, n, n, 0, n // 2)) for i, n in kept.items()}
        held = held if offload == "pool" else None
        if free >= 0:
            yield bridge.view(running, waiting, PoolState(free, blocks, held), now_s=now), held
            bridge.kv.check_integrity()


@pytest.mark.parametrize("offload", ["none", "host_kv", "pool"])
@pytest.mark.parametrize("seed", range(6))
def test_the_policy_decides_on_random_bridge_views_with_moves_vllm_can_carry_out(seed, offload):
    # Pauses name running mirrors, starts name paused or waiting ones, a start by load has a
    # host copy to load, and (vLLM's pool) no paused copy is larger than what the pool holds.
    policy = make_policy("tokenflow", SchedulerConfig(max_num_seqs=8), TokenFlowConfig())
    num_decisions = num_moves = 0
    for view, held in _views_of_a_random_run(seed, offload):
        for paused in view.preempted if held is not None else ():
            assert view.kv.synced_tokens(paused.request_id) <= held.get(paused.request_id, 0)
        moves = policy.decide(view)
        running = {r.request_id for r in view.running}
        off_device = {r.request_id: r for r in [*view.preempted, *view.waiting]}
        assert {p.request_id for p in moves.preemptions} <= running
        for start in moves.starts:
            request = off_device[start.request_id]
            assert not start.by_load or view.kv.has_host_copy(
                request.request_id, request.num_computed_tokens
            )
        num_decisions += 1
        num_moves += len(moves.preemptions) + len(moves.starts)
    assert num_decisions > 50 and num_moves > 0


def test_a_mirror_still_prefilling_is_never_pausable():
    bridge = make_bridge()
    decoding = FakeRequest("a", num_computed_tokens=21, output_token_ids=[5, 6])
    prefilling = FakeRequest("b", num_computed_tokens=8)
    for request in (decoding, prefilling):
        bridge.track(request, rate_tps=0.01, now_s=0.0)  # slow readers: seconds buffered
    view = bridge.view([decoding, prefilling], [], PoolState(6, {"a": 2, "b": 2}), now_s=0.0)
    config = TokenFlowConfig(critical_slack_s=0.0, buffer_conservativeness=1.0)
    prices = Prices.at(config, view)
    assert is_pausable(config, view, bridge.requests["a"], prices)
    assert not is_pausable(config, view, bridge.requests["b"], prices)
