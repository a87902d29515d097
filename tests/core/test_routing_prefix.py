"""Routing by cached prefix: the replicas' summaries, and the `prefix-affinity` and `tokenflow`
rules' picks on hand-built reports."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from tests.core.test_prefix_cache import compute, manager
from tests.core.test_prefix_cache_scheduler import make_core
from tests.core.test_routing import _report, _router
from tokenflow.core.load_report import Projection, RouteRequest, load_report, project
from tokenflow.core.prefix_cache import extend_chain
from tokenflow.core.prefix_summary import (
    PrefixSummary,
    RecentKeys,
    is_sampled,
    num_common_blocks,
)
from tokenflow.core.request import Request, SamplingParams
from tokenflow.core.routing import reader_loss_s

BS = 16


def _chat(index: int, hashes: tuple[int, ...], rate: float = 10.0, session=None) -> RouteRequest:
    """A turn whose prompt is len(hashes) blocks of 16 tokens, with a 1,000-token answer."""
    num_prompt = len(hashes) * BS
    return RouteRequest(
        f"t{index}",
        rate,
        lifetime_tokens=num_prompt + 500,
        end_tokens=num_prompt + 1000,
        prefix_block_hashes=hashes,
        prefix_block_size=BS,
        session_key=session,
    )


def _holding(hashes: tuple[int, ...], **fields) -> object:
    """A replica's report whose device caches `hashes` (as a sample would report them)."""
    return replace(
        _report(**fields),
        cached_prefixes=PrefixSummary(device_block_hashes=hashes),
        prefill_token_s=1e-4,
    )


SYSTEM = tuple(range(1000, 1100))  # 100 blocks every turn of an app starts with
HISTORY = (*SYSTEM, *range(5000, 5200))  # a conversation's earlier turns after it


# -- the summary -----------------------------------------------------------------------------------
def test_a_summary_matches_up_to_the_last_key_it_holds():
    summary = PrefixSummary(device_block_hashes=(HISTORY[9],), host_block_hashes=(HISTORY[149],))
    assert summary.num_cached_blocks(HISTORY) == 150
    assert summary.num_cached_blocks(HISTORY[:100]) == 10
    assert summary.num_cached_blocks((1, 2, 3)) == 0
    assert PrefixSummary().num_cached_blocks(HISTORY) == 0


def test_common_blocks_of_two_chains():
    assert num_common_blocks(HISTORY, SYSTEM) == 100
    # (chain keys: once two prompts differ, every later key differs)
    assert num_common_blocks(HISTORY, (*SYSTEM[:37], *range(1, 64))) == 37
    assert num_common_blocks((), HISTORY) == 0
    assert num_common_blocks((1,), (2,)) == 0


def test_recent_keys_keep_the_sampled_ones_by_last_use():
    recent = RecentKeys()
    for key in (8, 3, 16, 24):
        recent.touch(key)
    recent.touch(8)  # used again: the most recent
    assert recent.latest(10) == (8, 24, 16)  # (3 is not sampled)
    assert recent.latest(2) == (8, 24)
    recent.forget(24)
    assert recent.latest(10) == (8, 16)


def test_a_replica_reports_the_sampled_keys_its_tiers_cache():
    kv = manager(device=64, host=64)
    tokens = tuple(range(3, 3 + 4 * 60))  # 60 full blocks of 4
    hit = kv.find_prefix(tokens)
    assert kv.allocate_with_prefix("a", len(tokens), hit)
    compute(kv, "a", tokens, len(tokens))
    keys: list[int] = []
    extend_chain(keys, tokens, 4)
    sampled = [k for k in keys if is_sampled(k)]
    assert sampled  # (60 keys, about one in eight sampled)
    summary = kv.prefix_summary(max_keys_per_tier=1000)
    assert sorted(summary.device_block_hashes) == sorted(sampled)
    assert summary.host_block_hashes == ()
    assert summary.num_cached_blocks(keys) == keys.index(sampled[-1]) + 1
    assert len(kv.prefix_summary(max_keys_per_tier=1).device_block_hashes) == 1
    assert manager(prefix_caching=False).prefix_summary(1000) == PrefixSummary()


