"""Admission limits of an ingress replica: per-key budgets and the replica's own slots.

Per key (pipeline.serve.access.keys.KeyLimits):
- requests_per_minute and tokens_per_minute are token buckets holding one minute's budget,
  refilled continuously at budget/60 per second. A request is admitted when the bucket holds
  what it needs, or the whole bucket when it needs more than a minute's budget (so a request
  larger than the budget is still possible, once the bucket is full); it is then charged its
  full amount, and the bucket may go below zero. Later requests wait until it refills, so over
  any long stretch a key gets at most its budget per minute plus one bucket.
- tokens: admission charges prompt tokens + max_tokens (the most the request can use, known
  before it runs); when the request ends the charge is settled to the prompt + completion
  tokens it really used and the rest refunded. A request whose outcome is unknown (the
  client went away) keeps its full charge.
- max_concurrent counts requests from admission to their last byte.
A refusal says which budget and when it will allow the request: Retry-After is the time that
key's own bucket needs to refill to the amount (never another key's). For max_concurrent no
refill time exists; the caller's default applies.

`Gate` caps what one ingress replica holds at once (requests, tokenizer queue): a full gate
refuses at once rather than queueing, so a flood meets 429s and bounded memory.

`Limiter` keeps every key's budget in this replica's memory, changed only on its event loop:
what an app with one ingress replica uses (no actor, no remote call). An app that can run
several (http.ingress_replicas > 1, or one_hop with several model replicas) uses
pipeline.serve.access.shared_limits.SharedLimiter instead, which leases budget from one coordinator
per app so the limits hold over all replicas together (the bounds are in its docstring); both
are `Admission`s, and app.py sees only that and `RequestLease`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal, Protocol

from pipeline.serve.access.keys import ApiKey, KeyLimits

LimitName = Literal["requests_per_minute", "tokens_per_minute", "max_concurrent"]


@dataclass
class TokenBucket:
    """`capacity` units, refilled at `per_second`; the level may go negative (debt)."""

    capacity: float
    per_second: float
    level: float
    at: float  # clock time of `level`

    @classmethod
    def per_minute(cls, budget: int, now: float) -> TokenBucket:
        return cls(float(budget), budget / 60.0, float(budget), now)

    def _refill(self, now: float) -> None:
        if now > self.at:
            self.level = min(self.capacity, self.level + (now - self.at) * self.per_second)
            self.at = now

    def wait_s(self, amount: float, now: float) -> float:
        """Seconds until the bucket holds `amount` (or, for more than it can hold, is full)."""
        self._refill(now)
        need = min(amount, self.capacity)
        return 0.0 if self.level >= need else (need - self.level) / self.per_second

    def take(self, amount: float, now: float) -> None:
        self._refill(now)
        self.level -= amount

    def give(self, amount: float, now: float) -> None:
        self._refill(now)
        self.level = min(self.capacity, self.level + amount)

    def resized(self, budget: int, now: float) -> TokenBucket:
        """The same bucket under a new budget: what it holds carries over, up to the new size."""
        self._refill(now)
        return TokenBucket(float(budget), budget / 60.0, min(self.level, float(budget)), now)


def retry_after_header(seconds: float) -> str:
    """Retry-After takes whole seconds: rounded up, at least 1."""
    return str(max(1, math.ceil(seconds - 1e-9)))


class LimitExceeded(Exception):
    """A key is over one of its limits; retry_after_s is when that budget allows the request
    (None: unknown, as for max_concurrent)."""

    def __init__(
        self, key: str, limit: LimitName, message: str, retry_after_s: float | None
    ) -> None:
        super().__init__(message)
        self.key, self.limit, self.message, self.retry_after_s = key, limit, message, retry_after_s


def concurrency_exceeded(key: str, limits: KeyLimits) -> LimitExceeded:
    return LimitExceeded(
        key,
        "max_concurrent",
        f"Concurrency limit reached for key '{key}': {limits.max_concurrent} "
        "requests in flight at once. Retry when one of them has finished.",
        None,
    )


def requests_exceeded(key: str, limits: KeyLimits, wait: float) -> LimitExceeded:
    return LimitExceeded(
        key,
        "requests_per_minute",
        f"Rate limit reached for key '{key}' on requests per min: limit "
        f"{limits.requests_per_minute}. Try again in {retry_after_header(wait)}s.",
        wait,
    )


def tokens_exceeded(key: str, limits: KeyLimits, amount: int, wait: float) -> LimitExceeded:
    return LimitExceeded(
        key,
        "tokens_per_minute",
        f"Rate limit reached for key '{key}' on tokens per min: limit "
        f"{limits.tokens_per_minute}, requested {amount} (prompt tokens + max_tokens). Try "
        f"again in {retry_after_header(wait)}s, or lower max_tokens.",
        wait,
    )


class RequestLease(Protocol):
    """One admitted request's hold on its key's limits, whoever keeps the books."""

    async def charge(self, amount: int) -> None:
        """Charge prompt + max_tokens; LimitExceeded (the request given back) if over."""

    def settle(self, used_tokens: int | None) -> None:
        """Settle the token charge to what the request used (None: unknown, it stands)."""

    def release(self) -> None:
        """The response is done: its concurrency slot goes back (idempotent)."""


class Admission(Protocol):
    """Per-key limits of one ingress replica: `Limiter` on its own (one ingress replica) or
    pipeline.serve.access.shared_limits.SharedLimiter (several, leasing from one coordinator)."""

    async def acquire(self, key: ApiKey) -> RequestLease:
        """Admit a new request against max_concurrent and requests_per_minute."""

    def in_flight(self) -> dict[str, int]:
        """Requests in flight in this replica, by key name."""

    def forget(self, keep: set[str]) -> None:
        """Drop idle state of keys no longer accepted."""

    def close(self) -> None:
        """Stop background work (replica shutdown)."""


class KeyBudget:
    """One key's buckets and in-flight count, under its current limits."""

    def __init__(self, limits: KeyLimits, now: float) -> None:
        self.limits = limits
        self.in_flight = 0
        self.requests: TokenBucket | None = None
        self.tokens: TokenBucket | None = None
        self.reconfigure(limits, now)

    def reconfigure(self, limits: KeyLimits, now: float) -> None:
        """New limits from a reloaded keys file: the budget used so far carries over."""
        self.limits = limits
        self.requests = bucket_for(self.requests, limits.requests_per_minute, now)
        self.tokens = bucket_for(self.tokens, limits.tokens_per_minute, now)


