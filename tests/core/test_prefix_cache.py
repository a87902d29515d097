"""The device prefix cache through `KVTierManager`, on small hand-built states (block size 4)."""

import pytest

from tokenflow.core.kv_manager import KVConfig, KVTierManager
from tokenflow.core.plan import CopyKind

BS = 4


def manager(device: int = 16, host: int = 16, prefix_caching: bool = True) -> KVTierManager:
    return KVTierManager(KVConfig(device, host, BS, block_bytes=100, prefix_caching=prefix_caching))


def start(kv: KVTierManager, rid: str, prompt: tuple[int, ...]) -> int:
    """Start `rid` as the scheduler does (lookup, then allocate); its cached tokens."""
    prefix = kv.find_cached_prefix(prompt)
    assert kv.allocate_with_prefix(rid, len(prompt), prefix)
    return prefix.num_tokens


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
    kv = manager(device=8)
    first, second = tuple(range(9)), tuple(range(50, 59))
    run(kv, "a", first)
    run(kv, "b", second)
    kv.drop("a")  # released first: its blocks are the least recent
    kv.drop("b")
    assert kv.num_free_device_blocks == 8  # 4 plain + 2 + 2 cached-free
    assert kv.allocate("c", 5 * BS)  # the 4 plain blocks, then one cached-free
    # a's blocks were released last to first: its tail block went first, its head survives
    assert kv.find_cached_prefix(first).num_tokens == BS
    assert kv.find_cached_prefix(second).num_tokens == 2 * BS
    assert kv.allocate("c", 7 * BS)  # a's head, then b's tail
    assert kv.find_cached_prefix(first).num_tokens == 0
    assert kv.find_cached_prefix(second).num_tokens == BS
    kv.check_integrity()


def test_a_prompt_diverging_inside_a_partial_block_shares_only_the_full_common_blocks():
    kv = manager()
    a = tuple(range(10))  # blocks [0..3] [4..7] full, [8, 9] partial (never cached)
    run(kv, "a", a)
    b = tuple(range(9)) + (99, 100)  # agrees with a on 9 tokens; its third block is partial
    assert run(kv, "b", b) == 2 * BS
    assert kv.device_block_ids("b")[2] != kv.device_block_ids("a")[2]
    compute(kv, "a", a + (10, 11), 12)  # a's third block fills: [8, 9, 10, 11]
    assert kv.find_cached_prefix(b + (101, 102)).num_tokens == 2 * BS  # [8, 99, 100, 101]
    assert kv.find_cached_prefix(a + (10, 11, 12)).num_tokens == 3 * BS


def test_a_block_is_found_only_behind_the_same_tokens():
    """Keys chain the whole prefix: equal blocks at different places are different KV."""
    kv = manager()
    run(kv, "a", (7, 7, 7, 7, 8, 8, 8, 8, 1))
    assert kv.find_cached_prefix((8, 8, 8, 8, 2)).num_tokens == 0
    assert kv.find_cached_prefix((6, 6, 6, 6, 8, 8, 8, 8, 2)).num_tokens == 0


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
    assert kv.find_cached_prefix(PREFIX + (3,)).block_ids == shared
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
    assert kv.find_cached_prefix(PREFIX + (3,)).block_ids == shared  # now cached-free
    kv.check_integrity()


def test_a_refused_start_changes_nothing():
    kv = manager(device=4)
    prompt = tuple(range(9))
    run(kv, "a", prompt)
    kv.drop("a")  # 2 cached-free + 2 plain
    longer = prompt[:8] + tuple(range(100, 109))  # 17 tokens: 2 shared + 3 new > 2 left
    prefix = kv.find_cached_prefix(longer)
    assert prefix.num_tokens == 2 * BS
    assert not kv.allocate_with_prefix("b", len(longer), prefix)
    assert kv.num_device_blocks_of("b") == 0 and kv.num_free_device_blocks == 4
    assert kv.find_cached_prefix(longer) == prefix
    kv.check_integrity()


def test_a_stale_prefix_is_refused():
    kv = manager(device=3)
    prompt = tuple(range(9))
    run(kv, "a", prompt)
    kv.drop("a")
    prefix = kv.find_cached_prefix(prompt)
    assert kv.allocate("other", 3 * BS)  # takes the cached-free blocks, forgetting their keys
    kv.drop("other")
    with pytest.raises(ValueError):
        kv.allocate_with_prefix("b", len(prompt), prefix)


def test_keying_hashes_only_the_blocks_filled_since_the_last_call():
    kv = manager()
    tokens = tuple(range(40))
    asked: list[int] = []

    def token_ids_from(position: int, count: int) -> tuple[int, ...]:
        asked.append(position)
        return tokens[position : position + count]

    assert kv.allocate("a", 40)
    kv.cache_full_blocks("a", 13, token_ids_from)
    assert asked == [0, 4, 8]
    kv.cache_full_blocks("a", 15, token_ids_from)  # no block filled
    kv.cache_full_blocks("a", 16, token_ids_from)
    assert asked == [0, 4, 8, 12]
    assert kv.find_cached_prefix(tokens).num_tokens == 16
    asked.clear()
    start(kv, "b", tokens[:20])  # shares 4 blocks, whose keys the lookup computed
    kv.cache_full_blocks("b", 20, token_ids_from)
    assert asked == [16]


def test_twins_computed_together_keep_the_first_block_and_the_second_stays_private():
    kv = manager(device=8)
    prompt = tuple(range(9))
    start(kv, "a", prompt)
    start(kv, "b", prompt)  # both start before either is computed: no hit
    compute(kv, "a", prompt, 9)
    compute(kv, "b", prompt, 9)
    assert kv.find_cached_prefix(prompt).block_ids == kv.device_block_ids("a")[:2]
    kv.drop("b")  # b's twins were never cached: back to the plain free list
    kv.check_integrity()
    assert kv.find_cached_prefix(prompt).block_ids == kv.device_block_ids("a")[:2]


def test_without_prefix_caching_nothing_is_found_or_cached():
    kv = manager(prefix_caching=False)
    run(kv, "a", PREFIX + (1,))
    assert kv.find_cached_prefix(PREFIX + (1,)).num_tokens == 0
    assert run(kv, "b", PREFIX + (1,)) == 0
    assert not set(kv.device_block_ids("a")) & set(kv.device_block_ids("b"))


def test_integrity_check_catches_a_refcount_that_misses_an_owner():
    kv = manager()
    run(kv, "a", PREFIX + (1,))
    kv._device_tables["b"] = list(kv._device_tables["a"][:3])  # corrupt on purpose
    with pytest.raises(AssertionError):
        kv.check_integrity()
