import pytest

from tokenflow.core.kv_manager import KVConfig, KVTierManager
from tokenflow.core.plan import CopyKind


def manager(device=8, host=8, block_size=4) -> KVTierManager:
    return KVTierManager(KVConfig(device, host, block_size, block_bytes=100))


def test_allocate_grows_and_refuses_without_side_effects():
    kv = manager(device=4)
    assert kv.allocate("a", 9)  # 3 blocks
    assert kv.num_device_blocks_of("a") == 3
    assert not kv.allocate("b", 8)  # needs 2, 1 free
    assert kv.num_device_blocks_of("b") == 0 and kv.num_free_device_blocks == 1
    kv.check_integrity()


def test_write_through_copies_only_full_blocks_in_candidate_order():
    kv = manager()
    kv.allocate("a", 10)  # blocks 0,1 full; 2 partial
    kv.allocate("b", 8)
    copies = kv.plan_write_through([("b", 8), ("a", 10)], budget_blocks=3)
    assert [(c.request_id, c.kind) for c in copies] == [
        ("b", CopyKind.WRITE_THROUGH),
        ("b", CopyKind.WRITE_THROUGH),
        ("a", CopyKind.WRITE_THROUGH),
    ]
    assert kv.synced_tokens("b") == 8 and kv.synced_tokens("a") == 4
    assert kv.plan_write_through([("b", 8)], budget_blocks=5) == []  # nothing new
    kv.check_integrity()


def test_evict_frees_synced_blocks_now_and_the_rest_after_the_step():
    kv = manager(device=6)
    kv.allocate("a", 10)
    kv.plan_write_through([("a", 10)], budget_blocks=1)  # block 0 synced
    free_before = kv.num_free_device_blocks
    plan = kv.evict("a", 10)
    assert plan is not None
    assert [c.kind for c in plan.copies] == [CopyKind.EVICT, CopyKind.EVICT]  # blocks 1 and 2
    assert kv.num_free_device_blocks == free_before + 1
    kv.check_integrity()
    kv.end_step()
    assert kv.num_free_device_blocks == 6
    assert kv.has_host_copy("a", 10)
    kv.check_integrity()


def test_evict_refuses_when_the_host_is_full():
    kv = manager(device=8, host=1)
    kv.allocate("a", 12)
    assert kv.evict("a", 12) is None
    assert kv.num_device_blocks_of("a") == 3
    kv.check_integrity()


def test_load_round_trip_keeps_block_mapping():
    kv = manager()
    kv.allocate("a", 12)
    evicted = kv.evict("a", 12)
    kv.end_step()
    host_of = {c.src_block_id: c.dst_block_id for c in evicted.copies}
    kv.allocate("other", 4)  # the device ids the request gets back differ
    assert kv.begin_load("a", 12)
    first = kv.plan_load("a", 12, budget_blocks=2)
    assert not kv.is_loaded("a", 12)
    rest = kv.plan_load("a", 12, budget_blocks=2)
    assert kv.is_loaded("a", 12)
    loads = first + rest
    assert [c.src_block_id for c in loads] == list(host_of.values())
    assert [c.dst_block_id for c in loads] == list(kv.device_block_ids("a"))
    kv.check_integrity()


def test_partial_tail_is_rewritten_after_resume():
    kv = manager()
    kv.allocate("a", 6)
    kv.evict("a", 6)  # host holds tokens 0..5, block 1 partial
    kv.end_step()
    kv.begin_load("a", 6)
    kv.plan_load("a", 6, 10)
    kv.allocate("a", 8)  # grows to fill block 1
    copies = kv.plan_write_through([("a", 8)], budget_blocks=4)
    assert len(copies) == 1 and kv.synced_tokens("a") == 8


def test_drop_releases_both_tiers():
    kv = manager()
    kv.allocate("a", 16)
    kv.plan_write_through([("a", 16)], budget_blocks=4)
    kv.drop("a")
    assert kv.num_free_device_blocks == 8 and kv.num_free_host_blocks == 8
    kv.check_integrity()


def test_integrity_check_catches_a_double_owned_block():
    kv = manager()
    kv.allocate("a", 4)
    kv._device_tables["b"] = list(kv._device_tables["a"])  # corrupt on purpose
    with pytest.raises(AssertionError):
        kv.check_integrity()


def test_begin_load_without_host_copy_is_an_error():
    kv = manager()
    with pytest.raises(ValueError):
        kv.begin_load("nobody", 4)


def test_without_offload_eviction_drops_and_nothing_is_written_through():
    kv = KVTierManager(KVConfig(8, 8, 4, block_bytes=100, offload=False))
    kv.allocate("a", 10)
    assert kv.plan_write_through([("a", 10)], budget_blocks=4) == []
    assert kv.evict("a", 10) is None  # the scheduler then drops the KV for recompute
    assert kv.num_device_blocks_of("a") == 3 and kv.num_free_host_blocks == 8
    kv.check_integrity()


def test_without_load_evict_overlap_synced_blocks_wait_for_the_eviction():
    kv = KVTierManager(KVConfig(6, 8, 4, block_bytes=100, free_synced_on_evict=False))
    kv.allocate("a", 10)
    kv.plan_write_through([("a", 10)], budget_blocks=2)  # blocks 0, 1 synced
    free_before = kv.num_free_device_blocks
    plan = kv.evict("a", 10)
    assert plan is not None and len(plan.copies) == 1  # only the tail is copied
    assert kv.num_free_device_blocks == free_before  # but nothing is reusable yet
    kv.check_integrity()
    kv.end_step()
    assert kv.num_free_device_blocks == 6
    kv.check_integrity()


@pytest.mark.parametrize("seed", range(4))
def test_queued_load_blocks_kept_on_events_equal_a_rescan(seed):
    """Loads begin, are planned in pieces, finish, or end early (freed, evicted, dropped):
    the kept count of blocks still to load equals the sum over the loads in flight."""
    import random

    rng = random.Random(seed)
    kv = manager(device=24, host=40)
    tokens: dict[str, int] = {}  # request -> tokens of its KV
    where: dict[str, str] = {}  # request -> "device", "host" or "loading"
    for _ in range(600):
        rid = f"r{rng.randrange(8)}"
        state = where.get(rid)
        if state is None and kv.allocate(rid, n := rng.randint(1, 20)):
            tokens[rid], where[rid] = n, "device"
        elif state == "device" and kv.evict(rid, tokens[rid]) is not None:
            where[rid] = "host"
        elif state == "host" and kv.begin_load(rid, tokens[rid]):
            where[rid] = "loading"
        elif state == "loading" and rng.random() < 0.6:
            kv.plan_load(rid, tokens[rid], rng.randint(1, 3))
            if kv.is_loaded(rid, tokens[rid]) and rng.random() < 0.5:
                where[rid] = "device"  # loaded and running: its entry stays until it leaves
        elif state == "loading":
            kv.free_device(rid)  # preempted while loading: the host copy stays
            where[rid] = "host"
        elif state is not None and rng.random() < 0.2:
            kv.drop(rid)
            del where[rid]
        kv.end_step()
        loading = [r for r, s in where.items() if s == "loading"]
        rescan = sum(kv.num_blocks_to_load(r, tokens[r]) for r in loading)
        assert kv.num_queued_load_blocks == rescan
        kv.check_integrity()