def test_load_report_carries_the_summary_of_the_replica_s_view():
    core, clock, _ = make_core("tokenflow", num_device_blocks=64)
    prompt = tuple(range(1000, 1000 + 4 * 40))
    core.add_request(Request("a", prompt, SamplingParams(max_tokens=4, ignore_eos=True), 20.0, 0.0))
    for _ in range(20):
        core.step()
    report = load_report(core.scheduler.view(clock.now()))
    keys: list[int] = []
    extend_chain(keys, prompt, 4)
    assert report.cached_prefixes.num_cached_blocks(keys) >= 30  # (short of 40 by the sample)
    assert report.idle().cached_prefixes == PrefixSummary()


def test_a_core_request_routes_with_its_prompt_s_keys():
    prompt = tuple(range(1000, 1040))
    request = Request("a", prompt, SamplingParams(max_tokens=8), 20.0, 0.0, session_key="s")
    route = RouteRequest.of(request, block_size=16)
    assert route.prefix_block_hashes == tuple(request.prompt_block_hashes(16))
    assert len(route.prefix_block_hashes) == 2 and route.session_key == "s"
    assert route.num_prompt_tokens == 40 and route.num_output_tokens == 8
    assert RouteRequest.of(request).prefix_block_hashes == ()


# -- prefix-affinity ---------------------------------------------------------------------------
def test_prefix_affinity_takes_the_longest_cached_prefix_over_load():
    reports = {
        "idle": _holding(SYSTEM),
        "busy": _holding((SYSTEM[50], HISTORY[250]), num_running=40),
    }
    turn = _chat(0, (*HISTORY, 7, 8))
    assert _router("prefix-affinity", reports).choose(turn) == "busy"
    assert _router("least-outstanding", reports).choose(turn) == "idle"


def test_prefix_affinity_sends_ties_and_misses_to_the_least_outstanding():
    reports = {"a": _holding(SYSTEM, num_running=9), "b": _holding(SYSTEM, num_running=2)}
    router = _router("prefix-affinity", reports)
    assert router.choose(_chat(0, (*SYSTEM, 1, 2))) == "b"  # both hold the system prompt
    assert router.choose(_chat(1, (3, 4, 5))) == "b"  # neither holds anything of it


def test_prefix_affinity_counts_a_prompt_routed_since_the_last_report():
    reports = {"a": _holding(()), "b": _holding(())}
    router = _router("prefix-affinity", reports)
    assert router.choose(_chat(0, HISTORY)) == "a"
    assert router.choose(_chat(1, (9, 9, 9))) == "b"  # (a miss: b has fewer outstanding)
    assert router.choose(_chat(2, (*HISTORY, 1))) == "a"  # its first turn went to a
    router.report("a", _holding((), num_running=2))  # it no longer holds it: evicted
    assert router.choose(_chat(3, (*HISTORY, 2))) == "b"


def test_a_session_without_keys_goes_where_its_last_turn_went():
    router = _router("prefix-affinity", {"a": _report(), "b": _report()})
    first = RouteRequest("t0", 10.0, 600, 1100, session_key="s")
    assert router.choose(first) == "a"
    router.report("a", _report(num_running=5))
    assert router.choose(replace(first, request_id="t1")) == "a"
    assert router.choose(replace(first, request_id="t2", session_key="other")) == "b"
    router.remove("a")
    assert router.session_replicas == {"other": "b"}


# -- tokenflow ---------------------------------------------------------------------------------
def test_tokenflow_sends_a_hit_where_readers_have_slack():
    # "warm" holds the conversation and its readers ask 60% of Gamma; "cold" is idle
    reports = {
        "cold": _holding(()),
        "warm": _holding(HISTORY, demand_tps=600, num_running=30),
    }
    turn = _chat(0, (*HISTORY, 1, 2))
    assert _router("tokenflow", reports).choose(turn) == "warm"
    miss = _chat(1, (1, 2, 3))
    assert _router("tokenflow", reports).choose(miss) == "cold"  # (no hit: by load)


