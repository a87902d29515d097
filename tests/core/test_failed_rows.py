"""A row whose sampling failed (step semantics 5): the core ends its request with the reason as
an error, appends no placeholder token, frees its KV, and leaves the other rows untouched."""

import pytest

from tests.core.helpers import FakeExecutor, make_core, make_request, run_to_completion
from tokenflow.core.plan import SampledToken, StepPlan, StepResult
from tokenflow.core.request import FinishReason, RequestState

EOS = 2  # make_request's stop token: a placeholder the core appended would end its request
REASON = "sampling failed: probability tensor contains nan"


class FailingRows:
    """The fake executor, but each row of `failing` (request id -> why) fails the next time it
    is sampled: its token is a placeholder and the result names it."""

    def __init__(self, inner: FakeExecutor, failing: dict[str, str]) -> None:
        self.inner = inner
        self.failing = failing

    def execute(self, plan: StepPlan) -> StepResult:
        sampled = self.inner.execute(plan).sampled
        failed = {
            s.request_id: self.failing.pop(s.request_id)
            for s in sampled
            if s.request_id in self.failing
        }
        placeholders = tuple(
            SampledToken(s.request_id, EOS) if s.request_id in failed else s for s in sampled
        )
        return StepResult(placeholders, failed)


def _remaining_is_exact(scheduler) -> bool:
    """The admission aggregate still equals the residents' remaining output, summed."""
    remaining = sum(r.num_remaining_output_tokens for r in scheduler.running)
    return scheduler.queues.remaining_output_tokens == remaining


@pytest.mark.parametrize("in_decode", [True, False], ids=["decode", "prefill"])
def test_a_failed_row_ends_its_request_with_the_error_and_the_others_go_on(in_decode: bool):
    core, clock, executor = make_core("chunked")
    requests = [make_request(f"r{i}", num_prompt=6 + i, max_tokens=8) for i in range(3)]
    for request in requests:
        core.add_request(request)
    if in_decode:
        core.step()  # the prompts, each sampling its first token
    core.executor = FailingRows(executor, {"r1": REASON})
    failed = requests[1]
    tokens_before = list(failed.output_token_ids)

    plan, outputs = core.step()
    assert [c.request_id for c in plan.chunks] == ["r0", "r1", "r2"]
    by_id = {o.request_id: o for o in outputs}
    assert sorted(by_id) == ["r0", "r1", "r2"]
    ended = by_id["r1"]
    assert (ended.error, ended.finish_reason, ended.new_token_ids) == (
        REASON,
        FinishReason.ABORT,
        (),
    )
    assert failed.state is RequestState.ABORTED and failed.output_token_ids == tokens_before
    assert "r1" not in core.scheduler.requests
    assert core.scheduler.kv.num_device_blocks_of("r1") == 0  # its KV is freed now
    for innocent in ("r0", "r2"):
        output = by_id[innocent]
        assert output.error is None and output.finish_reason is None
        assert len(output.new_token_ids) == 1 and output.new_token_ids[0] != EOS
        assert core.scheduler.requests[innocent].state is RequestState.RUNNING
    assert _remaining_is_exact(core.scheduler)

    plan, _ = core.step()
    assert "r1" in plan.released_request_ids  # the executor drops its state
    assert "r1" not in [c.request_id for c in plan.chunks]
    run_to_completion(core, clock)
    for innocent in (requests[0], requests[2]):
        assert innocent.state is RequestState.FINISHED
        n = innocent.num_prompt_tokens
        assert innocent.output_token_ids == [100 + (n + j) % 50 for j in range(8)]
    kv = core.scheduler.kv
    assert kv.num_free_device_blocks == kv.config.num_device_blocks


def test_a_result_names_no_failed_rows_by_default_and_keeps_its_own_copy():
    assert StepResult(()).failed_rows == {}
    rows = {"a": "why"}
    result = StepResult((), rows)
    rows["b"] = "later"
    assert dict(result.failed_rows) == {"a": "why"}
    with pytest.raises(TypeError):
        result.failed_rows["c"] = "no"  # type: ignore[index]
