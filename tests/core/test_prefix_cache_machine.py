"""Random sequences of KV manager operations with prefix caching on (a Hypothesis state machine).

Both tiers cache: starts share the device's run and the host's, and may load the host's part;
releases say when they expect their blocks back and the clock moves, so the reading retention
reorders what it gives up (the machine runs under both retentions).

Beside `check_integrity`, a model of the memory checks what sharing must never break: each
block's content is recorded as the token prefix up to its end when a request writes it (and
copied along with the copy plans), so a request holding a block whose KV is not that of its own
tokens, a write into a block someone else holds, or a cached key whose block holds other tokens
fails at once.  Eviction copies are performed at `end_step`, as an executor does them during
the step, so a block reallocated and rewritten before then reaches the host tier wrong.
"""

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from tokenflow.core.kv_manager import KVConfig, KVTierManager
from tokenflow.core.prefix_cache import ROOT_BLOCK_HASH, chain_hash
from tokenflow.core.retention import NOT_EXPECTED

BS = 4
NUM_REQUESTS = 5
# Prompts are a cut of one of these plus a short tail: bases 0 and 1 share two blocks.
BASES = (
    tuple(range(1, 13)),
    tuple(range(1, 9)) + (50, 51, 52, 53),
    (7,) * 10,
)


RETURNS = st.sampled_from([NOT_EXPECTED, 1.0, 30.0])  # when a release expects its blocks back


