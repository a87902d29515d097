"""Each API key's share of the engine: work in flight counted as the engine counts it, bounded
per key, and shared fairly between keys when the engine is full.

A request's `Work` is what it starts in the engine: one engine request per choice (prompts
times `n`) and, for each, its prompt plus its `max_tokens`.  An HTTP request is not a unit: one
body can start 128 engine requests.

- **Per-key bounds** (`KeyLimits.max_choices`, `max_tokens`): a key's work in flight never
  exceeds them.  A request that could never fit is refused at once; one that does not fit now
  gets 429 naming the limit (its key's earlier requests must finish first).
- **Fair share under contention** (`KeyLimits.capacity_choices`, the engine's slots): when the
  engine is full, requests wait, and a freed slot goes to the waiting request whose key holds
  the fewest slots, then whose key has received the least service (`KeyLedger.share_order`).
  Service is counted in tokens (prompt plus `max_tokens` when admitted, the unused part
  refunded at release), as the Virtual Token Counter does (Sheng et al., "Fairness in Serving
  Large Language Models", OSDI '24): a key that becomes active is lifted to the least counter
  among active keys, so idle time banks no credit.  A request still
  waiting after `queue_timeout_s` gets 429.  This is also what keeps one tenant from forcing
  preemption storms on the others' streams: it cannot hold more than its share of slots while
  they wait.

Requests without a key (an open server) share one anonymous account, not bounded per key but
queued fairly against keyed ones.  `KeyLedger` holds the rule and no time; `KeyGate` adds the
waiting (one event loop: no locks).
"""

from __future__ import annotations

import asyncio
import itertools
import math
from dataclasses import dataclass, field

from tokenflow.serving.validation import ApiError

ANONYMOUS = ""  # the account of requests without a key


@dataclass(frozen=True)
class Work:
    """What one request starts in the engine."""

    num_choices: int  # engine requests: prompts x n
    num_tokens: int  # over its choices: prompt tokens + max_tokens each

    def __post_init__(self) -> None:
        if self.num_choices < 1 or self.num_tokens < 0:
            raise ValueError(f"work must have >= 1 choice and >= 0 tokens, got {self}")


@dataclass(frozen=True)
class KeyLimits:
    """Per-key bounds on work in flight (0: none) and the engine slots shared between keys."""

    max_choices: int = 0
    max_tokens: int = 0
    capacity_choices: int = 0  # 0: no sharing (the engine's own queue cap answers 429)
    queue_timeout_s: float = 10.0

    def __post_init__(self) -> None:
        if min(self.max_choices, self.max_tokens, self.capacity_choices) < 0:
            raise ValueError(f"key limits must be >= 0, got {self}")
        if not (math.isfinite(self.queue_timeout_s) and self.queue_timeout_s >= 0):
            raise ValueError(f"queue_timeout_s must be finite and >= 0, got {self}")


@dataclass
class _Account:
    num_choices: int = 0
    num_tokens: int = 0
    num_waiting: int = 0
    served_tokens: float = 0.0  # the virtual token counter

    @property
    def is_active(self) -> bool:
        return self.num_choices > 0 or self.num_waiting > 0


class KeyLedger:
    """Work in flight and service received, per key; the admission rule, without waiting."""

    def __init__(self, limits: KeyLimits) -> None:
        self.limits = limits
        self._accounts: dict[str, _Account] = {}
        self.num_choices_in_flight = 0

    def over_limit(self, key: str, work: Work, *, at_all: bool = False) -> str | None:
        """The per-key limit `work` does not fit (in flight now, or `at_all`: even alone), as a
        message for the client; None when it fits.  Anonymous work has no per-key limit."""
        if key == ANONYMOUS:
            return None
        account = self._accounts.get(key, _Account())
        held_choices = 0 if at_all else account.num_choices
        held_tokens = 0 if at_all else account.num_tokens
        limits = self.limits
        if limits.max_choices and held_choices + work.num_choices > limits.max_choices:
            return (
                f"this API key may have {limits.max_choices} completions in flight; "
                f"{held_choices} are and this request asks for {work.num_choices}"
            )
        if limits.max_tokens and held_tokens + work.num_tokens > limits.max_tokens:
            return (
                f"this API key may have {limits.max_tokens} tokens (prompt + max_tokens) in "
                f"flight; {held_tokens} are and this request asks for {work.num_tokens}"
            )
        return None

    def has_room(self, work: Work) -> bool:
        """Whether the engine's shared slots hold `work` now."""
        capacity = self.limits.capacity_choices
        return not capacity or self.num_choices_in_flight + work.num_choices <= capacity

    def share_order(self, key: str, seq: int) -> tuple[int, float, int]:
        """Who of the waiting goes first for a freed slot: the key holding the fewest slots,
        then the one served least (its virtual token counter), then the earliest."""
        return self.in_flight(key)[0], self.served_tokens(key), seq

    def served_tokens(self, key: str) -> float:
        """The key's virtual token counter."""
        account = self._accounts.get(key)
        return 0.0 if account is None else account.served_tokens

    def enter(self, key: str) -> None:
        """`key` has a request waiting or in flight; an idle key is lifted to the least
        counter of the active ones (VTC: no credit for idle time)."""
        account = self._accounts.setdefault(key, _Account())
        if not account.is_active:
            active = [a.served_tokens for a in self._accounts.values() if a.is_active]
            if active:
                account.served_tokens = max(account.served_tokens, min(active))
        account.num_waiting += 1

    def take(self, key: str, work: Work) -> None:
        """A request of `key` (entered) starts: its work is in flight and charged."""
        account = self._accounts[key]
        account.num_waiting -= 1
        account.num_choices += work.num_choices
        account.num_tokens += work.num_tokens
        account.served_tokens += work.num_tokens
        self.num_choices_in_flight += work.num_choices

    def leave(self, key: str) -> None:
        """A request of `key` (entered) gave up waiting."""
        account = self._accounts[key]
        account.num_waiting -= 1
        self._forget_if_idle(key)

    def give_back(self, key: str, work: Work, num_tokens_used: int) -> None:
        """A request of `key` ended having used `num_tokens_used` of its work's tokens: the
        rest is refunded from its counter."""
        account = self._accounts[key]
        account.num_choices -= work.num_choices
        account.num_tokens -= work.num_tokens
        account.served_tokens -= max(0, work.num_tokens - num_tokens_used)
        self.num_choices_in_flight -= work.num_choices
        self._forget_if_idle(key)

    def in_flight(self, key: str) -> tuple[int, int]:
        """(choices, tokens) of `key` in flight."""
        account = self._accounts.get(key, _Account())
        return account.num_choices, account.num_tokens

    def _forget_if_idle(self, key: str) -> None:
        # An idle account's counter is not needed: it is lifted on its next entry anyway.
        account = self._accounts[key]
        if not account.is_active:
            del self._accounts[key]


