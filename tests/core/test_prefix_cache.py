"""The device prefix cache through `KVTierManager`, on small hand-built states (block size 4)."""

import pytest

from tokenflow.core.kv_manager import KVConfig, KVTierManager
from tokenflow.core.plan import CopyKind

BS = 4


def manager(
    device: int = 16, host: int = 16, prefix_caching: bool = True, retention: str = "reading"
) -> KVTierManager:
    config = KVConfig(
        device,
        host,
        BS,
        block_bytes=100,
        prefix_caching=prefix_caching,
        prefix_retention=retention,
    )
    return KVTierManager(config)


def start(kv: KVTierManager, rid: str, prompt: tuple[int, ...]) -> int:
    """Start `rid` as the scheduler does (lookup, then allocate); its cached tokens."""
    hit = kv.find_prefix(prompt)
    assert kv.allocate_with_prefix(rid, len(prompt), hit)
    return hit.num_device_tokens


def compute(kv: KVTierManager, rid: str, tokens: tuple[int, ...], num_computed: int) -> None:
    """The step computed `rid`'s first `num_computed` tokens: cache its full blocks."""
    kv.cache_full_blocks(
        rid, num_computed, lambda position, count: tokens[position : position + count]
    )


def run(kv: KVTierManager, rid: str, prompt: tuple[int, ...]) -> int:
    """Start `rid` and compute its whole prompt; its cached tokens."""
    cached = start(kv, rid, prompt)
    compute(kv, rid, prompt, len(prompt))
    kv.check_integrity()
    return cached


PREFIX = tuple(range(10, 22))  # three full blocks


def test_a_common_three_block_prefix_is_shared_and_the_tails_are_private():
    kv = manager()
    assert run(kv, "a", PREFIX + (1, 2, 3)) == 0
    free = kv.num_free_device_blocks
    assert run(kv, "b", PREFIX + (7, 8)) == 3 * BS
    a, b = kv.device_block_ids("a"), kv.device_block_ids("b")
    assert b[:3] == a[:3] and b[3] != a[3]
    assert kv.num_free_device_blocks == free - 1  # only b's partial block is new


def test_a_prompt_of_exactly_two_full_blocks_reuses_only_one():
    kv = manager()
    prompt = tuple(range(8))
    run(kv, "a", prompt)  # both blocks cached
    assert run(kv, "b", prompt) == BS  # the last token must be computed for its logits
    assert kv.device_block_ids("b")[0] == kv.device_block_ids("a")[0]
    assert kv.device_block_ids("b")[1] != kv.device_block_ids("a")[1]
    assert run(kv, "c", prompt + (99,)) == 2 * BS  # one more token: both blocks reused


def test_a_finished_requests_cached_free_blocks_are_reused_by_an_identical_prompt():
    kv = manager(device=6)
    prompt = tuple(range(9))  # 2 full blocks + 1 partial
    run(kv, "a", prompt)
    blocks = kv.device_block_ids("a")
    kv.drop("a")
    assert kv.num_free_device_blocks == 6  # cached-free blocks are free memory
    kv.check_integrity()
    assert run(kv, "b", prompt) == 2 * BS
    assert kv.device_block_ids("b")[:2] == blocks[:2]
    assert kv.num_free_device_blocks == 3


def test_allocation_evicts_cached_free_blocks_least_recently_released_first():
    kv = manager(device=8, retention="lru")
    first, second = tuple(range(9)), tuple(range(50, 59))
    run(kv, "a", first)
    run(kv, "b", second)
    kv.drop("a")  # released first: its blocks are the least recent
    kv.drop("b")
    assert kv.num_free_device_blocks == 8  # 4 plain + 2 + 2 cached-free
    assert kv.allocate("c", 5 * BS)  # the 4 plain blocks, then one cached-free
    # a's blocks were released last to first: its tail block went first, its head survives
    assert kv.find_prefix(first).num_device_tokens == BS
    assert kv.find_prefix(second).num_device_tokens == 2 * BS
    assert kv.allocate("c", 7 * BS)  # a's head, then b's tail
    assert kv.find_prefix(first).num_device_tokens == 0
    assert kv.find_prefix(second).num_device_tokens == BS
    kv.check_integrity()


def test_a_prompt_diverging_inside_a_partial_block_shares_only_the_full_common_blocks():
    kv = manager()
    a = tuple(range(10))  # blocks [0..3] [4..7] full, [8, 9] partial (never cached)
    run(kv, "a", a)
    b = tuple(range(9)) + (99, 100)  # agrees with a on 9 tokens; its third block is partial
    assert run(kv, "b", b) == 2 * BS
    assert kv.device_block_ids("b")[2] != kv.device_block_ids("a")[2]
    compute(kv, "a", a + (10, 11), 12)  # a's third block fills: [8, 9, 10, 11]
    assert kv.find_prefix(b + (101, 102)).num_device_tokens == 2 * BS  # [8, 99, 100, 101]
    assert kv.find_prefix(a + (10, 11, 12)).num_device_tokens == 3 * BS


