"""The prefix cache of both tiers together: a prompt's cached runs, and the keys of its blocks.

With `KVConfig.prefix_caching` on, both tiers share blocks between requests whose tokens begin
alike (prefix_cache.py), and keep the blocks no request holds until their memory is needed, in
the order of `KVConfig.prefix_retention` (retention.py):
- the device: a request starting fresh takes the cached blocks of its prompt's leading full
  blocks (`find`, then `KVTierManager.allocate_with_prefix`); its computed full blocks are
  keyed as they fill (`key_device_blocks`);
- the host: a full block written through or evicted is keyed the same once its copy is done
  (`end_step`), and a block whose key the host holds already is shared, not copied
  (`share_host_block`).  A finished stream's blocks stay there, cached-free; a device block
  reused for other KV leaves its host copy.  A request starting fresh shares the host's run of
  its leading blocks as its host table, and may load the part the device lacks instead of
  computing it.
The host's run is looked up from block 0, as the device's: write-through copies a stream's
blocks in order and both retentions give a prefix's tail up before its head, so a prefix cached
in the host tier is (almost always) whole from its first block.

`PrefixTiers` owns, per request, the keys of its leading full blocks and how many of its device
blocks were offered them, and the keys of host copies in flight; `KVTierManager` owns the
tables and the free lists, and calls it when a request starts from a hit, fills blocks, copies
one to the host, or lets its blocks go.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from tokenflow.core.prefix_cache import PrefixCache, extend_chain


@dataclass(frozen=True)
class PrefixHit:
    """The leading full blocks of a prompt whose KV the tiers cache, each run from block 0."""

    block_hashes: tuple[int, ...]  # the keys of the longer run's blocks, in order
    device_block_ids: tuple[int, ...]  # cached on the device
    host_block_ids: tuple[int, ...]  # cached in the host tier
    block_size: int

    @property
    def num_device_tokens(self) -> int:
        """Leading tokens whose KV the device holds (shared at a start: no compute, no copy)."""
        return len(self.device_block_ids) * self.block_size

    @property
    def num_host_load_blocks(self) -> int:
        """Blocks after the device's run that the host holds (a start may load them)."""
        return max(len(self.host_block_ids) - len(self.device_block_ids), 0)

    def num_cached_tokens(self, load_host: bool) -> int:
        """Leading tokens a start need not compute: the device's run, and the host's beyond it
        when it loads them."""
        extra = self.num_host_load_blocks if load_host else 0
        return self.num_device_tokens + extra * self.block_size