@dataclass
class _Waiter:
    key: str
    work: Work
    seq: int
    ready: asyncio.Event = field(default_factory=asyncio.Event)


class Admission:
    """A request's work in flight; `release()` (idempotent) ends it."""

    def __init__(self, gate: KeyGate, key: str, work: Work) -> None:
        self._gate, self.key, self.work = gate, key, work
        self._released = False

    def release(self, num_tokens_used: int) -> None:
        """The request ended having used this many of its work's tokens (prompts + outputs)."""
        if not self._released:
            self._released = True
            self._gate._release(self, num_tokens_used)


class KeyGate:
    """Admits requests by `KeyLedger`'s rule, keeping those that wait for a slot in order of
    their key's service (least first; ties by arrival)."""

    def __init__(self, limits: KeyLimits) -> None:
        self.ledger = KeyLedger(limits)
        self._waiters: list[_Waiter] = []
        self._seq = itertools.count()

    @property
    def num_waiting(self) -> int:
        return len(self._waiters)

    async def admit(self, key: str | None, work: Work) -> Admission:
        """Wait for room for `work` and take it; ApiError(429) naming the limit when the key
        has no room for it, or the wait passes the queue timeout."""
        account = ANONYMOUS if key is None else key
        ledger = self.ledger
        refusal = ledger.over_limit(account, work, at_all=True) or ledger.over_limit(account, work)
        if refusal is not None:
            raise _too_many(refusal)
        ledger.enter(account)
        waiter = _Waiter(account, work, next(self._seq))
        if not self._waiters and ledger.has_room(work):
            ledger.take(account, work)
            return Admission(self, account, work)
        self._waiters.append(waiter)
        timeout = ledger.limits.queue_timeout_s
        try:
            await asyncio.wait_for(waiter.ready.wait(), timeout)
        except BaseException as err:
            if waiter.ready.is_set():  # admitted just as the wait ended: give it back
                ledger.give_back(account, work, 0)
            else:
                self._waiters.remove(waiter)
                ledger.leave(account)
            self._wake()  # (a later waiter may fit now)
            if isinstance(err, TimeoutError):
                raise _timed_out(timeout) from None
            raise
        return Admission(self, account, work)

    def _release(self, admission: Admission, num_tokens_used: int) -> None:
        self.ledger.give_back(admission.key, admission.work, num_tokens_used)
        self._wake()

    def _wake(self) -> None:
        """Admit waiters, least-served key first, while they fit (a waiter whose key has
        reached its own bound stays until its key's work ends)."""
        ledger = self.ledger
        while self._waiters:
            order = sorted(self._waiters, key=lambda w: ledger.share_order(w.key, w.seq))
            chosen = next(
                (
                    w
                    for w in order
                    if ledger.has_room(w.work) and ledger.over_limit(w.key, w.work) is None
                ),
                None,
            )
            if chosen is None:
                return
            self._waiters.remove(chosen)
            ledger.take(chosen.key, chosen.work)
            chosen.ready.set()


def _too_many(message: str) -> ApiError:
    return ApiError(
        429,
        message,
        type="rate_limit_error",
        code="rate_limit_exceeded",
        headers={"Retry-After": "1"},
    )


def _timed_out(timeout_s: float) -> ApiError:
    return ApiError(
        429,
        f"the engine is full and this request waited {timeout_s:g} s for its share",
        type="server_overloaded",
        code="server_overloaded",
        headers={"Retry-After": "1"},
    )