def test_a_block_is_found_only_behind_the_same_tokens():
    """Keys chain the whole prefix: equal blocks at different places are different KV."""
    kv = manager()
    run(kv, "a", (7, 7, 7, 7, 8, 8, 8, 8, 1))
    assert kv.find_prefix((8, 8, 8, 8, 2)).num_device_tokens == 0
    assert kv.find_prefix((6, 6, 6, 6, 8, 8, 8, 8, 2)).num_device_tokens == 0


def test_a_shared_block_survives_one_owner_finishing():
    kv = manager(device=8)
    run(kv, "a", PREFIX + (1,))
    run(kv, "b", PREFIX + (2,))
    shared = kv.device_block_ids("b")[:3]
    free = kv.num_free_device_blocks
    assert kv.free_device("a") == 1  # only a's private block became free
    kv.drop("a")
    assert kv.num_free_device_blocks == free + 1
    assert kv.device_block_ids("b")[:3] == shared
    kv.check_integrity()
    kv.drop("b")  # the last owner: the cached blocks stay findable
    assert kv.num_free_device_blocks == 8
    assert kv.find_prefix(PREFIX + (3,)).device_block_ids == shared
    kv.check_integrity()


def test_evicting_one_owner_copies_its_whole_kv_but_frees_no_shared_block():
    kv = manager(device=8)
    run(kv, "a", PREFIX + (1,))
    run(kv, "b", PREFIX + (2,))
    shared = kv.device_block_ids("b")[:3]
    a_blocks = kv.device_block_ids("a")
    free = kv.num_free_device_blocks
    plan = kv.evict("a", len(PREFIX) + 1)
    assert plan is not None
    assert [c.src_block_id for c in plan.copies] == list(a_blocks)  # the host gets all of a
    assert all(c.kind is CopyKind.EVICT for c in plan.copies)
    kv.check_integrity()
    kv.end_step()
    assert kv.num_free_device_blocks == free + 1  # a's private block only
    assert kv.device_block_ids("b")[:3] == shared and kv.has_host_copy("a", len(PREFIX) + 1)
    kv.check_integrity()


def test_a_block_being_copied_out_is_not_free_until_the_step_ends():
    """a's eviction copies the shared blocks this step; b, their other owner, is dropped in the
    same step: they must not be reallocated (and rewritten) while the copy reads them."""
    kv = manager(device=8)
    run(kv, "a", PREFIX + (1,))
    run(kv, "b", PREFIX + (2,))
    shared = kv.device_block_ids("b")[:3]
    assert kv.evict("a", len(PREFIX) + 1) is not None
    kv.drop("b")
    assert kv.num_free_device_blocks == 4  # b's private block + the 3 never used
    assert kv.allocate("c", 4 * BS)
    assert not set(shared) & set(kv.device_block_ids("c"))
    kv.check_integrity()
    kv.end_step()
    assert kv.find_prefix(PREFIX + (3,)).device_block_ids == shared  # now cached-free
    kv.check_integrity()


def test_a_refused_start_changes_nothing():
    kv = manager(device=4)
    prompt = tuple(range(9))
    run(kv, "a", prompt)
    kv.drop("a")  # 2 cached-free + 2 plain
    longer = prompt[:8] + tuple(range(100, 109))  # 17 tokens: 2 shared + 3 new > 2 left
    prefix = kv.find_prefix(longer)
    assert prefix.num_device_tokens == 2 * BS
    assert not kv.allocate_with_prefix("b", len(longer), prefix)
    assert kv.num_device_blocks_of("b") == 0 and kv.num_free_device_blocks == 4
    assert kv.find_prefix(longer) == prefix
    kv.check_integrity()


def test_a_stale_prefix_is_refused():
    kv = manager(device=3)
    prompt = tuple(range(9))
    run(kv, "a", prompt)
    kv.drop("a")
    prefix = kv.find_prefix(prompt)
    assert kv.allocate("other", 3 * BS)  # takes the cached-free blocks, forgetting their keys
    kv.drop("other")
    with pytest.raises(ValueError):
        kv.allocate_with_prefix("b", len(prompt), prefix)


def test_keying_hashes_only_the_blocks_filled_since_the_last_call():
    kv = manager()
    tokens = tuple(range(40))
    asked: list[int] = []

    def token_ids_from(position: int, count: int) -> tuple[int, ...]:
        asked.append((position, count))
        return tokens[position : position + count]

    assert kv.allocate("a", 40)
    kv.cache_full_blocks("a", 13, token_ids_from)
    assert asked == [(0, 12)]
    kv.cache_full_blocks("a", 15, token_ids_from)  # no block filled
    kv.cache_full_blocks("a", 16, token_ids_from)
    assert asked == [(0, 12), (12, 4)]
    assert kv.find_prefix(tokens).num_device_tokens == 16
    asked.clear()
    start(kv, "b", tokens[:20])  # shares 4 blocks, whose keys the lookup computed
    kv.cache_full_blocks("b", 20, token_ids_from)
    assert asked == [(16, 4)]


