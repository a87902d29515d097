"""The simulated executor, and the simulated clock it drives."""

from types import SimpleNamespace

import pytest

import tokenflow.engine.clock
from tests.python_calls import count_python_calls
from tokenflow.core.clock import SimClock
from tokenflow.core.plan import BlockCopy, CopyKind, ScheduledChunk, StepPlan, attention_pairs
from tokenflow.core.request import SamplingParams
from tokenflow.engine.clock import WallClock
from tokenflow.sim.cost_model import CostModel
from tokenflow.sim.executor import SimExecutor
from tokenflow.sim.hardware import get_gpu, get_model

BLOCK_SIZE = 16
PARAMS = SamplingParams(max_tokens=100)


def make_executor(blocking_evictions: bool = False, seed: int = 0) -> SimExecutor:
    cost = CostModel(get_gpu("h200"), get_model("llama3-8b"))
    return SimExecutor(
        cost, SimClock(), BLOCK_SIZE, seed=seed, blocking_evictions=blocking_evictions
    )


def prefill(request_id: str, start: int, n: int, samples: bool) -> ScheduledChunk:
    return ScheduledChunk(
        request_id=request_id,
        token_ids=tuple(range(5, 5 + n)),
        start_position=start,
        new_block_ids=tuple(range(-(-(start + n) // BLOCK_SIZE))),
        block_table_start=0,
        samples_token=samples,
        sampling_params=PARAMS,
        num_output_tokens=0,
    )


def decode(
    request_id: str, position: int, num_output: int = 3, params: SamplingParams = PARAMS
) -> ScheduledChunk:
    return ScheduledChunk(
        request_id=request_id,
        token_ids=(7,),
        start_position=position,
        new_block_ids=tuple(range(position // BLOCK_SIZE + 1)),
        block_table_start=0,
        samples_token=True,
        sampling_params=params,
        num_output_tokens=num_output,
    )


def copies(kind: CopyKind, n: int) -> tuple[BlockCopy, ...]:
    return tuple(BlockCopy(f"c{i}", kind, i, i) for i in range(n))


def make_plan(
    chunks: tuple[ScheduledChunk, ...] = (),
    num_d2h: int = 0,
    num_h2d: int = 0,
    step: int = 0,
    num_evict: int = 0,
) -> StepPlan:
    return StepPlan(
        step_index=step,
        chunks=chunks,
        device_to_host=copies(CopyKind.EVICT, num_evict) + copies(CopyKind.WRITE_THROUGH, num_d2h),
        host_to_device=copies(CopyKind.LOAD, num_h2d),
        released_request_ids=(),
    )


# -- clock ------------------------------------------------------------------------------------
def test_sim_clock_advances() -> None:
    clock = SimClock()
    clock.advance(0.5)
    clock.advance_to(2.0)
    clock.advance_to(2.0)
    clock.advance(0.0)
    assert clock.now() == 2.0


@pytest.mark.parametrize("bad", [1.0, float("nan"), float("inf")])
def test_sim_clock_never_goes_backwards(bad: float) -> None:
    clock = SimClock(start_s=1.5)
    with pytest.raises(ValueError, match="backwards"):
        clock.advance_to(bad)
    assert clock.now() == 1.5


@pytest.mark.parametrize("bad", [-0.1, float("nan"), float("inf")])
def test_sim_clock_rejects_bad_increments(bad: float) -> None:
    clock = SimClock()
    with pytest.raises(ValueError):
        clock.advance(bad)
    assert clock.now() == 0.0


def test_wall_clock_counts_seconds_since_it_was_made(monkeypatch: pytest.MonkeyPatch) -> None:
    readings = iter([500.0, 500.25, 503.0])  # the monotonic clock at creation, then twice
    fake_time = SimpleNamespace(monotonic=lambda: next(readings))
    monkeypatch.setattr(tokenflow.engine.clock, "time", fake_time)
    clock = WallClock()
    assert (clock.now(), clock.now()) == (0.25, 3.0)


# -- executor ---------------------------------------------------------------------------------
def test_samples_exactly_the_chunks_that_ask() -> None:
    executor = make_executor()
    chunks = (prefill("a", 0, 64, samples=False), decode("b", 40), prefill("c", 128, 32, True))
    result = executor.execute(make_plan(chunks))
    assert [s.request_id for s in result.sampled] == ["b", "c"]


def test_tokens_come_in_the_plans_chunk_order() -> None:
    """Step semantics 4: the scheduler pairs tokens with chunks by position."""
    chunks = (
        decode("d1", 40),
        prefill("p1", 0, 64, samples=True),
        decode("d2", 41),
        prefill("p2", 0, 16, samples=False),
        decode("d3", 42),
        prefill("p3", 128, 32, samples=True),
    )
    result = make_executor().execute(make_plan(chunks))
    assert [s.request_id for s in result.sampled] == ["d1", "p1", "d2", "d3", "p3"]


def test_token_ids_are_deterministic_and_never_eos() -> None:
    chunks = tuple(decode(f"r{i}", 100 + i, num_output=i) for i in range(50))
    first = make_executor(seed=7).execute(make_plan(chunks)).sampled
    again = make_executor(seed=7).execute(make_plan(chunks)).sampled
    assert first == again
    assert all(1 <= s.token_id < 1000 for s in first)


def test_token_ids_skip_stop_token_ids() -> None:
    executor = make_executor()
    plain = executor.execute(make_plan((decode("a", 10),))).sampled[0].token_id
    params = SamplingParams(max_tokens=100, stop_token_ids=(plain, plain + 1))
    stopped = executor.execute(make_plan((decode("a", 10, params=params),))).sampled[0]
    assert stopped.token_id not in (plain, plain + 1)


def test_compute_time_follows_the_cost_model() -> None:
    executor = make_executor()
    chunks = (prefill("a", 100, 50, samples=True), decode("b", 40), decode("c", 9))
    executor.execute(make_plan(chunks))
    expected = CostModel(get_gpu("h200"), get_model("llama3-8b")).compute_time_s(
        num_prefill_tokens=50,
        prefill_attention_pairs=attention_pairs(100, 50),
        decode_context_tokens=41 + 10,
        num_decode_seqs=2,
        num_prefill_samples=1,
    )
    assert executor.last_step_duration_s == pytest.approx(expected)
    assert executor.total_compute_s == pytest.approx(expected)


def test_decodes_are_also_given_as_a_dense_batch_padded_to_the_longest() -> None:
    seen = {}

    class Recording(CostModel):
        def compute_time_s(self, *args, **kwargs) -> float:
            seen.update(kwargs)
            return super().compute_time_s(*args, **kwargs)

    executor = SimExecutor(Recording(get_gpu("h200"), get_model("llama3-8b")), SimClock(), 16)
    executor.execute(make_plan((decode("a", 40), decode("b", 9), decode("c", 99))))
    assert seen["decode_context_tokens"] == 41 + 10 + 100
    assert seen["padded_decode_keys"] == 3 * 112  # 100 keys -> 7 blocks of 16


def test_clock_advances_by_the_step_duration() -> None:
    clock = SimClock(start_s=10.0)
    executor = SimExecutor(CostModel(get_gpu("h200"), get_model("llama3-8b")), clock, BLOCK_SIZE)
    executor.execute(make_plan((decode("a", 100),)))
    executor.execute(make_plan((decode("a", 101),)))
    assert executor.num_steps == 2
    assert clock.now() > 10.0
    assert executor.last_step_duration_s > 0


def test_block_copy_pays_a_latency_per_layer_piece() -> None:
    executor = make_executor()
    gpu = get_gpu("h200")
    piece_bytes = executor.block_bytes // 64  # Llama3-8B: 32 layers x (K, V)
    expected = 64 * (gpu.copy_latency_s + piece_bytes / gpu.pcie_bytes_per_s)
    assert executor.block_copy_s == pytest.approx(expected)
    assert executor.block_copy_s > 5 * executor.block_bytes / gpu.pcie_bytes_per_s


def test_copies_overlap_each_other_and_compute_by_default() -> None:
    executor = make_executor()
    block_s = executor.block_copy_s
    executor.execute(make_plan((decode("a", 100),), num_d2h=200, num_h2d=100))
    assert executor.last_step_duration_s == pytest.approx(200 * block_s)
    assert executor.total_d2h_bytes == 200 * executor.block_bytes
    assert executor.total_h2d_bytes == 100 * executor.block_bytes


def test_evictions_overlap_compute_with_write_through() -> None:
    executor = make_executor()
    chunks = (prefill("a", 0, 2048, samples=True),)
    bare = make_executor()
    bare.execute(make_plan(chunks))
    executor.execute(make_plan(chunks, num_evict=10))
    assert executor.last_step_duration_s == pytest.approx(bare.last_step_duration_s)


def test_write_back_makes_the_preempting_step_wait_for_its_eviction() -> None:
    chunks = (prefill("a", 0, 2048, samples=True),)
    bare = make_executor(blocking_evictions=True)
    bare.execute(make_plan(chunks, num_d2h=5))  # write-through-like copies still overlap
    executor = make_executor(blocking_evictions=True)
    executor.execute(make_plan(chunks, num_evict=10, num_d2h=5))
    expected = 10 * executor.block_copy_s + bare.last_step_duration_s
    assert executor.last_step_duration_s == pytest.approx(expected)


def test_small_copies_hide_behind_compute() -> None:
    with_copies, without = make_executor(), make_executor()
    chunks = (prefill("a", 0, 2048, samples=True),)
    with_copies.execute(make_plan(chunks, num_d2h=3, num_h2d=3))
    without.execute(make_plan(chunks))
    assert with_copies.last_step_duration_s == without.last_step_duration_s


def test_block_bytes() -> None:
    assert make_executor().block_bytes == BLOCK_SIZE * 131072


def test_empty_plan_takes_no_time() -> None:
    executor = make_executor()
    result = executor.execute(make_plan())
    assert result.sampled == ()
    assert executor.last_step_duration_s == 0.0


def test_rejects_bad_block_size() -> None:
    with pytest.raises(ValueError, match="block_size"):
        SimExecutor(CostModel(get_gpu("h200"), get_model("llama3-8b")), SimClock(), 0)


def test_a_step_makes_at_most_one_python_call_per_chunk() -> None:
    # The simulator's hot path (up to ~300 chunks a step) inlines the token ids: its Python
    # calls are a constant plus the SampledToken of each sampling chunk, on any machine.
    executor = make_executor()
    calls = {}
    for num_chunks in (10, 300):
        chunks = tuple(decode(f"r{i}", 1000 + i) for i in range(num_chunks))
        plan = make_plan(chunks, num_d2h=20)
        executor.execute(plan)  # warm
        calls[num_chunks] = count_python_calls(lambda plan=plan: executor.execute(plan))
    assert 0 < calls[300] - calls[10] <= 300 - 10
