"""vLLM's own prefix cache under TokenFlow's scheduler (an in-process vLLM on the CPU with the
host KV connector): a request whose prompt begins as an earlier one's gets that prefix's blocks
from vLLM's cache; a policy pause of a stream that shares its prefix with a running one returns
only the blocks it holds alone (the count the policy was given), leaves the other stream's blocks
as they were, and changes no greedy token of either, nor of a newcomer that takes the freed
blocks."""

from __future__ import annotations

import time

import pytest
from vllm import SamplingParams
from vllm.v1.core.kv_cache_utils import KVCacheBlock

from tokenflow.core.policies import Moves, Preemption
from tokenflow.core.request import PreemptMode
from tokenflow.integrations.vllm.scheduler import num_blocks_freed_by

from .conftest import BLOCK_SIZE, close_llm, make_llm, scheduler_of

NUM_BLOCKS = 13  # 12 usable: two streams of a 4-block prefix and a newcomer fit
PREFIX_TOKENS = 4 * BLOCK_SIZE
MAX_TOKENS = 24
RATE_TPS = 2.0  # readers slower than the engine: the policy manages them, memory is no issue
HANG_S = 600.0  # turns a run that never ends into an error; no bound on a machine's speed


def greedy() -> SamplingParams:
    return SamplingParams(
        temperature=0.0, max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS, ignore_eos=True,
        extra_args={"stream_rate": RATE_TPS},
    )  # fmt: skip


@pytest.fixture(scope="module")
def llm(model_dir):
    llm = make_llm(
        model_dir,
        tokenflow=True,
        host_kv=True,
        enable_prefix_caching=True,
        num_gpu_blocks_override=NUM_BLOCKS,
        max_model_len=256,
    )
    yield llm
    close_llm(llm)


def prompts(llm, topic: str, questions: tuple[str, ...]) -> list[list[int]]:
    """Prompts that share their first 4 blocks (a long text on `topic`), one per question."""
    tokenizer = llm.get_tokenizer()
    text = " ".join(f"Chapter {i} of the long tale of {topic}." for i in range(40))
    prefix = tokenizer.encode(text)[:PREFIX_TOKENS]
    assert len(prefix) == PREFIX_TOKENS
    return [prefix + tokenizer.encode(f" {q}", add_special_tokens=False) for q in questions]


def test_blocks_others_hold_lead_a_table_and_are_not_freed_by_its_owner():
    def table(*ref_counts: int) -> list[KVCacheBlock]:
        return [KVCacheBlock(block_id=i, ref_cnt=n) for i, n in enumerate(ref_counts)]

    assert num_blocks_freed_by(table()) == 0
    assert num_blocks_freed_by(table(1, 1, 1)) == 3
    assert num_blocks_freed_by(table(3, 2, 2, 1, 1)) == 2
    assert num_blocks_freed_by(table(2, 2)) == 0
    null = KVCacheBlock(block_id=0, ref_cnt=1, is_null=True)  # (a sliding window's skipped)
    assert num_blocks_freed_by([null, *table(1, 1)[1:]]) == 1


def test_a_request_with_the_prefix_of_a_finished_one_hits_vllms_cache(llm, monkeypatch):
    first, second = prompts(llm, "a lighthouse", ("Who kept it?", "Why did it fail?"))
    bridge = scheduler_of(llm).bridge
    tracked: list[str] = []
    track = bridge.track

    def tracking(request, rate_tps: float, now_s: float):
        tracked.append(request.request_id)
        return track(request, rate_tps, now_s)

    monkeypatch.setattr(bridge, "track", tracking)
    [cold] = llm.generate([{"prompt_token_ids": first}], greedy(), use_tqdm=False)
    [warm] = llm.generate([{"prompt_token_ids": second}], greedy(), use_tqdm=False)
    assert len(tracked) == 2  # both rated: started by the policy, not left to vLLM
    assert cold.num_cached_tokens == 0
    assert warm.num_cached_tokens == PREFIX_TOKENS  # the shared prefix's 4 full blocks
    assert len(warm.outputs[0].token_ids) == MAX_TOKENS


