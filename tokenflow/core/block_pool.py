"""One tier's free blocks: the plain free list and, with prefix caching, the cached-free ones.

Allocation takes plain free blocks first, low ids first, then cached-free ones in the order of
the tier's retention (retention.py); a block whose last owner lets go goes back to the plain
free list unless it is cached, in which case it stays cached-free, still found by lookups
until allocation takes it (prefix_cache.py).  Without a prefix cache every block has one owner
and the pool is a stack of free ids.

The pool owns the plain free list, the tier's `PrefixCache` the counts and keys; the manager
owns the tables and calls the pool whenever a block gains its first owner or loses one.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from tokenflow.core.prefix_cache import PrefixCache


class BlockPool:
    """The free blocks of one tier (device or host), and the tier's prefix cache if any."""

    def __init__(self, name: str, num_blocks: int, cache: PrefixCache | None) -> None:
        self.name = name  # the tier, in messages
        self.num_blocks = num_blocks
        self.cache = cache
        # A stack popped from the end; the initial order makes low ids go first.
        self._free = list(range(num_blocks - 1, -1, -1))

    @property
    def num_free(self) -> int:
        """Blocks allocation may take: plain free ones and cached-free ones."""
        if self.cache is None:
            return len(self._free)
        return len(self._free) + self.cache.num_cached_free

    def take(self, table: list[int], num: int, now_s: float) -> None:
        """Append `num` free blocks to `table` (the caller checked there are enough): plain
        free ones first, then cached-free ones in the retention's order at `now_s`."""
        free, cache = self._free, self.cache
        if cache is None:
            for _ in range(num):
                table.append(free.pop())
            return
        for _ in range(num):
            if free:
                block = free.pop()
                cache.claim(block)
            else:
                block = cache.reuse(now_s)
            table.append(block)

    def take_one(self, now_s: float) -> int:
        """One free block (the caller checked there is one), as `take`."""
        cache = self.cache
        if cache is None:
            return self._free.pop()
        if self._free:
            block = self._free.pop()
            cache.claim(block)
            return block
        return cache.reuse(now_s)

    def release(self, blocks: Sequence[int], return_s: float, now_s: float) -> list[int]:
        """Drop one owner of each of `blocks` (a table or a slice of one, in table order), which
        expects them back at `return_s` (retention.py); returns those that went back to the
        plain free list.  They are released last to first, so a prefix's tail goes before its
        head in the release order."""
        cache, free = self.cache, self._free
        if cache is None:
            freed = list(reversed(blocks))
        else:
            freed = [block for block in reversed(blocks) if cache.release(block, return_s, now_s)]
        free.extend(freed)
        return freed

    def release_pinned(
        self, blocks: Sequence[int], returns_s: Sequence[float], now_s: float
    ) -> None:
        """Drop the owner of each block an eviction pinned while its copy was in flight, which
        expects it back at the matching `returns_s` (in pinning order, unlike `release`)."""
        cache, free = self.cache, self._free
        if cache is None:
            free.extend(reversed(blocks))
            return
        for block, return_s in zip(blocks, returns_s, strict=True):
            if cache.release(block, return_s, now_s):
                free.append(block)

    def check(self, tables: Iterable[Sequence[int]], pinned: Sequence[int]) -> None:
        """AssertionError unless every block is free or owned, by the `tables` or `pinned` (the
        blocks of copies in flight), and (without a cache) none is owned twice."""
        if self.cache is not None:
            self.cache.check(tables, pinned, self._free)
            return
        name, total = self.name, self.num_blocks
        free = self._free + list(pinned)
        owned = [block for table in tables for block in table]
        everything = free + owned
        assert len(everything) == total, f"{name}: free {len(free)} + owned {len(owned)} != {total}"
        assert len(set(everything)) == total, f"{name}: a block is owned twice or free and owned"
        assert all(0 <= b < total for b in everything), f"{name}: block id out of range"
