"""What a replica tells the router of the prefixes it caches: a bounded sample of block keys.

A router that sends a conversation's next turn back to the replica holding its history needs
to know which prefixes each replica caches.  Sending every key would cost as much as the cache
is large (hundreds of thousands of host blocks), so each tier reports a sample:

- only keys whose value is a multiple of `SAMPLE_EVERY` (about one block in eight, fixed by the
  key alone, so the replica and the router sample alike with no coordination), and
- of those, the `MAX_KEYS_PER_TIER` most recently used (keyed, or shared by a hit).

A key is a chain hash of the whole prefix up to its block (prefix_cache.py), so a sampled key
the request shares at index i says the tier held its first i + 1 blocks when it reported: the
match is the request's longest sampled prefix, short of the true one by fewer than
`SAMPLE_EVERY` blocks on average.  A prompt shorter than a few sampled blocks (a few hundred
tokens) may match nothing; it has little prefill to save.  The sample is deterministic: Python
hashes tuples of ints the same in every run.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from itertools import islice

SAMPLE_EVERY = 8  # a key is sampled when it is a multiple of this
MAX_KEYS_PER_TIER = 2048  # sampled keys reported per tier (~16k blocks of prefixes)


def is_sampled(key: int) -> bool:
    """Whether a block key belongs to the summaries' sample."""
    return key % SAMPLE_EVERY == 0


class RecentKeys:
    """One tier's sampled keys in order of last use (the tier's `PrefixCache` owns it)."""

    def __init__(self) -> None:
        self._keys: dict[int, None] = {}  # insertion order = order of last use

    def __len__(self) -> int:
        return len(self._keys)

    def touch(self, key: int) -> None:
        """The key was cached or shared now (ignored unless sampled)."""
        if is_sampled(key):
            self._keys.pop(key, None)
            self._keys[key] = None

    def forget(self, key: int) -> None:
        """The key's block was reused for other KV."""
        self._keys.pop(key, None)

    def latest(self, max_keys: int) -> tuple[int, ...]:
        """The `max_keys` most recently used keys, the most recent first."""
        return tuple(islice(reversed(self._keys), max_keys))


@dataclass(frozen=True)
class PrefixSummary:
    """The sampled keys a replica's tiers cache (see the module docstring); empty without
    prefix caching."""

    device_block_hashes: tuple[int, ...] = ()
    host_block_hashes: tuple[int, ...] = ()

    @cached_property
    def _cached(self) -> frozenset[int]:
        # (membership only: never iterated, so its order decides nothing)
        return frozenset(self.device_block_hashes) | frozenset(self.host_block_hashes)

    def num_cached_blocks(self, block_hashes: Sequence[int]) -> int:
        """Leading blocks of a prompt whose full blocks are keyed `block_hashes` that either
        tier caches, as far as the sample tells: up to its last sampled key found."""
        cached = self._cached
        if not cached:
            return 0
        for index in range(len(block_hashes) - 1, -1, -1):
            if block_hashes[index] in cached:
                return index + 1
        return 0


def num_common_blocks(a: Sequence[int], b: Sequence[int]) -> int:
    """Leading blocks two prompts share.  Keys are chain hashes, so equal keys at block i mean
    equal blocks 0..i: the length is found by bisection."""
    low, high = 0, min(len(a), len(b))  # a[:low] == b[:low]; they differ at or before `high`
    while low < high:
        middle = (low + high + 1) // 2
        if a[middle - 1] == b[middle - 1]:
            low = middle
        else:
            high = middle - 1
    return low