def bucket_for(old: TokenBucket | None, budget: int | None, now: float) -> TokenBucket | None:
    """A per-minute bucket for `budget` (None: no limit), carrying `old`'s level over."""
    if budget is None:
        return None
    if old is None:
        return TokenBucket.per_minute(budget, now)
    return old.resized(budget, now)


@dataclass
class Lease:
    """One admitted request's hold on its key's budget; `release` when the response is done."""

    key: str
    budget: KeyBudget
    clock: Callable[[], float]
    tokens_charged: int = 0
    released: bool = field(default=False, init=False)

    def charge_tokens(self, amount: int) -> None:
        """Charge prompt + max_tokens; LimitExceeded (and the lease is given back, its
        request un-counted) when the key's tokens_per_minute cannot take it now."""
        bucket = self.budget.tokens
        if bucket is None:
            return
        now = self.clock()
        wait = bucket.wait_s(amount, now)
        if wait > 0:
            self.refund_request()
            self.release()
            raise tokens_exceeded(self.key, self.budget.limits, amount, wait)
        bucket.take(amount, now)
        self.tokens_charged = amount

    async def charge(self, amount: int) -> None:
        self.charge_tokens(amount)

    def refund_request(self) -> None:
        if self.budget.requests is not None:
            self.budget.requests.give(1, self.clock())

    def settle(self, used_tokens: int | None) -> None:
        """Settle the token charge to what the request used (None: unknown, the charge
        stands). Refunds the difference; never twice."""
        bucket = self.budget.tokens
        if bucket is None or used_tokens is None or not self.tokens_charged:
            return
        difference = self.tokens_charged - used_tokens
        if difference > 0:
            bucket.give(difference, self.clock())
        elif difference < 0:
            bucket.take(-difference, self.clock())
        self.tokens_charged = used_tokens

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.budget.in_flight -= 1


class Limiter:
    """Every key's budget in this ingress replica, by key name."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._budgets: dict[str, KeyBudget] = {}

    def admit(self, key: ApiKey) -> Lease:
        """Count a new request against max_concurrent and requests_per_minute (tokens are
        charged once the prompt is tokenized: Lease.charge_tokens)."""
        now = self._clock()
        budget = self._budgets.get(key.name)
        if budget is None:
            budget = self._budgets[key.name] = KeyBudget(key.limits, now)
        elif budget.limits != key.limits:
            budget.reconfigure(key.limits, now)
        limits = key.limits
        if limits.max_concurrent is not None and budget.in_flight >= limits.max_concurrent:
            raise concurrency_exceeded(key.name, limits)
        if budget.requests is not None:
            wait = budget.requests.wait_s(1, now)
            if wait > 0:
                raise requests_exceeded(key.name, limits, wait)
            budget.requests.take(1, now)
        budget.in_flight += 1
        return Lease(key.name, budget, self._clock)

    async def acquire(self, key: ApiKey) -> Lease:
        return self.admit(key)

    def in_flight(self) -> dict[str, int]:
        return {name: b.in_flight for name, b in self._budgets.items()}

    def forget(self, keep: set[str]) -> None:
        """Drop idle budgets of keys no longer accepted (a re-added key starts afresh)."""
        for name in [n for n, b in self._budgets.items() if n not in keep and not b.in_flight]:
            del self._budgets[name]

    def close(self) -> None:
        pass  # nothing runs in the background


class Gate:
    """`capacity` slots taken without waiting: a full gate refuses instead of queueing."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.in_use = 0

    def try_take(self) -> bool:
        if self.in_use >= self.capacity:
            return False
        self.in_use += 1
        return True

    def give(self) -> None:
        self.in_use -= 1
