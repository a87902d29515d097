"""The pure parts of the integration (no vLLM engine): bridge, settings, middleware, launcher."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field

import pytest

from tokenflow.core.config import SchedulerConfig, TokenFlowConfig
from tokenflow.core.policies import make_policy
from tokenflow.core.policies.pricing import Prices, is_pausable
from tokenflow.core.request import RequestState
from tokenflow.integrations.vllm.bridge import OTHER_OWNER, PolicyBridge, PoolShape, PoolState
from tokenflow.integrations.vllm.middleware import move_stream_rate
from tokenflow.integrations.vllm.serve import (
    MIDDLEWARE,
    SCHEDULER_CLS,
    host_kv_transfer_config,
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
    default_rate: float | None = None, offload_block_bytes: int | None = None
) -> PolicyBridge:
    config = SchedulerConfig(max_num_seqs=8)
    policy = make_policy("tokenflow", config, TokenFlowConfig())
    shape = PoolShape(
        num_device_blocks=10,
        block_size=16,
        host_factor=2.0,
        recompute_block_s=0.01,
        offload_block_bytes=offload_block_bytes,
    )
    return PolicyBridge(policy, config, shape, default_rate)


def test_rate_from_extra_args_else_default():
    bridge = make_bridge(default_rate=7.0)
    assert bridge.rate_of({"stream_rate": 2.5}) == 2.5
    assert bridge.rate_of({"stream_rate": "3"}) == 3.0
    assert bridge.rate_of(None) == 7.0
    for bad in ("fast", -1, 0, float("inf"), float("nan")):
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


def test_settings_from_additional_config():
    settings = IntegrationSettings.from_additional_config(
        {"tokenflow": {"default_rate": 5, "host_factor": 1, "policy": {"critical_slack_s": 1.0}}}
    )
    assert settings.default_rate_tps == 5.0 and settings.host_factor == 1.0
    assert settings.policy.critical_slack_s == 1.0
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


def _views_of_a_random_run(seed: int, offload: bool, num_steps: int = 120):
    """Bridge views of a random run: 14 streams read at 1-8 tok/s from a slow engine, some
    prefilling in chunks, decoding, paused (offloaded or not), resumed and finished, in a pool
    of 48 blocks."""
    rng = random.Random(seed)
    config = SchedulerConfig(max_num_seqs=8)
    shape = PoolShape(48, 16, 2.0, 0.01, offload_block_bytes=4096 if offload else None)
    bridge = PolicyBridge(make_policy("tokenflow", config, TokenFlowConfig()), config, shape)
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
                computed = fake.num_computed_tokens if offload and rng.random() < 0.7 else 0
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
        if free >= 0:
            yield bridge.view(running, waiting, PoolState(free, blocks), now_s=now)


@pytest.mark.parametrize("offload", [False, True])
@pytest.mark.parametrize("seed", range(6))
def test_the_policy_decides_on_random_bridge_views_with_moves_vllm_can_carry_out(seed, offload):
    # Pauses name running mirrors, starts name paused or waiting ones, and a start by load
    # has a host copy to load.
    policy = make_policy("tokenflow", SchedulerConfig(max_num_seqs=8), TokenFlowConfig())
    num_decisions = num_moves = 0
    for view in _views_of_a_random_run(seed, offload):
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
    prices = Prices.of(config, view)
    assert is_pausable(config, view, bridge.requests["a"], prices)
    assert not is_pausable(config, view, bridge.requests["b"], prices)
