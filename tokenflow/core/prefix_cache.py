"""The device tier's prefix cache: full KV blocks shared by requests whose tokens begin alike.

Keys.  A full block is keyed by a chain hash of the token ids up to its end:
h(0) = `ROOT_BLOCK_HASH`, h(i + 1) = hash((h(i), token ids of block i)), so equal keys mean equal
whole prefixes, not merely equal blocks.  Python's hash of an int and of a tuple of ints does not
depend on PYTHONHASHSEED (only str and bytes hashes are salted), so the keys, and the decision
traces built on them, are the same in every run.  The hash is 64 bits: two different prefixes
whose keys collide would share KV wrongly; as in vLLM's default (builtin) block hash, that risk
is accepted.  Anything else that changes a block's KV would join the hashed tuple (a LoRA
adapter, multimodal inputs, a cache salt); today nothing does: one model, no adapters.

Blocks.  Each device block has a reference count: the device tables that hold it, plus the
eviction copies still reading it this step (the manager's release-after-step list keeps its
reference until `end_step`, so the block cannot be reallocated and rewritten while it is
copied out).  A block with a key is *cached*; the partial last block of a request never is
(its KV changes every step), and a block is keyed only once its tokens' KV has been computed.
A cached block whose count falls to 0 stays *cached-free*: free memory (allocation may take
it), still found by `find` until allocation does take it, least recently released first, and
its key is then forgotten.  An uncached block at 0 goes back to the manager's plain free list,
which allocation prefers.  A block at 0 therefore is in exactly one of the two free sets.

This class owns the counts, the keys and the cached-free order; `KVTierManager` owns the block
tables and the plain free list, and calls it on every change of a device block's owners.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

RETENTIONS = ("reading", "lru")  # orders of reuse of cached-free blocks (KVConfig.prefix_retention)
ROOT_BLOCK_HASH = 0  # the chain's parent of block 0 (an int: its hash is the same every run)


def chain_hash(parent_hash: int, block_token_ids: tuple[int, ...]) -> int:
    """The key of a full block whose tokens are `block_token_ids`, after the block keyed
    `parent_hash` (`ROOT_BLOCK_HASH` for a sequence's first block)."""
    return hash((parent_hash, block_token_ids))


@dataclass(frozen=True)
class CachedPrefix:
    """The leading full blocks of a token sequence whose KV the device tier holds."""

    block_ids: tuple[int, ...]  # in table order
    block_hashes: tuple[int, ...]  # their chain keys, same order
    num_tokens: int  # len(block_ids) * block_size: the leading tokens whose KV they hold


NO_PREFIX = CachedPrefix((), (), 0)


class PrefixCache:
    """Reference counts, chain keys and the cached-free LRU of the device blocks."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self._refcounts = [0] * num_blocks
        self._hash_of: list[int | None] = [None] * num_blocks  # block -> its key, if cached
        self._block_of: dict[int, int] = {}  # key -> the one block cached under it
        self._cached_free: dict[int, None] = {}  # cached blocks at count 0, least recent first
        # request -> (leading blocks keyed so far, the last one's key): keying a step's new
        # full blocks hashes only those (O(new blocks)), never the whole sequence again.
        self._progress: dict[str, tuple[int, int]] = {}

    # -- queries -----------------------------------------------------------------------------
    @property
    def num_cached_free(self) -> int:
        """Cached blocks no request holds (free memory that a lookup may still reuse)."""
        return len(self._cached_free)

    @property
    def num_cached(self) -> int:
        """Blocks with a key, held or cached-free."""
        return len(self._block_of)

    def refcount(self, block_id: int) -> int:
        """Tables holding the block plus eviction copies reading it this step."""
        return self._refcounts[block_id]

    def is_cached_free(self, block_id: int) -> bool:
        return block_id in self._cached_free

    def find(self, token_ids: Sequence[int]) -> CachedPrefix:
        """The longest run of `token_ids`' leading full blocks that is cached, leaving at least
        the last token out (its logits are needed, so some token must be computed)."""
        bs, block_of = self.block_size, self._block_of
        block_ids: list[int] = []
        hashes: list[int] = []
        parent = ROOT_BLOCK_HASH
        for start in range(0, (len(token_ids) - 1) // bs * bs, bs):
            parent = chain_hash(parent, tuple(token_ids[start : start + bs]))
            block = block_of.get(parent)
            if block is None:
                break
            block_ids.append(block)
            hashes.append(parent)
        if not block_ids:
            return NO_PREFIX
        return CachedPrefix(tuple(block_ids), tuple(hashes), len(block_ids) * bs)

    def num_cached_free_in(self, prefix: CachedPrefix) -> int:
        """Blocks of `prefix` that are cached-free (sharing them takes them out of the free
        memory).  ValueError if `prefix` is stale: a block no longer holds its key."""
        hash_of, cached_free = self._hash_of, self._cached_free
        for block, key in zip(prefix.block_ids, prefix.block_hashes, strict=True):
            if hash_of[block] != key:
                raise ValueError(f"stale cached prefix: block {block} no longer holds its key")
        return sum(1 for block in prefix.block_ids if block in cached_free)

    # -- owners ------------------------------------------------------------------------------
    def claim(self, block_id: int) -> None:
        """A block from the plain free list gets its first owner."""
        self._refcounts[block_id] = 1

    def reuse_least_recent(self) -> int:
        """Take the least recently released cached-free block for a new owner, forgetting its
        key (allocation calls this only when the plain free list is empty)."""
        block = next(iter(self._cached_free))
        del self._cached_free[block]
        del self._block_of[self._hash_of[block]]  # type: ignore[index]
        self._hash_of[block] = None
        self._refcounts[block] = 1
        return block

    def share(self, block_ids: Iterable[int]) -> None:
        """One more owner for each block (a cached-free one is taken out of the free set)."""
        refcounts, cached_free = self._refcounts, self._cached_free
        for block in block_ids:
            if not refcounts[block]:
                del cached_free[block]
            refcounts[block] += 1

    def release(self, block_id: int) -> bool:
        """One owner fewer; True when the block is now free and uncached (the caller puts it on
        its plain free list).  A cached block at 0 becomes the most recent cached-free one."""
        count = self._refcounts[block_id] - 1
        self._refcounts[block_id] = count
        if count:
            return False
        if self._hash_of[block_id] is None:
            return True
        self._cached_free[block_id] = None
        return False

    # -- keys of computed blocks -------------------------------------------------------------
    def begin(self, request_id: str, prefix: CachedPrefix) -> None:
        """A request's table starts with the shared `prefix`: its keys are known already."""
        if prefix.block_ids:
            self._progress[request_id] = (len(prefix.block_ids), prefix.block_hashes[-1])

    def cache_full_blocks(
        self,
        request_id: str,
        table: Sequence[int],
        num_computed_tokens: int,
        token_ids_from: Callable[[int, int], Sequence[int]],
    ) -> None:
        """Key the request's full blocks computed since the last call (`table[i]` holds tokens
        [i * block_size, (i + 1) * block_size)); a block is cached unless its key already is
        (the first block computed under a key keeps it; a later twin stays private)."""
        bs = self.block_size
        num_full = num_computed_tokens // bs
        num_keyed, parent = self._progress.get(request_id, (0, ROOT_BLOCK_HASH))
        if num_full <= num_keyed:
            return
        block_of, hash_of = self._block_of, self._hash_of
        for index in range(num_keyed, num_full):
            parent = chain_hash(parent, tuple(token_ids_from(index * bs, bs)))
            block = table[index]
            if parent not in block_of and hash_of[block] is None:
                block_of[parent] = block
                hash_of[block] = parent
        self._progress[request_id] = (num_full, parent)

    def forget(self, request_id: str) -> None:
        """The request's tokens are gone (finished, or dropped for recompute): stop keying."""
        self._progress.pop(request_id, None)

    # -- invariants --------------------------------------------------------------------------
    def check(
        self, tables: Iterable[Sequence[int]], pinned: Sequence[int], plain_free: Sequence[int]
    ) -> None:
        """AssertionError unless the counts match `tables` (the device tables) and `pinned`
        (blocks of eviction copies in flight), and every block is owned or in exactly one free
        set (`plain_free`, the manager's, or the cached-free one), with keys consistent."""
        total = len(self._refcounts)
        counts = [0] * total
        for table in tables:
            assert len(set(table)) == len(table), "device: a block twice in one table"
            for block in table:
                counts[block] += 1
        for block in pinned:
            counts[block] += 1
        assert counts == self._refcounts, "device: a refcount differs from its owners"
        owned = {block for block, count in enumerate(counts) if count}
        free = [*plain_free, *self._cached_free]
        assert len(set(free)) == len(free), "device: a block is free twice"
        assert not owned.intersection(free), "device: a block is both free and owned"
        assert len(owned) + len(free) == total, f"device: free + owned != {total}"
        for key, block in self._block_of.items():
            assert self._hash_of[block] == key, f"device: key of block {block} differs"
        num_keyed = sum(key is not None for key in self._hash_of)
        assert num_keyed == len(self._block_of), "device: a keyed block is not in the cache"
        for block in self._cached_free:
            assert self._hash_of[block] is not None, f"device: cached-free {block} has no key"
            assert not self._refcounts[block], f"device: cached-free {block} has owners"
        for block in plain_free:
            assert self._hash_of[block] is None, f"device: plain free block {block} has a key"