def run(llm, pause: bool, monkeypatch) -> tuple[dict[str, list[int]], dict]:
    """Streams A and B sharing a 4-block prefix (B arrives once A's prompt is cached), and a
    newcomer C; with `pause`, the policy's moves of the step after B's first token also pause
    A (OFFLOAD) before C arrives.  Returns each stream's tokens, and what the pause saw."""
    engine, scheduler = llm.llm_engine, scheduler_of(llm)
    a_prompt, b_prompt = prompts(llm, "a harbour", ("Who sailed first?", "Who came back?"))
    c_prompt = prompts(llm, "a mountain", ("Who climbed it?",))[0]
    tokens: dict[str, list[int]] = {}
    ids: dict[str, str] = {}  # name -> vLLM's internal id

    def add(name: str, prompt: list[int]) -> None:
        ids[name] = engine.add_request(name, {"prompt_token_ids": prompt}, greedy())

    def step_until(done) -> None:
        deadline_s = time.monotonic() + HANG_S
        while not done():
            assert time.monotonic() < deadline_s, "the engine never got there"
            for output in engine.step():
                tokens[output.request_id] = list(output.outputs[0].token_ids)

    add("A", a_prompt)
    step_until(lambda: tokens.get("A"))
    add("B", b_prompt)
    step_until(lambda: tokens.get("B"))
    seen: dict = {}
    if pause:
        seen = pause_once(scheduler, ids["A"], ids["B"], monkeypatch)
        step_until(lambda: "freed" in seen)
    add("C", c_prompt)
    step_until(lambda: not engine.has_unfinished_requests())
    return tokens, seen


def pause_once(scheduler, a_id: str, b_id: str, monkeypatch) -> dict:
    """From the next schedule() until one carries it out, add a pause of A to the policy's
    moves, and record: the blocks the policy was told A holds, the pool's free blocks the pause
    returned, and B's blocks (id, reference count) before and after it."""
    seen: dict = {}
    plan, preempt = scheduler.bridge.plan, scheduler._preempt
    manager = scheduler.kv_cache_manager

    def b_blocks() -> list[tuple[int, int]]:
        return [(b.block_id, b.ref_cnt) for b in manager.get_blocks(b_id).blocks[0]]

    def plan_with_a_pause(view) -> Moves:
        moves = plan(view)
        seen["counted"] = view.kv.num_device_blocks_of(a_id)
        seen["a_blocks"] = len(manager.get_blocks(a_id).blocks[0])
        seen["b_before"] = b_blocks()
        pause = Preemption(a_id, PreemptMode.OFFLOAD)
        return Moves(preemptions=(*moves.preemptions, pause), starts=moves.starts)

    def preempt_measured(moves: Moves, now: float) -> set[str]:
        free = manager.block_pool.get_num_free_blocks()
        done = preempt(moves, now)
        if a_id in done:
            seen["freed"] = manager.block_pool.get_num_free_blocks() - free
            seen["b_after"] = b_blocks()
            monkeypatch.setattr(scheduler.bridge, "plan", plan)
            monkeypatch.setattr(scheduler, "_preempt", preempt)
        return done

    monkeypatch.setattr(scheduler.bridge, "plan", plan_with_a_pause)
    monkeypatch.setattr(scheduler, "_preempt", preempt_measured)
    return seen


def test_pausing_a_stream_that_shares_its_prefix_frees_only_its_own_blocks(llm, monkeypatch):
    scheduler = scheduler_of(llm)
    host_kv = scheduler.host_kv
    expected, _ = run(llm, pause=False, monkeypatch=monkeypatch)
    assert llm.reset_prefix_cache()  # the paused run starts from the same empty cache
    bridge = scheduler.bridge
    pauses, recomputes = bridge.num_offloads, bridge.num_offloads_as_recompute
    loads = host_kv.num_loaded_blocks
    tokens, seen = run(llm, pause=True, monkeypatch=monkeypatch)
    assert bridge.num_offloads > pauses, "A was not paused by an offload"
    assert bridge.num_offloads_as_recompute == recomputes
    # A held 4 prefix blocks with B and the rest alone: the policy was told the rest, which is
    # what the pause returned to the pool; B's blocks stayed B's, one reference fewer each.
    assert seen["a_blocks"] > 4 and seen["counted"] == seen["a_blocks"] - 4 == seen["freed"]
    before, after = seen["b_before"], seen["b_after"]
    assert [block_id for block_id, _ in after] == [block_id for block_id, _ in before]
    assert [n for _, n in before[:4]] == [2] * 4 and [n for _, n in after[:4]] == [1] * 4
    assert host_kv.num_loaded_blocks > loads, "A did not come back from its host copy"
    assert tokens == expected  # no stream's KV was lost or overwritten
    assert all(len(t) == MAX_TOKENS for t in tokens.values()) and set(tokens) == {"A", "B", "C"}
    assert not scheduler.running and not scheduler.waiting and not bridge.requests
    bridge.kv.check_integrity()
