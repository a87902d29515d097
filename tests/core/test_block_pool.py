from tokenflow.core.block_pool import BlockPool
from tokenflow.core.prefix_cache import PrefixCache
from tokenflow.core.retention import NOT_EXPECTED, make_retention


def cached_pool(num_blocks: int = 4) -> BlockPool:
    cache = PrefixCache("device", num_blocks, make_retention("lru", 10.0))
    return BlockPool("device", num_blocks, cache)


def test_plain_pool_takes_low_ids_first_and_gives_back_tail_first():
    pool = BlockPool("host", 4, None)
    table: list[int] = []
    pool.take(table, 3, now_s=0.0)
    assert table == [0, 1, 2] and pool.num_free == 1
    assert pool.release(table, NOT_EXPECTED, now_s=0.0) == [2, 1, 0]
    assert pool.take_one(now_s=0.0) == 0  # (the head, released last, is taken first)
    pool.check([[0]], ())


def test_cached_block_stays_cached_free_and_is_reused_after_plain_ones():
    pool = cached_pool()
    table: list[int] = []
    pool.take(table, 2, now_s=0.0)
    assert pool.cache is not None
    pool.cache.key(table[0], key=123)
    assert pool.release(table, NOT_EXPECTED, now_s=1.0) == [1]  # block 0 stays cached-free
    assert pool.num_free == 4 and pool.cache.is_cached_free(0)
    pool.check([], ())
    again: list[int] = []
    pool.take(again, 4, now_s=2.0)
    assert again == [1, 2, 3, 0]  # plain free ones first, then the cached-free one
    assert pool.cache.block_of(123) is None  # (reuse forgets its key)
    pool.check([again], ())


def test_pinned_blocks_count_as_owned_until_released():
    pool = cached_pool()
    table: list[int] = []
    pool.take(table, 2, now_s=0.0)
    pool.check([], table)  # (an eviction's copies still read them)
    pool.release_pinned(table, [NOT_EXPECTED, NOT_EXPECTED], now_s=0.0)
    assert pool.num_free == 4
    pool.check([], ())