def test_twins_computed_together_keep_the_first_block_and_the_second_stays_private():
    kv = manager(device=8)
    prompt = tuple(range(9))
    start(kv, "a", prompt)
    start(kv, "b", prompt)  # both start before either is computed: no hit
    compute(kv, "a", prompt, 9)
    compute(kv, "b", prompt, 9)
    assert kv.find_prefix(prompt).device_block_ids == kv.device_block_ids("a")[:2]
    kv.drop("b")  # b's twins were never cached: back to the plain free list
    kv.check_integrity()
    assert kv.find_prefix(prompt).device_block_ids == kv.device_block_ids("a")[:2]


def test_without_prefix_caching_nothing_is_found_or_cached():
    kv = manager(prefix_caching=False)
    run(kv, "a", PREFIX + (1,))
    assert kv.find_prefix(PREFIX + (1,)).num_device_tokens == 0
    assert run(kv, "b", PREFIX + (1,)) == 0
    assert not set(kv.device_block_ids("a")) & set(kv.device_block_ids("b"))


def test_integrity_check_catches_a_refcount_that_misses_an_owner():
    kv = manager()
    run(kv, "a", PREFIX + (1,))
    kv._device_tables["b"] = list(kv._device_tables["a"][:3])  # corrupt on purpose
    with pytest.raises(AssertionError):
        kv.check_integrity()


# -- the host tier as the second level --------------------------------------------------------
def written_through(kv: KVTierManager, rid: str, prompt: tuple[int, ...]) -> None:
    """Run `rid`'s prompt and copy its full blocks to the host (the copies done at step end)."""
    run(kv, rid, prompt)
    kv.plan_write_through([(rid, len(prompt))], budget_blocks=16)
    kv.end_step()


def test_a_finished_streams_written_through_blocks_stay_in_the_host_tier():
    kv = manager(device=4, host=8)
    prompt = tuple(range(9))  # 2 full blocks
    written_through(kv, "a", prompt)
    kv.drop("a")
    assert kv.allocate("other", 4 * BS)  # takes every device block: the device cache is gone
    hit = kv.find_prefix(prompt)
    assert hit.device_block_ids == () and len(hit.host_block_ids) == 2
    assert hit.num_host_load_blocks == 2
    assert kv.num_cached_host_blocks == 2
    kv.check_integrity()


def test_a_host_hit_is_loaded_behind_the_devices_run_and_shared_in_the_host_table():
    kv = manager(device=8, host=8)
    prompt = PREFIX + (1,)  # 3 full blocks
    written_through(kv, "a", prompt)
    host_blocks = tuple(kv._host_tables["a"])
    kv.drop("a")
    assert kv.allocate("other", 6 * BS)  # 5 plain blocks, then a's tail (released first)
    kv.drop("other")
    hit = kv.find_prefix(prompt)
    assert len(hit.device_block_ids) == 2 and hit.host_block_ids == host_blocks
    assert kv.allocate_with_prefix("b", len(prompt), hit, load_host=True)
    assert hit.num_cached_tokens(load_host=True) == 3 * BS
    assert kv.synced_tokens("b") == 3 * BS  # the host's blocks are its host table, shared
    copies = kv.plan_load("b", 3 * BS, budget_blocks=8)
    assert [(c.src_block_id, c.dst_block_id) for c in copies] == [
        (host_blocks[2], kv.device_block_ids("b")[2])
    ]  # only the block the device lacks
    assert kv.is_loaded("b", 3 * BS)
    kv.check_integrity()


def test_a_host_hit_not_loaded_is_computed_but_not_copied_again():
    kv = manager(device=4, host=8)
    prompt = tuple(range(9))
    written_through(kv, "a", prompt)
    kv.drop("a")
    assert kv.allocate("other", 4 * BS)
    kv.drop("other")
    hit = kv.find_prefix(prompt)
    assert kv.allocate_with_prefix("b", len(prompt), hit, load_host=False)
    assert hit.num_cached_tokens(load_host=False) == 0  # computed from its first token
    compute(kv, "b", prompt, len(prompt))
    assert kv.plan_write_through([("b", len(prompt))], budget_blocks=16) == []  # held already
    kv.check_integrity()


def test_a_block_the_host_caches_is_shared_not_copied_by_write_through_or_eviction():
    kv = manager(device=8, host=8)
    written_through(kv, "a", PREFIX + (1,))
    run(kv, "b", PREFIX + (2,))
    assert kv.plan_write_through([("b", len(PREFIX) + 1)], budget_blocks=16) == []
    assert kv._host_tables["b"] == kv._host_tables["a"][:3]
    plan = kv.evict("b", len(PREFIX) + 1)
    assert plan is not None and len(plan.copies) == 1  # only its partial tail
    kv.end_step()
    kv.check_integrity()


def test_a_device_eviction_keeps_the_host_copy():
    kv = manager(device=3, host=8)
    prompt = tuple(range(9))
    written_through(kv, "a", prompt)
    kv.drop("a")
    assert kv.allocate("other", 3 * BS)  # the device's cached blocks are reused
    assert kv.num_cached_device_blocks == 0 and kv.num_cached_host_blocks == 2