class PrefixCacheMachine(RuleBasedStateMachine):
    retention = "reading"

    def __init__(self) -> None:
        super().__init__()
        config = KVConfig(
            8, 16, BS, block_bytes=100, prefix_caching=True, prefix_retention=self.retention
        )
        self.kv = KVTierManager(config)
        self.now_s = 0.0
        self.tokens: dict[str, list[int]] = {}  # request -> its known tokens
        self.computed: dict[str, int] = {}  # request -> tokens whose KV it has
        self.where: dict[str, str] = {}  # request -> "device", "host" or "loading"
        self.device: dict[int, tuple[int, ...]] = {}  # block -> prefix its content ends
        self.host: dict[int, tuple[int, ...]] = {}
        self.evicting: dict[str, list[tuple[int, int]]] = {}  # request -> (device, host) copies

    # -- helpers -----------------------------------------------------------------------------
    def _in(self, where: str | None) -> list[str]:
        """The requests in `where` (None: the ids not in use), in id order."""
        return [f"r{i}" for i in range(NUM_REQUESTS) if self.where.get(f"r{i}") == where]

    def _draw(self, data, where: str | None) -> str:
        return data.draw(st.sampled_from(self._in(where)), label="request")

    def _token_ids_from(self, rid: str):
        tokens = self.tokens[rid]
        return lambda position, count: tuple(tokens[position : position + count])

    def _forget(self, rid: str) -> None:
        for table in (self.tokens, self.computed, self.where):
            del table[rid]
        self.evicting.pop(rid, None)  # (its copies are moot: nobody reads its host blocks)

    # -- rules -------------------------------------------------------------------------------
    @precondition(lambda self: self._in(None))
    @rule(
        data=st.data(),
        base=st.sampled_from(BASES),
        cut=st.integers(3, 12),
        tail=st.lists(st.integers(0, 1), max_size=4),
        load_host=st.booleans(),
    )
    def start(self, data, base, cut, tail, load_host):
        rid, prompt = self._draw(data, None), base[:cut] + tuple(tail)
        hit = self.kv.find_prefix(prompt)
        cached = hit.num_cached_tokens(load_host)
        assert cached < len(prompt) and cached % BS == 0
        if self.kv.allocate_with_prefix(rid, len(prompt), hit, load_host):
            self.tokens[rid], self.computed[rid] = list(prompt), cached
            loading = load_host and hit.num_host_load_blocks
            self.where[rid] = "loading" if loading else "device"
            shared = self.kv.device_block_ids(rid)[: len(hit.device_block_ids)]
            assert shared == hit.device_block_ids
        else:
            assert self.kv.num_device_blocks_of(rid) == 0

    @rule()
    def other_traffic(self):
        """Other work takes every free device block for a moment: the device's cached-free
        blocks are reused (their host copies stay)."""
        num_free = self.kv.num_free_device_blocks
        if num_free and self.kv.allocate("other", num_free * BS):
            for block in self.kv.device_block_ids("other"):
                self.device[block] = ("other",)
            self.kv.drop("other")

    @rule(seconds=st.sampled_from([0.5, 5.0, 40.0]))
    def tick(self, seconds):
        self.now_s += seconds
        self.kv.set_time(self.now_s)

    @precondition(
        lambda self: any(self.computed[r] < len(self.tokens[r]) for r in self._in("device"))
    )
    @rule(data=st.data(), num=st.integers(1, 12))
    def compute(self, data, num):
        """A step computes `num` more tokens of a resident (a prompt chunk or a decode)."""
        pending = [r for r in self._in("device") if self.computed[r] < len(self.tokens[r])]
        rid = data.draw(st.sampled_from(pending), label="request")
        first, end = self.computed[rid], min(self.computed[rid] + num, len(self.tokens[rid]))
        if not self.kv.allocate(rid, end):
            return
        table, tokens = self.kv.device_block_ids(rid), self.tokens[rid]
        for index_ in range(first // BS, self.kv.blocks_for(end)):
            block = table[index_]
            assert self.kv._prefix.refcount(block) == 1, f"{rid} writes shared block {block}"
            self.device[block] = tuple(tokens[: min(end, (index_ + 1) * BS)])
        self.computed[rid] = end
        self.kv.cache_full_blocks(rid, end, self._token_ids_from(rid))

    @precondition(
        lambda self: any(self.computed[r] == len(self.tokens[r]) for r in self._in("device"))
    )
    @rule(data=st.data(), token=st.integers(0, 2))
    def grow(self, data, token):
        """A resident whose tokens all have KV samples one more (a decode's token)."""
        done = [r for r in self._in("device") if self.computed[r] == len(self.tokens[r])]
        rid = data.draw(st.sampled_from(done), label="request")
        self.tokens[rid].append(token)
        if not self.kv.allocate(rid, len(self.tokens[rid])):
            self.kv.drop(rid, self.now_s + 1.0)  # no block: preempted by recompute (gone here)
            self._forget(rid)

    @rule(budget=st.integers(1, 6))
    def write_through(self, budget):
        residents = sorted(r for r, w in self.where.items() if w == "device")
        candidates = [(r, self.computed[r]) for r in residents]
        for copy in self.kv.plan_write_through(candidates, budget):
            assert self.kv._host_prefix.refcount(copy.dst_block_id) == 1, "write to a shared block"
            self.host[copy.dst_block_id] = self.device[copy.src_block_id]

    @precondition(lambda self: any(self.computed[r] for r in self._in("device")))
    @rule(data=st.data(), return_s=RETURNS)
    def evict(self, data, return_s):
        rid = data.draw(st.sampled_from([r for r in self._in("device") if self.computed[r]]))
        plan = self.kv.evict(rid, self.computed[rid], self.now_s + return_s)
        if plan is None:
            return
        for copy in plan.copies:
            assert self.kv._host_prefix.refcount(copy.dst_block_id) == 1, "evict to a shared one"
        self.evicting[rid] = [(c.src_block_id, c.dst_block_id) for c in plan.copies]
        self.where[rid] = "host"

    @precondition(lambda self: any(r not in self.evicting for r in self._in("host")))
    @rule(data=st.data())
    def begin_load(self, data):
        """(Never in the step that evicts it: its host copy is not written yet.)"""
        rid = data.draw(st.sampled_from([r for r in self._in("host") if r not in self.evicting]))
        if self.kv.begin_load(rid, self.computed[rid]):
            self.where[rid] = "loading"

    @precondition(lambda self: self._in("loading"))
    @rule(data=st.data(), budget=st.integers(1, 3))
    def plan_load(self, data, budget):
        rid = self._draw(data, "loading")
        for copy in self.kv.plan_load(rid, self.computed[rid], budget):
            assert self.kv._prefix.refcount(copy.dst_block_id) == 1, "load into a shared block"
            self.device[copy.dst_block_id] = self.host[copy.src_block_id]
        if self.kv.is_loaded(rid, self.computed[rid]):
            self.where[rid] = "device"

    @precondition(lambda self: self._in("loading"))
    @rule(data=st.data(), return_s=RETURNS)
    def free_device(self, data, return_s):
        rid = self._draw(data, "loading")
        self.kv.free_device(rid, self.now_s + return_s)  # paused while loading: host copy stays
        self.where[rid] = "host"

    @precondition(lambda self: self.where)
    @rule(data=st.data(), return_s=RETURNS)
    def drop(self, data, return_s):
        rid = data.draw(st.sampled_from(sorted(self.where)), label="request")
        self.kv.drop(rid, self.now_s + return_s)  # finished, aborted, or paused by recompute
        self._forget(rid)

    @rule()
    def end_step(self):
        for copies in self.evicting.values():
            for src, dst in copies:
                self.host[dst] = self.device[src]
        self.evicting.clear()
        self.kv.end_step()

    # -- invariants --------------------------------------------------------------------------
    @invariant()
    def bookkeeping_is_consistent(self):
        self.kv.check_integrity()

    @invariant()
    def every_request_holds_the_kv_of_its_own_tokens(self):
        for rid, where in self.where.items():
            if where == "loading" or rid in self.evicting:
                continue
            memory = self.device if where == "device" else self.host
            table = (
                self.kv.device_block_ids(rid) if where == "device" else self.kv._host_tables[rid]
            )
            tokens, computed = self.tokens[rid], self.computed[rid]
            for index in range(self.kv.blocks_for(computed)):
                # Its computed tokens' KV, or more of its own tokens' (a shared full block)
                content = memory.get(table[index], ())
                assert len(content) >= min(computed, (index + 1) * BS), f"{rid}: block {index}"
                assert content == tuple(tokens[: len(content)]), f"{rid}: block {index} not its KV"

    @invariant()
    def no_block_being_copied_out_is_free(self):
        """Until `end_step` an eviction's source blocks stay held (step semantics 1)."""
        for copies in self.evicting.values():
            for src, _ in copies:
                assert self.kv._prefix.refcount(src) > 0, f"block {src} freed while copied"

    @invariant()
    def every_cached_block_holds_the_tokens_of_its_key(self):
        for cache, memory in ((self.kv._prefix, self.device), (self.kv._host_prefix, self.host)):
            for key, block in cache._block_of.items():
                content = memory[block]
                assert len(content) % BS == 0, f"block {block} is cached before it is full"
                parent = ROOT_BLOCK_HASH
                for start in range(0, len(content), BS):
                    parent = chain_hash(parent, content[start : start + BS])
                assert parent == key, f"{cache.name} block {block} holds other tokens"

    def teardown(self):
        for rid in list(self.where):
            self.kv.drop(rid)
        self.kv.end_step()
        self.kv.check_integrity()
        assert self.kv.num_free_device_blocks == self.kv.config.num_device_blocks
        assert self.kv.num_free_host_blocks == self.kv.config.num_host_blocks


PrefixCacheMachine.TestCase.settings = settings(
    max_examples=100, stateful_step_count=50, deadline=None, derandomize=True
)
TestPrefixCacheMachine = PrefixCacheMachine.TestCase


class LruPrefixCacheMachine(PrefixCacheMachine):
    retention = "lru"


LruPrefixCacheMachine.TestCase.settings = PrefixCacheMachine.TestCase.settings
TestLruPrefixCacheMachine = LruPrefixCacheMachine.TestCase
