"""The scheduler's mechanism under the baseline policies, with a fake executor."""

from tests.core.helpers import make_core, make_request, run_to_completion
from tokenflow.core.config import SchedulerConfig
from tokenflow.core.request import FinishReason, RequestState


def test_fcfs_is_prefill_first_and_whole_prompt():
    core, clock, ex = make_core("fcfs")
    core.add_request(make_request("a", num_prompt=10))
    core.step()
    core.add_request(make_request("b", num_prompt=12))
    plan, _ = core.step()
    # b's prefill runs alone: decodes wait while a prefill is pending
    assert [(c.request_id, c.num_tokens) for c in plan.chunks] == [("b", 12)]
    plan, _ = core.step()
    assert sorted(c.request_id for c in plan.chunks) == ["a", "b"]
    assert all(c.num_tokens == 1 for c in plan.chunks)


def test_chunked_mixes_decodes_with_prefill_chunks_within_budget():
    core, clock, ex = make_core("chunked")  # chunk_tokens = 32
    core.add_request(make_request("a", num_prompt=10))
    core.step()
    core.add_request(make_request("b", num_prompt=50))
    plan, _ = core.step()
    assert [(c.request_id, c.num_tokens) for c in plan.chunks] == [("a", 1), ("b", 31)]
    assert not plan.chunks[1].samples_token
    plan, _ = core.step()
    assert [(c.request_id, c.num_tokens) for c in plan.chunks] == [("a", 1), ("b", 19)]
    assert plan.chunks[1].samples_token and plan.chunks[1].start_position == 31


def test_finish_reasons_length_stop_and_min_tokens():
    core, clock, ex = make_core("fcfs")
    ex.eos_at = {"eos": 2, "early": 0}
    core.add_request(make_request("len", max_tokens=3))
    core.add_request(make_request("eos", max_tokens=10))
    core.add_request(make_request("early", max_tokens=10, min_tokens=2))
    core.add_request(make_request("ign", max_tokens=4, ignore_eos=True))
    ex.eos_at["ign"] = 1
    finished = {}
    while core.has_work:
        _, outputs = core.step()
        finished.update(
            {o.request_id: (o.finish_reason, o.num_output_tokens) for o in outputs if o.is_finished}
        )
    assert finished["len"] == (FinishReason.LENGTH, 3)
    assert finished["eos"] == (FinishReason.STOP, 3)
    assert finished["early"][1] == 10  # eos at output 0 came before min_tokens: ignored
    assert finished["ign"] == (FinishReason.LENGTH, 4)


def test_stop_token_ids_end_a_request():
    core, clock, ex = make_core("fcfs")
    core.add_request(make_request("a", max_tokens=10, stop_token_ids=(2,)))
    core.add_request(make_request("b", max_tokens=10, ignore_eos=True, stop_token_ids=(2,)))
    ex.eos_at = {"a": 1, "b": 1}
    reasons = {}
    while core.has_work:
        _, outputs = core.step()
        reasons.update({o.request_id: o.finish_reason for o in outputs if o.is_finished})
    assert reasons == {"a": FinishReason.STOP, "b": FinishReason.STOP}


def test_oom_retracts_fewest_generated_and_recomputes_exactly():
    optimistic = SchedulerConfig(
        init_new_token_ratio=0.01, min_new_token_ratio=0.01, link_bytes_per_s=1e6
    )
    core, clock, ex = make_core(
        "fcfs", num_device_blocks=12, block_size=4, scheduler_config=optimistic
    )
    early = make_request("early", num_prompt=16, max_tokens=24)
    late = make_request("late", num_prompt=16, max_tokens=24, arrival=0.001)
    core.add_request(early)
    core.step()
    core.step()
    core.add_request(late)
    run_to_completion(core, clock)
    assert core.scheduler.num_recomputes_total >= 1
    assert late.num_preemptions >= 1 and early.num_preemptions == 0
    # recompute re-feeds prompt + generated tokens: positions continue where they stopped
    assert late.output_token_ids == [100 + (16 + j) % 50 for j in range(24)]


def test_abort_frees_kv_in_both_tiers():
    core, clock, ex = make_core("tokenflow")
    core.add_request(make_request("a", num_prompt=40, max_tokens=50))
    for _ in range(5):
        core.step()
    assert core.scheduler.kv.num_free_device_blocks < 64
    assert core.abort("a")
    assert not core.abort("a")
    kv = core.scheduler.kv
    assert kv.num_free_device_blocks == 64 and kv.num_free_host_blocks == 256
    plan, _ = core.step()
    assert plan.released_request_ids == ("a",)


def test_request_that_can_never_fit_is_rejected_up_front():
    core, clock, ex = make_core("fcfs", num_device_blocks=4, block_size=4)
    try:
        core.add_request(make_request("big", num_prompt=10, max_tokens=10))
    except ValueError as err:
        assert "device KV pool" in str(err)
    else:
        raise AssertionError("an impossible request was accepted")


def test_max_model_len_is_enforced():
    config = SchedulerConfig(max_model_len=32, link_bytes_per_s=1e6)
    core, clock, ex = make_core("fcfs", scheduler_config=config)
    try:
        core.add_request(make_request("a", num_prompt=30, max_tokens=5))
    except ValueError as err:
        assert "max_model_len" in str(err)
    else:
        raise AssertionError("over-long request accepted")


def test_max_num_seqs_caps_residents():
    config = SchedulerConfig(max_num_seqs=2, link_bytes_per_s=1e6)
    core, clock, ex = make_core("fcfs", scheduler_config=config)
    for i in range(4):
        core.add_request(make_request(f"r{i}", num_prompt=4, max_tokens=5))
    core.step()
    assert len(core.scheduler.running) == 2
    assert [r.state for r in core.scheduler.waiting] == [RequestState.WAITING] * 2
