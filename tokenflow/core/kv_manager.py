"""Paged KV blocks in two tiers: the device (accelerator) and the host (CPU memory).

The manager owns block ids, never memory: it returns `BlockCopy` plans that an executor performs.

Per request it keeps a device block table, a host block table and `synced_tokens`, the number of
leading tokens whose KV has a current copy in the host tier.  The host tier is a write-through
cache behind the device: full blocks of running requests are copied as the write budget allows,
so an eviction only has to copy the unsynced tail, and frees the synced blocks at once.

With `KVConfig.prefix_caching` on, both tiers share blocks between requests whose tokens begin
alike and keep the blocks no request holds until their memory is needed: the lookup of a
prompt's cached runs, a start from them and the keys of each request's blocks are
prefix_tiers.py; each tier's free blocks, plain and cached-free, are block_pool.py.

Invariants (`check_integrity`): per tier free + owned == total; no block owned twice (without
prefix caching) or a block's reference count equals its owners (with it); no block both free and
owned; synced_tokens never exceeds what the host table covers.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from itertools import repeat

from tokenflow.core.block_pool import BlockPool
from tokenflow.core.plan import BlockCopy, CopyKind
from tokenflow.core.prefix_cache import RETENTIONS, PrefixCache
from tokenflow.core.prefix_summary import PrefixSummary
from tokenflow.core.prefix_tiers import PrefixHit, PrefixTiers
from tokenflow.core.retention import NOT_EXPECTED, make_retention

__all__ = ["EvictionPlan", "KVConfig", "KVTierManager", "PrefixHit"]


@dataclass(frozen=True)
class KVConfig:
    """Sizes of the two tiers, in blocks of `block_size` tokens."""

    num_device_blocks: int
    num_host_blocks: int
    block_size: int = 16
    block_bytes: int = 1  # bytes of one block, all layers, K and V (copy budgets are in bytes)
    # Mechanism switches (ablations of the paper's §5-6; the defaults are the paper's design):
    offload: bool = True  # False: an eviction drops the KV (recompute) and nothing is written
    free_synced_on_evict: bool = True  # False: a victim's blocks wait for its whole eviction
    # Share full device blocks between requests with a common prefix (prefix_cache.py); off,
    # every block has one owner and every path is as it was before the cache existed.
    prefix_caching: bool = False
    # Which cached blocks no request holds are reused first (prefix_cache.py): "reading" by the
    # readers' expected next turn, "lru" least recently released first (vLLM's rule).
    prefix_retention: str = "reading"
    # Think time the reading rule expects between a reader's last token read and the next turn.
    expected_think_s: float = 10.0

    def __post_init__(self) -> None:
        if self.num_device_blocks < 1:
            raise ValueError(f"num_device_blocks must be >= 1, got {self.num_device_blocks}")
        if self.num_host_blocks < 0:
            raise ValueError(f"num_host_blocks must be >= 0, got {self.num_host_blocks}")
        if self.block_size < 1 or self.block_bytes < 1:
            raise ValueError("block_size and block_bytes must be >= 1")
        if self.prefix_retention not in RETENTIONS:
            raise ValueError(
                f"prefix_retention must be one of {', '.join(RETENTIONS)}, "
                f"got {self.prefix_retention!r}"
            )
        if not self.expected_think_s >= 0:
            raise ValueError(f"expected_think_s must be >= 0, got {self.expected_think_s}")


@dataclass(frozen=True)
class EvictionPlan:
    """What offloading a request takes: the copies of its unsynced blocks (their device blocks
    are released at `end_step()`; the synced ones were released at once)."""

    copies: tuple[BlockCopy, ...]


class KVTierManager:
    """Block accounting for the device and host tiers (pure bookkeeping)."""

    def __init__(self, config: KVConfig) -> None:
        self.config = config
        self.block_size = config.block_size
        self._device_tables: dict[str, list[int]] = {}
        self._host_tables: dict[str, list[int]] = {}
        self._synced_tokens: dict[str, int] = {}
        self._loaded_blocks: dict[str, int] = {}  # request -> leading blocks already loaded
        self._load_blocks: dict[str, int] = {}  # request -> blocks its load copies in all
        self._num_blocks_to_load = 0  # of the loads in flight, blocks not yet planned
        self._release_after_step: list[int] = []  # device blocks whose eviction copy is in flight
        self._return_after_step: list[float] = []  # when the evicting owners expect them back
        self._prefix: PrefixCache | None = None  # the device's prefix cache
        self._host_prefix: PrefixCache | None = None
        self._tiers: PrefixTiers | None = None  # both, with each request's keys
        if config.prefix_caching:
            patience_s = config.expected_think_s
            retention = config.prefix_retention
            self._prefix = PrefixCache(
                "device", config.num_device_blocks, make_retention(retention, patience_s)
            )
            self._host_prefix = PrefixCache(
                "host", config.num_host_blocks, make_retention(retention, patience_s)
            )
            self._tiers = PrefixTiers(self._prefix, self._host_prefix, config.block_size)
        self._device_pool = BlockPool("device", config.num_device_blocks, self._prefix)
        self._host_pool = BlockPool("host", config.num_host_blocks, self._host_prefix)
        self._now_s = 0.0  # the time retention ranks by (`set_time`)

    # -- queries -----------------------------------------------------------------------------------
    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold `num_tokens` tokens."""
        return -(-num_tokens // self.block_size)

    @property
    def num_free_device_blocks(self) -> int:
        """Device blocks allocation may take: plain free ones and cached-free ones."""
        return self._device_pool.num_free

    @property
    def num_free_host_blocks(self) -> int:
        """Host blocks allocation may take: plain free ones and cached-free ones."""
        return self._host_pool.num_free

    @property
    def num_cached_device_blocks(self) -> int:
        """Device blocks the prefix cache keys (held or cached-free); 0 without caching."""
        return 0 if self._prefix is None else self._prefix.num_cached

    @property
    def num_cached_host_blocks(self) -> int:
        """Host blocks the prefix cache keys (held or cached-free); 0 without caching."""
        return 0 if self._host_prefix is None else self._host_prefix.num_cached

    def prefix_summary(self, max_keys_per_tier: int) -> PrefixSummary:
        """The sampled keys each tier caches, for the router (prefix_summary.py); empty
        without prefix caching."""
        if self._prefix is None or self._host_prefix is None:
            return PrefixSummary()
        return PrefixSummary(
            device_block_hashes=self._prefix.recent_keys(max_keys_per_tier),
            host_block_hashes=self._host_prefix.recent_keys(max_keys_per_tier),
        )

    @property
    def device_usage(self) -> float:
        """Fraction of device blocks not free (including blocks of evictions in flight)."""
        return 1.0 - self.num_free_device_blocks / self.config.num_device_blocks

    @property
    def host_usage(self) -> float:
        total = self.config.num_host_blocks
        return 0.0 if total == 0 else 1.0 - self.num_free_host_blocks / total

    def device_block_ids(self, request_id: str) -> tuple[int, ...]:
        return tuple(self._device_tables.get(request_id, ()))

    @property
    def device_tables(self) -> Mapping[str, list[int]]:
        """Every live device table by request id (hot paths): read them, never modify them."""
        return self._device_tables

    def num_device_blocks_of(self, request_id: str) -> int:
        return len(self._device_tables.get(request_id, ()))

    def num_private_device_blocks(self, request_id: str) -> int:
        """Device blocks of a request that no other owner holds (what pausing it frees)."""
        table, cache = self._device_tables.get(request_id, ()), self._prefix
        if cache is None:
            return len(table)
        return sum(1 for block in table if cache.refcount(block) == 1)

    def num_charged_device_blocks(self, request_id: str) -> float:
        """A request's device blocks, each at 1 / its owners: summed over every owner, a shared
        block counts once."""
        table, cache = self._device_tables.get(request_id, ()), self._prefix
        if cache is None:
            return float(len(table))
        return sum(1.0 / cache.refcount(block) for block in table)

    def cached_free_block_ids(self, hit: PrefixHit) -> tuple[int, ...]:
        """Device blocks of `hit` that no request holds (a start sharing them takes them out
        of the free memory)."""
        return () if self._tiers is None else self._tiers.cached_free_block_ids(hit)

    def synced_tokens(self, request_id: str) -> int:
        return self._synced_tokens.get(request_id, 0)

    def has_host_copy(self, request_id: str, num_tokens: int) -> bool:
        """True when the host tier holds the KV of the first `num_tokens` tokens."""
        return num_tokens > 0 and self._synced_tokens.get(request_id, 0) >= num_tokens

    def has_unsynced_full_block(self, request_id: str, num_tokens: int) -> bool:
        """True when write-through has a full block of this request left to copy."""
        return (
            num_tokens // self.block_size
            > self._synced_tokens.get(request_id, 0) // self.block_size
        )

    @property
    def num_evicting_blocks(self) -> int:
        """Device blocks whose eviction copy is queued this step (the eviction queue)."""
        return len(self._release_after_step)

    def num_blocks_to_load(self, request_id: str, num_tokens: int) -> int:
        """Blocks of a loading request not yet planned for copying (0 if it is not loading)."""
        if request_id not in self._loaded_blocks:
            return 0
        return self.blocks_for(num_tokens) - self._loaded_blocks[request_id]

    @property
    def num_queued_load_blocks(self) -> int:
        """Blocks of all loads in flight not yet planned for copying (kept on events: a load
        begins, is planned, or ends early by a free, an eviction or a drop)."""
        return self._num_blocks_to_load

    # -- device allocation ------------------------------------------------------------------------
    def allocate(self, request_id: str, num_tokens: int) -> bool:
        """Grow the device table to cover `num_tokens` tokens; False (and no change) if full."""
        table = self._device_tables.setdefault(request_id, [])
        if num_tokens <= len(table) * self.block_size:  # the common decode step
            return True
        missing = self.blocks_for(num_tokens) - len(table)
        if missing > self.num_free_device_blocks:
            if not table:
                del self._device_tables[request_id]
            return False
        self._device_pool.take(table, missing, self._now_s)
        return True

    # -- prefix cache (prefix_tiers.py) -----------------------------------------------------------
    def set_time(self, now_s: float) -> None:
        """The time retention ranks cached-free blocks by (the scheduler sets it each step)."""
        self._now_s = now_s

    def find_prefix(
        self, token_ids: Sequence[int], block_hashes: Sequence[int] | None = None
    ) -> PrefixHit:
        """The longest runs of `token_ids`' leading full blocks that each tier caches, capped to
        leave at least the last token to compute (its logits are needed); empty without prefix
        caching.  `block_hashes`, the keys of its full blocks, if known (else they are hashed
        here).  Pure: pass it to `allocate_with_prefix` before any other change."""
        if self._tiers is None:
            return PrefixHit((), (), (), self.block_size)
        return self._tiers.find(token_ids, block_hashes)

    def allocate_with_prefix(
        self, request_id: str, num_tokens: int, hit: PrefixHit, load_host: bool = False
    ) -> bool:
        """Start a request's tables from `hit`: its device table with the shared device blocks
        (their KV needs no compute), then blocks up to `num_tokens` tokens; its host table with
        the shared host blocks (write-through need not copy them).  With `load_host`, the host
        blocks after the device's run are loaded as a resume's are (`plan_load`).  False,
        changing nothing, if the blocks do not fit.  ValueError if the request has a table
        already or `hit` is stale."""
        if request_id in self._device_tables:
            raise ValueError(f"request {request_id} already has device blocks")
        tiers = self._tiers
        if tiers is None:
            return self.allocate(request_id, num_tokens)
        shared = hit.device_block_ids
        num_free = self.num_free_device_blocks - tiers.num_cached_free_in(hit)
        missing = max(self.blocks_for(num_tokens) - len(shared), 0)
        if missing > num_free:
            return False
        tiers.start(request_id, hit)  # (takes the shared blocks out of the free memory first)
        table = self._device_tables[request_id] = list(shared)
        self._device_pool.take(table, missing, self._now_s)
        if hit.host_block_ids:
            self._host_tables[request_id] = list(hit.host_block_ids)
            self._synced_tokens[request_id] = len(hit.host_block_ids) * self.block_size
        if load_host and hit.num_host_load_blocks:
            self._loaded_blocks[request_id] = len(shared)
            self._load_blocks[request_id] = len(hit.host_block_ids)
            self._num_blocks_to_load += hit.num_host_load_blocks
        return True

    def cache_full_blocks(
        self,
        request_id: str,
        num_computed_tokens: int,
        token_ids_from: Callable[[int, int], Sequence[int]],
    ) -> None:
        """Cache the request's full device blocks whose KV is in place (its first
        `num_computed_tokens` tokens), keyed by the tokens `token_ids_from(position, count)`
        gives; call after each step that computed tokens of it (hashes only the blocks filled
        since the last call).  A no-op without prefix caching or a device table."""
        tiers, table = self._tiers, self._device_tables.get(request_id)
        if tiers is not None and table is not None:
            tiers.key_device_blocks(request_id, table, num_computed_tokens, token_ids_from)

    def _host_block_for(
        self, request_id: str, index: int, host: list[int]
    ) -> tuple[int, bool] | None:
        """(the host block that is to hold block `index` of a request, whether it must be
        copied there), the block appended to its table `host` if past its end; None when the
        host tier is full.  A full block whose key the host caches is shared, not copied; one
        copied to a new host block is keyed once the copy is done (`end_step`)."""
        tiers = self._tiers
        if index < len(host):  # (a tail an eviction copied, or a block a hit shared: cached)
            block = host[index]
            return block, tiers is None or not tiers.host.is_cached(block)
        key = None if tiers is None else tiers.key_of(request_id, index)
        if key is not None and tiers is not None:
            cached = tiers.share_host_block(key)
            if cached is not None:
                host.append(cached)
                return cached, False
        if not self.num_free_host_blocks:
            return None
        block = self._host_pool.take_one(self._now_s)
        host.append(block)
        if key is not None and tiers is not None:
            tiers.key_host_block_after_step(block, key)
        return block, True

    # -- write-through --------------------------------------------------------------------------
    def plan_write_through(
        self, candidates: list[tuple[str, int]], budget_blocks: int
    ) -> list[BlockCopy]:
        """Copy full, unsynced device blocks to the host, in the candidates' order.

        `candidates` are (request id, computed tokens) pairs, most-likely-to-be-preempted first.
        Only full blocks are written: the partial tail changes every step and is copied by an
        eviction instead.  Stops at `budget_blocks` copies or when the host tier is full; a
        block the host caches already is shared, not copied.
        """
        copies: list[BlockCopy] = []
        if not self.config.offload:
            return copies
        bs, synced = self.block_size, self._synced_tokens
        device_tables, host_tables = self._device_tables, self._host_tables
        add, kind, make = copies.append, CopyKind.WRITE_THROUGH, BlockCopy
        for request_id, num_tokens in candidates:
            if len(copies) >= budget_blocks:
                break
            first = synced.get(request_id, 0) // bs
            last = num_tokens // bs  # exclusive: number of full blocks
            device = device_tables.get(request_id)
            if device is None or first >= last:
                continue
            host = host_tables.setdefault(request_id, [])
            index = first
            while index < last and len(copies) < budget_blocks:
                target = self._host_block_for(request_id, index, host)
                if target is None:
                    break
                if target[1]:
                    add(make(request_id, kind, device[index], target[0]))
                index += 1
            if index > first:
                synced[request_id] = index * bs
            if not host:
                del host_tables[request_id]
        return copies

    # -- eviction, loading, release ---------------------------------------------------------------
    def evict(
        self, request_id: str, num_tokens: int, return_s: float = NOT_EXPECTED
    ) -> EvictionPlan | None:
        """Offload a request: free its synced device blocks now, copy the unsynced rest.

        Returns None, changing nothing, when the host tier cannot take the rest or offloading is
        off (the caller then drops the KV for recompute).  Copied device blocks are released at
        `end_step()`; so are the synced ones when `free_synced_on_evict` is off (no load-evict
        overlap: the memory is reusable only once the eviction completes).  The request expects
        its blocks back at `return_s` (its reader's dry time: retention.py).
        """
        device = self._device_tables.get(request_id, [])
        host = self._host_tables.get(request_id, [])
        needed = self.blocks_for(num_tokens)
        if not self.config.offload:
            return None
        if needed - len(host) > self.num_free_host_blocks or len(device) < needed:
            return None
        host = self._host_tables.setdefault(request_id, host)
        first_unsynced = min(self._synced_tokens.get(request_id, 0) // self.block_size, needed)
        copies = []
        for index in range(first_unsynced, needed):
            target = self._host_block_for(request_id, index, host)
            assert target is not None  # (room was checked above)
            if target[1]:
                copies.append(BlockCopy(request_id, CopyKind.EVICT, device[index], target[0]))
        synced_now = first_unsynced if self.config.free_synced_on_evict else 0
        now_s, pool = self._now_s, self._device_pool
        pool.release(device[:synced_now], return_s, now_s)
        pool.release(device[needed:], return_s, now_s)
        # (keeps the request's reference: a block shared with another owner stays theirs)
        pinned = device[synced_now:needed]
        self._release_after_step.extend(pinned)
        self._return_after_step.extend(return_s for _ in pinned)
        self._device_tables.pop(request_id, None)
        if self._tiers is not None:
            self._tiers.leave_device(request_id)
        self._end_load(request_id)
        # (a host hit may have given it more than it computed: those blocks stay synced)
        self._synced_tokens[request_id] = max(num_tokens, self._synced_tokens.get(request_id, 0))
        return EvictionPlan(tuple(copies))

    def begin_load(self, request_id: str, num_tokens: int) -> bool:
        """Reserve device blocks for a resumed request whose KV is in the host tier."""
        if not self.has_host_copy(request_id, num_tokens) or request_id in self._device_tables:
            raise ValueError(f"request {request_id} has no host copy to load or is on the device")
        if not self.allocate(request_id, num_tokens):
            return False
        self._loaded_blocks[request_id] = 0
        blocks = self.blocks_for(num_tokens)
        self._load_blocks[request_id] = blocks
        self._num_blocks_to_load += blocks
        return True

    def plan_load(self, request_id: str, num_tokens: int, budget_blocks: int) -> list[BlockCopy]:
        """Next host -> device copies of a loading request, at most `budget_blocks` of them."""
        start = self._loaded_blocks[request_id]
        end = min(self.blocks_for(num_tokens), start + budget_blocks)
        device, host = self._device_tables[request_id], self._host_tables[request_id]
        self._loaded_blocks[request_id] = end
        self._num_blocks_to_load -= max(min(end, self._load_blocks[request_id]) - start, 0)
        num = max(end - start, 0)  # (built by map: a load plans ~20 blocks a call)
        return list(
            map(
                BlockCopy,
                repeat(request_id, num),
                repeat(CopyKind.LOAD, num),
                host[start:end],
                device[start:end],
            )
        )

    def is_loaded(self, request_id: str, num_tokens: int) -> bool:
        """True once every block of a loading request has been planned for copying."""
        return self._loaded_blocks.get(request_id, 0) >= self.blocks_for(num_tokens)

    def free_device(self, request_id: str, return_s: float = NOT_EXPECTED) -> int:
        """Release a request's device blocks, keeping its host copy; returns the blocks that
        became free (a block another request shares stays owned).  The request expects them
        back at `return_s` (retention.py)."""
        device = self._device_tables.pop(request_id, [])
        self._end_load(request_id)
        if self._tiers is not None:
            self._tiers.leave_device(request_id)
        num_free = self.num_free_device_blocks
        self._device_pool.release(device, return_s, self._now_s)
        return self.num_free_device_blocks - num_free

    def _end_load(self, request_id: str) -> None:
        """Forget a request's load (done or not): its unplanned blocks leave the queue."""
        loaded = self._loaded_blocks.pop(request_id, None)
        if loaded is not None:
            self._num_blocks_to_load -= max(self._load_blocks.pop(request_id) - loaded, 0)

    def drop(self, request_id: str, return_s: float = NOT_EXPECTED) -> None:
        """Forget a request in both tiers (finish, abort, or preemption by recompute); with
        prefix caching its cached blocks stay, expected back at `return_s` (retention.py)."""
        self.free_device(request_id, return_s)
        host = self._host_tables.pop(request_id, [])
        freed = self._host_pool.release(host, return_s, self._now_s)
        self._synced_tokens.pop(request_id, None)
        if self._tiers is not None:
            self._tiers.forget_host_blocks(freed)
            self._tiers.forget(request_id)

    def end_step(self) -> None:
        """The step's copies are done: release the device blocks of finished evictions, and
        cache the host blocks that now hold a copy of a keyed block."""
        self._device_pool.release_pinned(
            self._release_after_step, self._return_after_step, self._now_s
        )
        self._release_after_step.clear()
        self._return_after_step.clear()
        if self._tiers is not None:
            self._tiers.end_step()

    def check_integrity(self) -> None:
        """Raise AssertionError if any tier's bookkeeping is inconsistent."""
        self._device_pool.check(self._device_tables.values(), self._release_after_step)
        self._host_pool.check(self._host_tables.values(), ())
        for request_id, synced in self._synced_tokens.items():
            covered = len(self._host_tables.get(request_id, ())) * self.block_size
            assert synced <= covered, f"{request_id}: {synced} synced tokens, host holds {covered}"
        for request_id in self._loaded_blocks:
            assert request_id in self._device_tables, f"{request_id}: loading without blocks"
        assert self._load_blocks.keys() == self._loaded_blocks.keys(), "loads out of step"
        to_load = sum(max(n - self._loaded_blocks[rid], 0) for rid, n in self._load_blocks.items())
        kept = self._num_blocks_to_load
        assert to_load == kept, f"{to_load} blocks left to load, {kept} kept"