def test_tokenflow_sends_a_hit_elsewhere_when_its_replica_is_past_gamma():
    reports = {
        "cold": _holding((), demand_tps=500),
        "warm": _holding(HISTORY, demand_tps=1100, num_running=60),
    }
    turn = _chat(0, (*HISTORY, 1, 2))
    assert _router("prefix-affinity", reports).choose(turn) == "warm"
    assert _router("tokenflow", reports).choose(turn) == "cold"


def test_tokenflow_weighs_the_saved_prefill_against_the_stall_past_gamma():
    # both replicas are past Gamma: the saving of a 300-block hit (0.48 s at 1e-4 s a
    # token) outweighs a slightly larger stall, not a much larger one
    turn = _chat(0, (*HISTORY, 1, 2))
    slightly = {
        "cold": _holding((), demand_tps=1010),
        "warm": _holding(HISTORY, demand_tps=1012),
    }
    assert _router("tokenflow", slightly).choose(turn) == "warm"
    much = {"cold": _holding((), demand_tps=1010), "warm": _holding(HISTORY, demand_tps=1300)}
    assert _router("tokenflow", much).choose(turn) == "cold"


def test_reader_loss_prices_the_wait_for_the_first_token_and_the_stall_past_gamma():
    report = replace(_report(), prefill_token_s=1e-3)
    turn = _chat(0, tuple(range(10)))  # 160 prompt tokens, 1,000 to read at 10 tok/s: 100 s
    within = Projection(load=0.9, num_spare_blocks=10)
    past = Projection(load=1.25, num_spare_blocks=10)
    assert reader_loss_s(report, within, turn, 0) == pytest.approx(0.160)  # its own prefill
    assert reader_loss_s(report, past, turn, 0) == pytest.approx(100 * (1 - 1 / 1.25) + 0.160)
    assert reader_loss_s(report, within, turn, 64) == pytest.approx(0.096)  # 64 tokens cached
    # at most the prompt but its last token is saved (its logits are computed)
    assert reader_loss_s(report, within, turn, 10_000) == pytest.approx(0.001)
    # 1,000 prompt tokens queued ahead of it
    assert reader_loss_s(report, within, turn, 0, 1000) == pytest.approx(1.160)
    eager = replace(turn, rate_tps=math.inf)
    assert reader_loss_s(report, past, eager, 0) == pytest.approx(0.160)


def test_tokenflow_sends_a_hit_past_a_queue_only_as_far_as_the_prefill_it_saves():
    # "warm" holds 300 blocks (4,800 tokens: 0.48 s at 1e-4 s a token) of the turn's prompt
    turn = _chat(0, (*HISTORY, 1, 2))
    for queued, chosen in ((2000, "warm"), (8000, "cold")):
        warm = replace(_holding(HISTORY), waiting_prompt_tokens=queued)
        assert _router("tokenflow", {"cold": _holding(()), "warm": warm}).choose(turn) == chosen


def test_without_keys_tokenflow_decides_by_load_alone():
    reports = {"a": _report(demand_tps=500), "b": _report(demand_tps=400)}
    plain = RouteRequest("r", 10.0, 660, 1160)
    assert _router("tokenflow", reports).choose(plain) == "b"
    assert project(reports["b"], [plain]).load < project(reports["a"], [plain]).load


def test_tokenflow_does_not_queue_a_turn_behind_its_own_session_s_last_turn():
    # the session's first turn went to "a" since a's last report, and "b" has reported since
    # its own; "a" prices its prefill 5% dearer (two replicas' measures differ by noise)
    reports = {"a": replace(_report(), prefill_token_s=1.05e-3), "b": _holding(())}
    reports["b"] = replace(reports["b"], prefill_token_s=1e-3)
    router = _router("tokenflow", reports)
    first = RouteRequest("t0", math.inf, 504, 508, session_key="s")  # (a 500-token prompt)
    router.record("a", first)
    # its history resent: 520 tokens, a prefix "a" caches
    second = RouteRequest("t1", math.inf, 524, 528, session_key="s")
    assert router.choose(second) == "a"
    # another session's prompt routed there since is queued ahead of it
    router = _router("tokenflow", reports)
    router.record("a", replace(first, session_key="other"))
    assert router.choose(replace(second, session_key="other-2")) == "b"
