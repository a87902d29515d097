"""Paged KV blocks in two tiers: the device (accelerator) and the host (CPU memory).

The manager owns block ids, never memory: it returns `BlockCopy` plans that an executor performs.

Per request it keeps a device block table, a host block table and `synced_tokens`, the number of
leading tokens whose KV has a current copy in the host tier.  The host tier is a write-through
cache behind the device: full blocks of running requests are copied as the write budget allows,
so an eviction only has to copy the unsynced tail, and frees the synced blocks at once.

With `KVConfig.prefix_caching` on, device blocks are shared between requests whose prompts begin
alike (prefix_cache.py): a request starting fresh takes the cached blocks of its prompt's leading
full blocks (`find_cached_prefix`, `allocate_with_prefix`), its computed full blocks are cached
as they fill (`cache_full_blocks`), and a block is freed when its last owner releases it.  The
host tier stays per request: a shared block is copied to each owner's host table (by
write-through and by eviction alike).

Invariants (`check_integrity`): per tier free + owned == total; no block owned twice (without
prefix caching) or a block's reference count equals its owners (with it); no block both free and
owned; synced_tokens never exceeds what the host table covers.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from itertools import repeat

from tokenflow.core.plan import BlockCopy, CopyKind
from tokenflow.core.prefix_cache import NO_PREFIX, RETENTIONS, CachedPrefix, PrefixCache


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
        # Free lists are stacks popped from the end; initial order makes low ids go first.
        self._free_device = list(range(config.num_device_blocks - 1, -1, -1))
        self._free_host = list(range(config.num_host_blocks - 1, -1, -1))
        self._device_tables: dict[str, list[int]] = {}
        self._host_tables: dict[str, list[int]] = {}
        self._synced_tokens: dict[str, int] = {}
        self._loaded_blocks: dict[str, int] = {}  # request -> leading blocks already loaded
        self._load_blocks: dict[str, int] = {}  # request -> blocks its load copies in all
        self._num_blocks_to_load = 0  # of the loads in flight, blocks not yet planned
        self._release_after_step: list[int] = []  # device blocks whose eviction copy is in flight
        self._prefix = (
            PrefixCache(config.num_device_blocks, config.block_size)
            if config.prefix_caching
            else None
        )
        self._host_prefix: PrefixCache | None = None

    # -- queries -----------------------------------------------------------------------------------
    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold `num_tokens` tokens."""
        return -(-num_tokens // self.block_size)

    @property
    def num_free_device_blocks(self) -> int:
        """Device blocks allocation may take: plain free ones and cached-free ones."""
        if self._prefix is None:
            return len(self._free_device)
        return len(self._free_device) + self._prefix.num_cached_free

    @property
    def num_free_host_blocks(self) -> int:
        return len(self._free_host)

    @property
    def num_cached_device_blocks(self) -> int:
        """Device blocks the prefix cache keys (held or cached-free); 0 without caching."""
        return 0 if self._prefix is None else self._prefix.num_cached

    @property
    def num_cached_host_blocks(self) -> int:
        """Host blocks the prefix cache keys (held or cached-free); 0 without caching."""
        return 0 if self._host_prefix is None else self._host_prefix.num_cached

    @property
    def device_usage(self) -> float:
        """Fraction of device blocks not free (including blocks of evictions in flight)."""
        return 1.0 - self.num_free_device_blocks / self.config.num_device_blocks

    @property
    def host_usage(self) -> float:
        total = self.config.num_host_blocks
        return 0.0 if total == 0 else 1.0 - len(self._free_host) / total

    def device_block_ids(self, request_id: str) -> tuple[int, ...]:
        return tuple(self._device_tables.get(request_id, ()))

    @property
    def device_tables(self) -> Mapping[str, list[int]]:
        """Every live device table by request id (hot paths): read them, never modify them."""
        return self._device_tables

    def num_device_blocks_of(self, request_id: str) -> int:
        return len(self._device_tables.get(request_id, ()))

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
        self._take_device_blocks(table, missing)
        return True

    def _take_device_blocks(self, table: list[int], num: int) -> None:
        """Append `num` free device blocks to `table` (the caller checked there are enough):
        plain free ones first, then cached-free ones, least recently released first."""
        free, cache = self._free_device, self._prefix
        if cache is None:
            for _ in range(num):
                table.append(free.pop())
            return
        for _ in range(num):
            if free:
                block = free.pop()
                cache.claim(block)
            else:
                block = cache.reuse_least_recent()
            table.append(block)

    def _release_device(self, blocks: list[int]) -> None:
        """Drop one owner of each of `blocks` (a table or a slice of one, in table order).  They
        are released last to first, so the cached-free order reuses a prefix's tail first."""
        cache, free = self._prefix, self._free_device
        if cache is None:
            free.extend(reversed(blocks))
            return
        for block in reversed(blocks):
            if cache.release(block):
                free.append(block)

    # -- prefix cache ---------------------------------------------------------------------------
    def find_cached_prefix(self, token_ids: Sequence[int]) -> CachedPrefix:
        """The longest run of `token_ids`' leading full blocks whose KV the device tier caches,
        capped to leave at least the last token to compute; empty without prefix caching.  Pure:
        pass it to `allocate_with_prefix` before any other change of this manager."""
        if self._prefix is None:
            return NO_PREFIX
        return self._prefix.find(token_ids)

    def allocate_with_prefix(self, request_id: str, num_tokens: int, prefix: CachedPrefix) -> bool:
        """Start a request's device table with the shared blocks of `prefix` (their KV is
        computed: the request's first `prefix.num_tokens` tokens need none), then allocate
        blocks up to `num_tokens` tokens.  False, changing nothing, if those do not fit.
        ValueError if the request has a table already or `prefix` is stale."""
        if request_id in self._device_tables:
            raise ValueError(f"request {request_id} already has device blocks")
        cache = self._prefix
        if cache is None or not prefix.block_ids:
            return self.allocate(request_id, num_tokens)
        num_free = self.num_free_device_blocks - cache.num_cached_free_in(prefix)
        missing = max(self.blocks_for(num_tokens) - len(prefix.block_ids), 0)
        if missing > num_free:
            return False
        cache.share(prefix.block_ids)
        table = self._device_tables[request_id] = list(prefix.block_ids)
        self._take_device_blocks(table, missing)
        cache.begin(request_id, prefix)
        return True

    def cache_full_blocks(
        self,
        request_id: str,
        num_computed_tokens: int,
        token_ids_from: Callable[[int, int], Sequence[int]],
    ) -> None:
        """Cache the request's full device blocks whose KV is computed (its first
        `num_computed_tokens` tokens), keyed by the tokens `token_ids_from(position, count)`
        gives; call after each step that computed tokens of it (hashes only the blocks filled
        since the last call).  A no-op without prefix caching or a device table."""
        table = self._device_tables.get(request_id)
        if self._prefix is not None and table is not None:
            self._prefix.cache_full_blocks(request_id, table, num_computed_tokens, token_ids_from)

    # -- write-through --------------------------------------------------------------------------
    def plan_write_through(
        self, candidates: list[tuple[str, int]], budget_blocks: int
    ) -> list[BlockCopy]:
        """Copy full, unsynced device blocks to the host, in the candidates' order.

        `candidates` are (request id, computed tokens) pairs, most-likely-to-be-preempted first.
        Only full blocks are written: the partial tail changes every step and is copied by an
        eviction instead.  Stops at `budget_blocks` copies or when the host tier is full.
        """
        copies: list[BlockCopy] = []
        if not self.config.offload:
            return copies
        bs, synced, free_host = self.block_size, self._synced_tokens, self._free_host
        device_tables, host_tables = self._device_tables, self._host_tables
        add, kind, make = copies.append, CopyKind.WRITE_THROUGH, BlockCopy
        left = budget_blocks  # copies still allowed
        for request_id, num_tokens in candidates:
            if left <= 0:
                break
            first = synced.get(request_id, 0) // bs
            last = num_tokens // bs  # exclusive: number of full blocks
            device = device_tables.get(request_id)
            if device is None or first >= last:
                continue
            host = host_tables.get(request_id)
            if host is None:
                host = host_tables[request_id] = []
            end = last if last < first + left else first + left
            index = first
            while index < end:
                if index >= len(host):
                    if not free_host:
                        break
                    host.append(free_host.pop())
                add(make(request_id, kind, device[index], host[index]))
                index += 1
            left -= index - first
            if index > first:
                synced[request_id] = index * bs
            if not host:
                del host_tables[request_id]
        return copies

    # -- eviction, loading, release ---------------------------------------------------------------
    def evict(self, request_id: str, num_tokens: int) -> EvictionPlan | None:
        """Offload a request: free its synced device blocks now, copy the unsynced rest.

        Returns None, changing nothing, when the host tier cannot take the rest or offloading is
        off (the caller then drops the KV for recompute).  Copied device blocks are released at
        `end_step()`; so are the synced ones when `free_synced_on_evict` is off (no load-evict
        overlap: the memory is reusable only once the eviction completes).
        """
        device = self._device_tables.get(request_id, [])
        host = self._host_tables.get(request_id, [])
        needed = self.blocks_for(num_tokens)
        if not self.config.offload:
            return None
        if needed - len(host) > len(self._free_host) or len(device) < needed:
            return None
        host = self._host_tables.setdefault(request_id, host)
        while len(host) < needed:
            host.append(self._free_host.pop())
        first_unsynced = min(self._synced_tokens.get(request_id, 0) // self.block_size, needed)
        copies = tuple(
            BlockCopy(request_id, CopyKind.EVICT, device[i], host[i])
            for i in range(first_unsynced, needed)
        )
        synced_now = first_unsynced if self.config.free_synced_on_evict else 0
        self._release_device(device[:synced_now])
        self._release_device(device[needed:])
        # (keeps the request's reference: a block shared with another owner stays theirs)
        self._release_after_step.extend(device[synced_now:needed])
        self._device_tables.pop(request_id, None)
        self._end_load(request_id)
        self._synced_tokens[request_id] = num_tokens
        return EvictionPlan(copies)

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

    def free_device(self, request_id: str) -> int:
        """Release a request's device blocks, keeping its host copy; returns the blocks that
        became free (a block another request shares stays owned)."""
        device = self._device_tables.pop(request_id, [])
        self._end_load(request_id)
        if self._prefix is None:
            self._free_device.extend(reversed(device))
            return len(device)
        num_free = self.num_free_device_blocks
        self._release_device(device)
        return self.num_free_device_blocks - num_free

    def _end_load(self, request_id: str) -> None:
        """Forget a request's load (done or not): its unplanned blocks leave the queue."""
        loaded = self._loaded_blocks.pop(request_id, None)
        if loaded is not None:
            self._num_blocks_to_load -= max(self._load_blocks.pop(request_id) - loaded, 0)

    def drop(self, request_id: str) -> None:
        """Forget a request in both tiers (finish, abort, or preemption by recompute)."""
        self.free_device(request_id)
        self._free_host.extend(reversed(self._host_tables.pop(request_id, [])))
        self._synced_tokens.pop(request_id, None)
        if self._prefix is not None:
            self._prefix.forget(request_id)

    def end_step(self) -> None:
        """The step's copies are done: release the device blocks of finished evictions."""
        self._release_device(self._release_after_step)
        self._release_after_step.clear()

    def check_integrity(self) -> None:
        """Raise AssertionError if any tier's bookkeeping is inconsistent."""
        if self._prefix is None:
            self._check_tier(
                "device",
                self.config.num_device_blocks,
                self._free_device + self._release_after_step,
                self._device_tables,
            )
        else:
            tables, pinned = self._device_tables.values(), self._release_after_step
            self._prefix.check(tables, pinned, self._free_device)
        self._check_tier("host", self.config.num_host_blocks, self._free_host, self._host_tables)
        for request_id, synced in self._synced_tokens.items():
            covered = len(self._host_tables.get(request_id, ())) * self.block_size
            assert synced <= covered, f"{request_id}: {synced} synced tokens, host holds {covered}"
        for request_id in self._loaded_blocks:
            assert request_id in self._device_tables, f"{request_id}: loading without blocks"
        assert self._load_blocks.keys() == self._loaded_blocks.keys(), "loads out of step"
        to_load = sum(max(n - self._loaded_blocks[rid], 0) for rid, n in self._load_blocks.items())
        kept = self._num_blocks_to_load
        assert to_load == kept, f"{to_load} blocks left to load, {kept} kept"

    @staticmethod
    def _check_tier(name: str, total: int, free: list[int], tables: dict[str, list[int]]) -> None:
        owned = [block for table in tables.values() for block in table]
        everything = free + owned
        assert len(everything) == total, f"{name}: free {len(free)} + owned {len(owned)} != {total}"
        assert len(set(everything)) == total, f"{name}: a block is owned twice or free and owned"
        assert all(0 <= b < total for b in everything), f"{name}: block id out of range"
