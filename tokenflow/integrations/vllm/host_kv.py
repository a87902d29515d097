"""`HostKVConnector`: a small vLLM KV connector that keeps a paused stream's KV in host memory.

vLLM 0.32's own offloading connectors do not run on its CPU platform (`OffloadingConnector`'s
`CPUOffloadingSpec.get_worker` raises unless the platform is CUDA-alike or XPU, and
`SimpleCPUOffloadConnector`'s worker creates `torch.cuda.Stream`s and pins with
`cudaHostRegister`); see docs/vllm.md.  This connector does one thing, synchronously, on any
platform: when `TokenFlowScheduler` pauses a stream with an OFFLOAD move, it copies the stream's
blocks to a host buffer, and when vLLM resumes the stream it loads them back instead of
recomputing them.  Nothing is in flight between steps, so a paused or resumed stream never has a
pending transfer (the bug class of vllm#46014 cannot arise).

Order within one engine step (all in the worker, before the forward pass):

1. `handle_preemptions`: stores (device block -> host slot) of the streams paused this step.
   It runs before vLLM zeroes or reuses the freed blocks, so their KV is still intact.
2. `start_load_kv`: loads (host slot -> device block) of the streams resumed this step.

A host slot freed by a load is reused only from the next step on, so a store never overwrites a
slot that a load of the same step still reads.

Enable with `--kv-transfer-config` set to `serve.host_kv_transfer_config()` (`serve` adds it).  Host
capacity: `kv_connector_extra_config.num_host_blocks`, else `host_factor` x the device pool.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.logger import init_logger

from tokenflow.integrations.vllm.settings import IntegrationSettings

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

logger = init_logger("vllm.tokenflow.host_kv")
CONNECTOR_NAME = "HostKVConnector"


@dataclass(frozen=True)
class BlockCopy:
    """One block copy between a device block and a host slot."""

    device_block_id: int
    host_slot_id: int


@dataclass
class HostKVMetadata(KVConnectorMetadata):
    """This step's copies, in the order the worker performs them: stores, then loads."""

    stores: list[BlockCopy] = field(default_factory=list)
    loads: list[BlockCopy] = field(default_factory=list)


@dataclass(frozen=True)
class HostCopy:
    """A paused stream's KV in host memory: its first `num_tokens` tokens, block by block."""

    num_tokens: int
    host_slot_ids: tuple[int, ...]


