"""The host KV connector on its own (no engine): plans, slot reuse, and the worker's copies."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

from tokenflow.integrations.vllm.host_kv import BlockCopy, HostKVConnector, HostKVMetadata

NUM_BLOCKS = 6
BLOCK_SIZE = 4


def make_connector(num_host_blocks: int = 4) -> HostKVConnector:
    transfer = SimpleNamespace(
        kv_connector_extra_config={"num_host_blocks": num_host_blocks}, is_kv_producer=True
    )
    vllm_config = SimpleNamespace(kv_transfer_config=transfer, additional_config={})
    spec = SimpleNamespace(block_size=BLOCK_SIZE, page_size_bytes=64)
    group = SimpleNamespace(kv_cache_spec=spec, layer_names=["l0", "l1"])
    kv_cache_config = SimpleNamespace(num_blocks=NUM_BLOCKS, kv_cache_groups=[group])
    return HostKVConnector(vllm_config, KVConnectorRole.SCHEDULER, kv_cache_config)


def fake_request(request_id: str, num_tokens: int) -> SimpleNamespace:
    return SimpleNamespace(request_id=request_id, num_tokens=num_tokens)


def fake_blocks(block_ids: list[int]) -> SimpleNamespace:
    return SimpleNamespace(get_block_ids=lambda: (block_ids,))


def test_store_then_load_plans_and_frees_slots_a_step_later():
    connector = make_connector()
    assert not connector.requires_kv_delivery
    assert connector.store("a", [3, 5], num_tokens=6)  # 2 blocks
    assert connector.host_tokens("a") == 6 and connector.num_free_host_blocks() == 2
    meta = connector.build_connector_meta(None)
    assert meta.stores == [BlockCopy(3, 0), BlockCopy(5, 1)] and meta.loads == []
    # Resume with vLLM's prefix cache holding the first block: only the second is loaded.
    request = fake_request("a", num_tokens=7)
    assert connector.get_num_new_matched_tokens(request, BLOCK_SIZE) == (2, False)
    connector.update_state_after_alloc(request, fake_blocks([1, 4]), 2)
    assert connector.host_tokens("a") == 0
    assert connector.num_free_host_blocks() == 2  # slots still read by this step's load
    meta = connector.build_connector_meta(None)
    assert meta.loads == [BlockCopy(4, 1)]
    assert connector.num_free_host_blocks() == 4


def test_full_host_or_short_blocks_fall_back_to_recompute():
    connector = make_connector(num_host_blocks=1)
    assert not connector.store("a", [1, 2], num_tokens=6)  # needs 2 host blocks
    assert not connector.store("b", [1], num_tokens=6)  # blocks do not cover the tokens
    assert connector.host_tokens("a") == connector.host_tokens("b") == 0
    assert connector.get_num_new_matched_tokens(fake_request("a", 7), 0) == (0, False)
    assert connector.build_connector_meta(None).stores == []


def test_finish_or_discard_frees_the_host_copy():
    connector = make_connector()
    connector.store("a", [1], num_tokens=3)
    connector.store("b", [2], num_tokens=3)
    connector.build_connector_meta(None)
    assert connector.request_finished(fake_request("a", 4), []) == (False, None)
    connector.discard("b")
    connector.build_connector_meta(None)
    assert connector.num_free_host_blocks() == 4
    assert connector.host_tokens("a") == connector.host_tokens("b") == 0


def test_worker_copies_blocks_out_and_back():
    connector = make_connector()
    # Two layers sharing one tensor (counted once) and one with the blocks in dimension 1.
    shared = torch.randn(NUM_BLOCKS, 2, BLOCK_SIZE, 8)
    kv_first = torch.randn(2, NUM_BLOCKS, BLOCK_SIZE, 8)
    connector.register_kv_caches({"l0": shared, "l0b": shared, "l1": kv_first})
    before = (shared[[3, 5]].clone(), kv_first[:, [3, 5]].clone())
    connector.handle_preemptions(HostKVMetadata(stores=[BlockCopy(3, 0), BlockCopy(5, 1)]))
    shared.zero_()
    kv_first.zero_()
    connector.bind_connector_metadata(HostKVMetadata(loads=[BlockCopy(1, 0), BlockCopy(2, 1)]))
    connector.start_load_kv(None)
    assert torch.equal(shared[[1, 2]], before[0])
    assert torch.equal(kv_first[:, [1, 2]], before[1])
    assert not shared[[0, 3, 4, 5]].any()


def test_copy_speed_is_measured_on_the_copy_path():
    assert make_connector().measure_copy_bytes_per_s() > 0