class PrefixTiers:
    """The device's and the host's prefix caches, looked up together, and each request's keys."""

    def __init__(self, device: PrefixCache, host: PrefixCache, block_size: int) -> None:
        self.device = device
        self.host = host
        self.block_size = block_size
        # Per request: the keys of its leading full blocks (computed, or given by a hit), and
        # how many leading device table entries were offered a key.
        self._hashes: dict[str, list[int]] = {}
        self._device_keyed: dict[str, int] = {}
        self._host_keys_after_step: dict[int, int] = {}  # host block -> key, being copied to

    # -- a start from the cache ------------------------------------------------------------------
    def find(
        self, token_ids: Sequence[int], block_hashes: Sequence[int] | None = None
    ) -> PrefixHit:
        """The longest runs of `token_ids`' leading full blocks that each tier caches, capped to
        leave at least the last token to compute (its logits are needed).  `block_hashes`, the
        keys of its full blocks, if known (else they are hashed here)."""
        bs = self.block_size
        if block_hashes is None:
            hashes: list[int] = []
            extend_chain(hashes, token_ids, bs)
            block_hashes = hashes
        keys = block_hashes[: (len(token_ids) - 1) // bs]
        device_ids, host_ids = self.device.find(keys), self.host.find(keys)
        num_keys = max(len(device_ids), len(host_ids))
        return PrefixHit(tuple(keys[:num_keys]), tuple(device_ids), tuple(host_ids), bs)

    def cached_free_block_ids(self, hit: PrefixHit) -> tuple[int, ...]:
        """Device blocks of `hit` that no request holds."""
        device = self.device
        return tuple(b for b in hit.device_block_ids if device.is_cached_free(b))

    def num_cached_free_in(self, hit: PrefixHit) -> int:
        """Device blocks of `hit` that are cached-free (a start from it takes them out of the
        free memory).  ValueError if a block of either run lost its key since the lookup."""
        keys = hit.block_hashes
        num = self.device.num_cached_free_in(hit.device_block_ids, keys)
        self.host.num_cached_free_in(hit.host_block_ids, keys)  # (raises if stale)
        return num

    def start(self, request_id: str, hit: PrefixHit) -> None:
        """A request starts from `hit` (checked by `num_cached_free_in`): one more owner for
        each block of both runs, whose keys are the request's first ones."""
        self.device.share(hit.device_block_ids)
        if hit.host_block_ids:
            self.host.share(hit.host_block_ids)
        self._hashes[request_id] = list(hit.block_hashes)
        self._device_keyed[request_id] = len(hit.device_block_ids)

    # -- keying ------------------------------------------------------------------------------------
    def key_device_blocks(
        self,
        request_id: str,
        table: Sequence[int],
        num_computed_tokens: int,
        token_ids_from: Callable[[int, int], Sequence[int]],
    ) -> None:
        """Key the full blocks of the request's device `table` whose KV is in place (its first
        `num_computed_tokens` tokens) by the tokens `token_ids_from(position, count)` gives;
        hashes only the blocks filled since the last call."""
        num_full = num_computed_tokens // self.block_size
        keyed = self._device_keyed.get(request_id, 0)
        if num_full <= keyed:
            return
        hashes, bs = self._hashes.setdefault(request_id, []), self.block_size
        if len(hashes) < num_full:
            extend_chain(
                hashes, token_ids_from(len(hashes) * bs, (num_full - len(hashes)) * bs), bs
            )
        for index in range(keyed, num_full):
            self.device.key(table[index], hashes[index])
        self._device_keyed[request_id] = num_full

    def key_of(self, request_id: str, index: int) -> int | None:
        """The key of full block `index` of the request, if known (computed or given by a hit)."""
        hashes = self._hashes.get(request_id, ())
        return hashes[index] if index < len(hashes) else None

    def share_host_block(self, key: int) -> int | None:
        """The host block cached under `key`, with one more owner (a copy to the host tier
        shares it instead); None if the host caches no block under it."""
        block = self.host.block_of(key)
        if block is not None:
            self.host.share((block,))
        return block

    def key_host_block_after_step(self, block: int, key: int) -> None:
        """Host `block`, new to its owner, is being copied the KV keyed `key`: it is keyed once
        the step's copies are done (`end_step`)."""
        self._host_keys_after_step[block] = key

    def end_step(self) -> None:
        """The step's copies are done: the host blocks they filled are keyed."""
        host = self.host
        for block, key in self._host_keys_after_step.items():
            host.key(block, key)  # (still held: a block released meanwhile left the list)
        self._host_keys_after_step.clear()

    # -- leaving ---------------------------------------------------------------------------------
    def forget_host_blocks(self, blocks: Iterable[int]) -> None:
        """Host blocks went back to the plain free list: one whose copy is in flight is not
        keyed when it lands (the block may be reused first)."""
        pending = self._host_keys_after_step
        for block in blocks:
            pending.pop(block, None)

    def leave_device(self, request_id: str) -> None:
        """The request's device table is gone: the blocks it gets back are keyed anew."""
        self._device_keyed.pop(request_id, None)

    def forget(self, request_id: str) -> None:
        """The request is gone from both tiers: its keys are forgotten (the blocks keep theirs)."""
        self._hashes.pop(request_id, None)
        self._device_keyed.pop(request_id, None)