class HostKVConnector(KVConnectorBase_V1):
    """Store a paused stream's blocks on the host; load them back when it resumes."""

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        if len(kv_cache_config.kv_cache_groups) != 1:
            raise ValueError(f"{CONNECTOR_NAME} supports models with one KV cache group")
        self.block_size = kv_cache_config.kv_cache_groups[0].kv_cache_spec.block_size
        self.block_bytes = kv_block_bytes(kv_cache_config)
        self.num_device_blocks = kv_cache_config.num_blocks
        extra = self._kv_transfer_config.kv_connector_extra_config or {}
        settings = IntegrationSettings.from_additional_config(vllm_config.additional_config)
        default_host = int((self.num_device_blocks - 1) * settings.host_factor)
        self.num_host_blocks = int(extra.get("num_host_blocks", default_host))
        # scheduler side
        self._free_slots = list(range(self.num_host_blocks - 1, -1, -1))
        self._copies: dict[str, HostCopy] = {}
        self._plan = HostKVMetadata()
        self._slots_to_free: list[int] = []
        self._local_hit_tokens: dict[str, int] = {}  # vLLM's prefix-cache hit, last asked
        self.num_stored_blocks = 0
        self.num_loaded_blocks = 0
        # worker side: per distinct KV tensor, (device tensor, host tensor, block dim)
        self._pairs: list[tuple[torch.Tensor, torch.Tensor, int]] = []

    @property
    def requires_kv_delivery(self) -> bool:
        """A dropped store is a recompute later, never lost output."""
        return False

    # -- scheduler side: called by TokenFlowScheduler ------------------------------------------
    def num_free_host_blocks(self) -> int:
        """Host slots free for new stores."""
        return len(self._free_slots)

    @property
    def num_host_copies(self) -> int:
        """Paused streams whose KV is on the host now."""
        return len(self._copies)

    def host_tokens(self, request_id: str) -> int:
        """Tokens of `request_id` whose KV is on the host (0: none)."""
        copy = self._copies.get(request_id)
        return copy.num_tokens if copy else 0

    def store(self, request_id: str, device_block_ids: list[int], num_tokens: int) -> bool:
        """Plan the store of a stream about to be paused (before vLLM frees its blocks).

        False, planning nothing, when the host is full or the blocks do not cover the tokens:
        the caller then pauses by recompute."""
        num_blocks = -(-num_tokens // self.block_size)
        if num_tokens <= 0 or num_blocks > len(device_block_ids):
            return False
        self.discard(request_id)
        if num_blocks > len(self._free_slots):
            return False
        slots = tuple(self._free_slots.pop() for _ in range(num_blocks))
        self._copies[request_id] = HostCopy(num_tokens, slots)
        self._plan.stores.extend(map(BlockCopy, device_block_ids[:num_blocks], slots))
        self.num_stored_blocks += num_blocks
        return True

    def discard(self, request_id: str) -> None:
        """Forget a stream's host copy (finished, aborted, or resumed by recompute)."""
        self._local_hit_tokens.pop(request_id, None)
        copy = self._copies.pop(request_id, None)
        if copy is not None:
            self._slots_to_free.extend(copy.host_slot_ids)

    # -- scheduler side: vLLM's connector interface --------------------------------------------
    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int, bool]:
        """Tokens the host copy adds beyond vLLM's local prefix-cache hit (loaded in sync)."""
        copy = self._copies.get(request.request_id)
        if copy is None:
            return 0, False
        # At least one token is left to compute, so the step samples the next one.
        usable = min(copy.num_tokens, request.num_tokens - 1)
        self._local_hit_tokens[request.request_id] = num_computed_tokens
        return max(0, usable - num_computed_tokens), False

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        """vLLM allocated the resumed stream's blocks: plan the loads, release the host copy."""
        copy = self._copies.get(request.request_id)
        local = self._local_hit_tokens.pop(request.request_id, 0)
        if copy is None:
            return
        if num_external_tokens > 0:
            block_ids = blocks.get_block_ids()[0]
            first = local // self.block_size
            end = -(-(local + num_external_tokens) // self.block_size)
            pairs = zip(block_ids[first:end], copy.host_slot_ids[first:end], strict=True)
            self._plan.loads.extend(BlockCopy(b, s) for b, s in pairs)
            self.num_loaded_blocks += end - first
        self.discard(request.request_id)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        """Hand this step's copies to the worker; slots released this step become free."""
        plan, self._plan = self._plan, HostKVMetadata()
        self._free_slots.extend(reversed(self._slots_to_free))
        self._slots_to_free.clear()
        return plan

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, None]:
        """Finished or aborted: drop its host copy; vLLM frees the device blocks at once."""
        self.discard(request.request_id)
        return False, None

    # -- worker side ---------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Allocate the host buffer: one host tensor per distinct device KV tensor."""
        seen: set[int] = set()
        for tensor in kv_caches.values():
            if tensor.data_ptr() in seen:
                continue  # layers sharing one cache tensor
            seen.add(tensor.data_ptr())
            dim = 0 if tensor.shape[0] == self.num_device_blocks else 1
            if tensor.shape[dim] != self.num_device_blocks:
                raise ValueError(f"{CONNECTOR_NAME}: no block dimension in {tuple(tensor.shape)}")
            shape = list(tensor.shape)
            shape[dim] = max(1, self.num_host_blocks)
            host = torch.empty(shape, dtype=tensor.dtype, device="cpu")
            self._pairs.append((tensor, host, dim))
        logger.info(
            "%s: %d host blocks (%.1f MiB)",
            CONNECTOR_NAME,
            self.num_host_blocks,
            self.num_host_blocks * self.block_bytes / 2**20,
        )

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        """Stores, before this step reuses or zeroes the paused streams' blocks."""
        assert isinstance(kv_connector_metadata, HostKVMetadata)
        self._copy(kv_connector_metadata.stores, to_host=True)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        """Loads, before the forward pass that reads them."""
        metadata = self._get_connector_metadata()
        assert isinstance(metadata, HostKVMetadata)
        self._copy(metadata.loads, to_host=False)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Loads are synchronous: nothing to wait for."""

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs: Any) -> None:
        """Stores happen on pause, not per layer."""

    def wait_for_save(self) -> None:
        """Stores are synchronous: nothing to wait for."""

    def _copy(self, copies: list[BlockCopy], to_host: bool) -> None:
        copy_blocks(self._pairs, copies, to_host)

    def measure_copy_bytes_per_s(self, num_blocks: int = 4, repeats: int = 3) -> float:
        """Speed (bytes/s) of this connector's store path, timed on scratch tensors shaped like
        one block per layer.  On vLLM's CPU platform the KV pool is host memory, so this is
        what a pause's store and a resume's load cost (each direction)."""
        num_layers = len(self._kv_cache_config.kv_cache_groups[0].layer_names)
        page_bytes = self.block_bytes // max(1, num_layers)
        pairs = [
            (torch.ones(num_blocks, page_bytes, dtype=torch.uint8),
             torch.empty(num_blocks, page_bytes, dtype=torch.uint8), 0)
            for _ in range(num_layers)
        ]  # fmt: skip
        copies = [BlockCopy(i, num_blocks - 1 - i) for i in range(num_blocks)]
        best_s = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            copy_blocks(pairs, copies, to_host=True)
            best_s = min(best_s, time.perf_counter() - start)
        return num_blocks * self.block_bytes / max(best_s, 1e-9)


def kv_block_bytes(kv_cache_config: KVCacheConfig) -> int:
    """Bytes of one block of the first KV cache group: all its layers, K and V."""
    group = kv_cache_config.kv_cache_groups[0]
    return group.kv_cache_spec.page_size_bytes * len(group.layer_names)


def copy_blocks(
    pairs: list[tuple[torch.Tensor, torch.Tensor, int]], copies: list[BlockCopy], to_host: bool
) -> None:
    """Copy blocks between each (device tensor, host tensor, block dimension) pair."""
    if not copies:
        return
    device_ids = [c.device_block_id for c in copies]
    host_ids = torch.tensor([c.host_slot_id for c in copies])
    for device, host, dim in pairs:
        device_index = torch.tensor(device_ids, device=device.device)
        if to_host:
            rows = device.index_select(dim, device_index).to("cpu")
            host.index_copy_(dim, host_ids, rows)
        else:
            rows = host.index_select(dim, host_ids).to(device.device)
            device.index_copy_(dim, device_index, rows)
