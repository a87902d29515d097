"""The two KV tiers as memory: device blocks the model reads and writes, host blocks for offload.

Each tier is one tensor `[num_layers, 2 (K, V), num_blocks, block_size, num_kv_heads, head_dim]`,
so a layer's K (or V) is the contiguous view `[num_blocks, block_size, num_kv_heads, head_dim]`
and moving a set of blocks between tiers, all layers at once, is one `index_select` plus one
`index_copy_` along the block axis.  The core's KV manager decides which blocks move; this module
only moves them.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch

from tokenflow.core.plan import BlockCopy
from tokenflow.model.attention import LayerKV
from tokenflow.model.config import ModelConfig

_BLOCK_AXIS = 2


def bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block takes in one tier: K and V of `block_size` tokens over all layers."""
    element_size = torch.empty((), dtype=dtype).element_size()
    return config.kv_elements_per_token * block_size * element_size


def blocks_for_bytes(
    config: ModelConfig, block_size: int, dtype: torch.dtype, num_bytes: int
) -> int:
    """How many whole blocks fit in `num_bytes` (0 if not even one)."""
    return max(int(num_bytes) // bytes_per_block(config, block_size, dtype), 0)


def available_memory_bytes(device: torch.device) -> int:
    """Free memory now: on CUDA what the driver reports, on CPU the available physical pages."""
    if device.type == "cuda":
        free_bytes, _ = torch.cuda.mem_get_info(device)
        return int(free_bytes)
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


class TieredKVCache:
    """Device and host KV blocks, and the copies between them."""

    def __init__(
        self,
        config: ModelConfig,
        num_device_blocks: int,
        num_host_blocks: int,
        block_size: int,
        device: torch.device | str,
        dtype: torch.dtype,
    ) -> None:
        if num_device_blocks < 1 or num_host_blocks < 0 or block_size < 1:
            raise ValueError(
                f"need >= 1 device block, >= 0 host blocks and block_size >= 1; got "
                f"{num_device_blocks}, {num_host_blocks}, {block_size}"
            )
        self.config = config
        self.block_size = block_size
        self.device = torch.device(device)
        self.dtype = dtype
        shape = (config.num_layers, 2, block_size, config.num_kv_heads, config.head_dim)
        self.device_kv = torch.zeros(
            _with_blocks(shape, num_device_blocks), dtype=dtype, device=device
        )
        pin = self.device.type == "cuda"
        self.host_kv = torch.zeros(
            _with_blocks(shape, num_host_blocks), dtype=dtype, pin_memory=pin
        )
        # Per-layer views handed to the model; they share storage with device_kv.
        self.device_layers = [
            LayerKV(self.device_kv[layer, 0], self.device_kv[layer, 1])
            for layer in range(config.num_layers)
        ]

    @property
    def num_device_blocks(self) -> int:
        return self.device_kv.shape[_BLOCK_AXIS]

    @property
    def num_host_blocks(self) -> int:
        return self.host_kv.shape[_BLOCK_AXIS]

    def apply_copies(
        self, device_to_host: Sequence[BlockCopy], host_to_device: Sequence[BlockCopy]
    ) -> None:
        """Perform a step's copies: device -> host first, then host -> device.

        That order keeps an eviction correct if the KV manager hands an evicted device block to a
        load in the same step.  On CUDA the work is queued on the current stream and waited for
        before returning; call it under `torch.cuda.stream(copy_stream)` to overlap a forward.
        """
        if device_to_host:
            self._copy_to_host(device_to_host)
        if host_to_device:
            self._copy_to_device(host_to_device)

    def _copy_to_host(self, copies: Sequence[BlockCopy]) -> None:
        src = self._ids(copies, "src", self.num_device_blocks, self.device)
        dst = self._ids(copies, "dst", self.num_host_blocks, torch.device("cpu"))
        gathered = self.device_kv.index_select(_BLOCK_AXIS, src)  # [L, 2, n, bs, kvh, D]
        if self.device.type == "cuda":
            staging = torch.empty(gathered.shape, dtype=self.dtype, pin_memory=True)
            staging.copy_(gathered, non_blocking=True)
            torch.cuda.current_stream(self.device).synchronize()
            gathered = staging
        self.host_kv.index_copy_(_BLOCK_AXIS, dst, gathered)

    def _copy_to_device(self, copies: Sequence[BlockCopy]) -> None:
        src = self._ids(copies, "src", self.num_host_blocks, torch.device("cpu"))
        dst = self._ids(copies, "dst", self.num_device_blocks, self.device)
        gathered = self.host_kv.index_select(_BLOCK_AXIS, src)  # [L, 2, n, bs, kvh, D]
        if self.device.type == "cuda":
            gathered = gathered.pin_memory().to(self.device, non_blocking=True)
        self.device_kv.index_copy_(_BLOCK_AXIS, dst, gathered)
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    @staticmethod
    def _ids(
        copies: Sequence[BlockCopy], side: str, num_blocks: int, device: torch.device
    ) -> torch.Tensor:
        ids = [c.src_block_id if side == "src" else c.dst_block_id for c in copies]
        bad = [i for i in ids if not 0 <= i < num_blocks]
        if bad:
            raise IndexError(f"{side} block ids {bad} out of range [0, {num_blocks})")
        return torch.tensor(ids, dtype=torch.long).to(device)


def _with_blocks(shape: tuple[int, ...], num_blocks: int) -> tuple[int, ...]:
    return (*shape[:_BLOCK_AXIS], num_blocks, *shape[_BLOCK_AXIS:])
