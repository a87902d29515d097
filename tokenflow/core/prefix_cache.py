"""One tier's prefix cache: full KV blocks shared by requests whose tokens begin alike.

Keys.  A full block is keyed by a chain hash of the token ids up to its end:
h(0) = `ROOT_BLOCK_HASH`, h(i + 1) = hash((h(i), token ids of block i)), so equal keys mean equal
whole prefixes, not merely equal blocks.  Python's hash of an int and of a tuple of ints does not
depend on PYTHONHASHSEED (only str and bytes hashes are salted), so the keys, and the decision
traces built on them, are the same in every run.  The hash is 64 bits: two different prefixes
whose keys collide would share KV wrongly; as in vLLM's default (builtin) block hash, that risk
is accepted.  Anything else that changes a block's KV would join the hashed tuple (a LoRA
adapter, multimodal inputs, a cache salt); today nothing does: one model, no adapters.

Blocks.  The device tier and the host tier each have one `PrefixCache`.  Each block has a
reference count: the tables that hold it, plus the copies still reading it this step (the
manager pins them until `end_step`, so a block cannot be reused and rewritten while it is
copied).  A block with a key is *cached*; the partial last block of a request never is (its KV
changes every step), and a block is keyed only once its KV is in place (computed, or copied).
A cached block whose count falls to 0 stays *cached-free*: free memory (allocation may take
it), still found by lookups until allocation does take it, in the order of the tier's
retention (retention.py), and its key is then forgotten.  An uncached block at 0 goes back to
the tier's plain free list (block_pool.py), which allocation prefers.  A block at 0 therefore
is in exactly one of the two free sets.

This class owns the counts, the keys and the retention of one tier; `KVTierManager` owns the
tables, the tier's `BlockPool` the plain free list, and they call it on every change of a
block's owners; `PrefixTiers` (prefix_tiers.py) looks both tiers up together.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from tokenflow.core.prefix_summary import RecentKeys
from tokenflow.core.retention import Retention

RETENTIONS = ("reading", "lru")  # orders of reuse of cached-free blocks (KVConfig.prefix_retention)
ROOT_BLOCK_HASH = 0  # the chain's parent of block 0 (an int: its hash is the same every run)


def chain_hash(parent_hash: int, block_token_ids: tuple[int, ...]) -> int:
    """The key of a full block whose tokens are `block_token_ids`, after the block keyed
    `parent_hash` (`ROOT_BLOCK_HASH` for a sequence's first block)."""
    return hash((parent_hash, block_token_ids))


def extend_chain(hashes: list[int], token_ids: Sequence[int], block_size: int) -> None:
    """Append to `hashes`, the keys of a sequence's first len(hashes) full blocks, the keys of
    the full blocks of `token_ids`, the tokens that follow those blocks."""
    parent = hashes[-1] if hashes else ROOT_BLOCK_HASH
    for start in range(0, len(token_ids) // block_size * block_size, block_size):
        parent = chain_hash(parent, tuple(token_ids[start : start + block_size]))
        hashes.append(parent)


class PrefixCache:
    """Reference counts, chain keys and the retention of one tier's blocks."""

    def __init__(self, name: str, num_blocks: int, retention: Retention) -> None:
        self.name = name  # the tier, in messages
        self._refcounts = [0] * num_blocks
        self._hash_of: list[int | None] = [None] * num_blocks  # block -> its key, if cached
        self._block_of: dict[int, int] = {}  # key -> the one block cached under it
        self._retention = retention  # the cached-free blocks, in their order of reuse
        self._recent = RecentKeys()  # sampled keys by last use (what the replica reports)

    # -- queries -----------------------------------------------------------------------------
    @property
    def num_cached_free(self) -> int:
        """Cached blocks no request holds (free memory that a lookup may still reuse)."""
        return len(self._retention)

    @property
    def num_cached(self) -> int:
        """Blocks with a key, held or cached-free."""
        return len(self._block_of)

    def refcount(self, block_id: int) -> int:
        """Tables holding the block plus copies reading it this step."""
        return self._refcounts[block_id]

    def is_cached(self, block_id: int) -> bool:
        """Whether the block has a key (it holds that full block's KV)."""
        return self._hash_of[block_id] is not None

    def is_cached_free(self, block_id: int) -> bool:
        return block_id in self._retention

    def recent_keys(self, max_keys: int) -> tuple[int, ...]:
        """The most recently used sampled keys (prefix_summary.py), the most recent first."""
        return self._recent.latest(max_keys)

    def block_of(self, key: int) -> int | None:
        """The block cached under `key`, if any."""
        return self._block_of.get(key)

    def find(self, keys: Sequence[int]) -> list[int]:
        """The blocks cached under the leading run of `keys` (stops at the first miss)."""
        block_of, blocks = self._block_of, []
        for key in keys:
            block = block_of.get(key)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def num_cached_free_in(self, block_ids: Sequence[int], keys: Sequence[int]) -> int:
        """Blocks of `block_ids` that are cached-free (sharing them takes them out of the free
        memory).  ValueError if a block no longer holds its key in `keys` (a stale lookup)."""
        hash_of = self._hash_of
        for block, key in zip(block_ids, keys, strict=False):
            if hash_of[block] != key:
                raise ValueError(f"stale {self.name} prefix: block {block} lost its key")
        return sum(1 for block in block_ids if block in self._retention)

    # -- owners ------------------------------------------------------------------------------
    def claim(self, block_id: int) -> None:
        """A block from the plain free list gets its first owner."""
        self._refcounts[block_id] = 1

    def reuse(self, now_s: float) -> int:
        """Take the cached-free block the retention gives up first for a new owner, forgetting
        its key (allocation calls this only when the plain free list is empty)."""
        block = self._retention.pick(now_s)
        key = self._hash_of[block]
        assert key is not None  # (a cached-free block has a key)
        del self._block_of[key]
        self._recent.forget(key)
        self._hash_of[block] = None
        self._retention.forget(block)
        self._refcounts[block] = 1
        return block

    def share(self, block_ids: Iterable[int]) -> None:
        """One more owner for each block (a cached-free one is taken out of the free set)."""
        refcounts, retention, hash_of = self._refcounts, self._retention, self._hash_of
        for block in block_ids:
            if not refcounts[block]:
                retention.take(block)
            refcounts[block] += 1
            key = hash_of[block]
            if key is not None:
                self._recent.touch(key)

    def release(self, block_id: int, return_s: float, now_s: float) -> bool:
        """One owner fewer, which expects the block back at `return_s` (retention.py); True
        when the block is now free and uncached (the caller puts it on its plain free list).
        A cached block at 0 joins the cached-free ones."""
        count = self._refcounts[block_id] - 1
        self._refcounts[block_id] = count
        if self._hash_of[block_id] is None:
            return not count
        self._retention.expect(block_id, return_s)
        if not count:
            self._retention.release(block_id, now_s)
        return False

    def key(self, block_id: int, key: int) -> None:
        """`block_id`, owned and holding the KV of the prefix keyed `key`, becomes cached,
        unless that key is cached already (the first block under a key keeps it; a twin stays
        private) or the block is."""
        if key not in self._block_of and self._hash_of[block_id] is None:
            self._block_of[key] = block_id
            self._hash_of[block_id] = key
            self._recent.touch(key)

    # -- invariants --------------------------------------------------------------------------
    def check(
        self, tables: Iterable[Sequence[int]], pinned: Sequence[int], plain_free: Sequence[int]
    ) -> None:
        """AssertionError unless the counts match `tables` and `pinned` (blocks of copies in
        flight), and every block is owned or in exactly one free set (`plain_free`, the
        pool's, or the cached-free one), with keys consistent."""
        name, total = self.name, len(self._refcounts)
        counts = [0] * total
        for table in tables:
            assert len(set(table)) == len(table), f"{name}: a block twice in one table"
            for block in table:
                counts[block] += 1
        for block in pinned:
            counts[block] += 1
        assert counts == self._refcounts, f"{name}: a refcount differs from its owners"
        owned = {block for block, count in enumerate(counts) if count}
        free = [*plain_free, *self._retention]
        assert len(set(free)) == len(free), f"{name}: a block is free twice"
        assert not owned.intersection(free), f"{name}: a block is both free and owned"
        assert len(owned) + len(free) == total, f"{name}: free + owned != {total}"
        for key, block in self._block_of.items():
            assert self._hash_of[block] == key, f"{name}: key of block {block} differs"
        num_keyed = sum(key is not None for key in self._hash_of)
        assert num_keyed == len(self._block_of), f"{name}: a keyed block is not in the cache"
        for block in self._retention:
            assert self._hash_of[block] is not None, f"{name}: cached-free {block} has no key"
            assert not self._refcounts[block], f"{name}: cached-free {block} has owners"
        for block in plain_free:
            assert self._hash_of[block] is None, f"{name}: plain free block {block} has a key"
        recent = self._recent.latest(len(self._recent))
        assert all(key in self._block_of for key in recent), f"{name}: a reported key is gone"
