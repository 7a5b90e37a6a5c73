"""The authoritative per-key budgets that ingress replicas lease from: one ledger per Serve app.

With several ingress replicas a key's budgets must be counted in one place, or each replica
would grant the whole budget again. The ledger holds, per key, the requests_per_minute and
tokens_per_minute buckets (pipeline.serve.access.limits.TokenBucket, the same refill rule as one
replica's) and which replica holds how many of its max_concurrent slots. Replicas never ask it
per request: each holds a lease (a few units of each budget, taken from the buckets here) and
admits from it locally, and talks to the ledger in batched `exchange` calls
(pipeline.serve.access.shared_limits):

- `give_*`: unspent units handed back (a negative amount is a debt: tokens a request used
  beyond its charge), so an idle or contended replica sits on nothing;
- `slots_held`: the slots the replica holds now, absolute, so a lost reply or a restart of
  either side is corrected by the next report; a report older than `STALE_S` is dropped (a
  replica that stopped reporting has stopped or lost touch: its slots must not stay taken);
- `needs`: what requests waiting right now need, each all or nothing, answered in order with
  the refusal (which budget, and when that key's own bucket will hold the amount);
- `want_*`: a refill of the requests and tokens lease, granted as far as the buckets hold it
  and never while the key is contended (a need was refused within `CONTENDED_S`), so that at
  the limit no unit sits idle in one replica while another refuses.

Every unit a replica spends was taken from a bucket here first, so the total admitted over all
replicas is what one bucket admits (a key's budget per minute plus one bucket over any long
stretch); slots held over all replicas never exceed max_concurrent. Units given back go back
into the bucket (up to its size); units lost with a replica are lost, which only under-admits.

The ledger runs in the coordinator actor (pipeline.serve.access.limit_coordinator) and, with
`share` = N, inside a replica that cannot reach the coordinator: every limit is then divided
by N (rounded up) so N replicas on their own still hold the limit in total.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from pipeline.serve.access.keys import KeyLimits
from pipeline.serve.access.limits import LimitName, TokenBucket, bucket_for

STALE_S = 10.0  # a replica's slot report lasts this long unless repeated
CONTENDED_S = 5.0  # after a refusal, this long without prefetch for the key
SWEEP_INTERVAL_S = 1.0  # how often stale reports and idle keys are cleared out


@dataclass(frozen=True)
class Need:
    """What one waiting request needs now: all of it or nothing."""

    requests: int = 0
    tokens: int = 0
    slots: int = 0


@dataclass(frozen=True)
class Ask:
    """One replica's exchange for one key (what it gives back, holds, needs and wants)."""

    key: str
    limits: KeyLimits  # the replica's view of the keys file: the ledger follows a change
    give_requests: float = 0.0  # unspent requests handed back; negative: a debt
    give_tokens: float = 0.0
    slots_held: int = 0  # slots this replica holds now (in use and idle), before `needs`
    needs: tuple[Need, ...] = ()
    want_requests: float = 0.0  # a refill of the lease (slots are never prefetched: they
    want_tokens: float = 0.0  # circulate, a replica keeps the ones it used while busy)


@dataclass(frozen=True)
class Refusal:
    """A need the key's budget cannot meet now; wait_s: when its bucket will hold it
    (None for max_concurrent: no refill time exists)."""

    limit: LimitName
    wait_s: float | None


@dataclass(frozen=True)
class BucketView:
    """A bucket as the ledger saw it: lets a replica refuse locally until it has refilled."""

    capacity: float
    per_second: float
    level: float

    def bucket(self, now: float) -> TokenBucket:
        return TokenBucket(self.capacity, self.per_second, self.level, now)


@dataclass(frozen=True)
class Grant:
    """The answer to one Ask: each need met (None) or refused, plus the refill granted."""

    key: str
    outcomes: tuple[Refusal | None, ...]
    requests: float = 0.0  # refill granted, beyond the needs met
    tokens: float = 0.0
    contended: bool = False
    requests_view: BucketView | None = None
    tokens_view: BucketView | None = None


def scaled(limits: KeyLimits, share: int) -> KeyLimits:
    """Each of `share` replicas' part of a key's limits, rounded up (never below 1)."""
    if share <= 1:
        return limits

    def part(value: int | None) -> int | None:
        return None if value is None else max(1, math.ceil(value / share))

    return KeyLimits(
        requests_per_minute=part(limits.requests_per_minute),
        tokens_per_minute=part(limits.tokens_per_minute),
        max_concurrent=part(limits.max_concurrent),
    )


@dataclass
class _KeyState:
    limits: KeyLimits  # as asked (the replicas' view); the buckets use `share` of it
    requests: TokenBucket | None
    tokens: TokenBucket | None
    max_concurrent: int | None
    slots: dict[str, tuple[int, float]] = field(default_factory=dict)  # replica: (held, at)
    contended_until: float = 0.0

    def slots_out(self) -> int:
        return sum(held for held, _ in self.slots.values())

    def idle(self, now: float) -> bool:
        full = all(
            b is None or b.wait_s(b.capacity, now) == 0 for b in (self.requests, self.tokens)
        )
        return full and not self.slots_out() and now >= self.contended_until


class Ledger:
    """Every key's authoritative budgets; `exchange` is its only way in."""

    def __init__(self, clock: Callable[[], float] = time.monotonic, share: int = 1) -> None:
        self._clock = clock
        self._share = share
        self._keys: dict[str, _KeyState] = {}
        self._swept_at = clock()

    def exchange(self, replica: str, asks: Sequence[Ask]) -> list[Grant]:
        now = self._clock()
        if now - self._swept_at >= SWEEP_INTERVAL_S:
            self._sweep(now)
        return [self._one(replica, ask, now) for ask in asks]

    def _state(self, ask: Ask, now: float) -> _KeyState:
        state = self._keys.get(ask.key)
        limits = scaled(ask.limits, self._share)
        if state is None:
            state = self._keys[ask.key] = _KeyState(
                ask.limits,
                bucket_for(None, limits.requests_per_minute, now),
                bucket_for(None, limits.tokens_per_minute, now),
                limits.max_concurrent,
            )
        elif state.limits != ask.limits:
            # A reloaded keys file: the budget used so far carries over (as in one replica).
            # Replicas reload within reload_interval_s of each other, so for that long the
            # size may go back and forth; a resize never adds units, so that can only lose.
            state.limits = ask.limits
            state.requests = bucket_for(state.requests, limits.requests_per_minute, now)
            state.tokens = bucket_for(state.tokens, limits.tokens_per_minute, now)
            state.max_concurrent = limits.max_concurrent
        return state

    def _one(self, replica: str, ask: Ask, now: float) -> Grant:
        state = self._state(ask, now)
        for bucket, give in ((state.requests, ask.give_requests), (state.tokens, ask.give_tokens)):
            if bucket is not None and give > 0:
                bucket.give(give, now)
            elif bucket is not None and give < 0:
                bucket.take(-give, now)
        held = ask.slots_held if state.max_concurrent is not None else 0
        if held:
            state.slots[replica] = (held, now)
        else:
            state.slots.pop(replica, None)
        outcomes = tuple(self._need(state, replica, need, now) for need in ask.needs)
        if any(outcome is not None for outcome in outcomes):
            state.contended_until = now + CONTENDED_S
        contended = now < state.contended_until
        granted_requests = granted_tokens = 0.0
        if not contended:
            granted_requests = _prefetch(state.requests, ask.want_requests, now)
            granted_tokens = _prefetch(state.tokens, ask.want_tokens, now)
        return Grant(
            ask.key,
            outcomes,
            granted_requests,
            granted_tokens,
            contended,
            _view(state.requests, now),
            _view(state.tokens, now),
        )

    def _need(self, state: _KeyState, replica: str, need: Need, now: float) -> Refusal | None:
        # The same order of checks as one replica: concurrency, requests, then tokens.
        slots_full = (
            state.max_concurrent is not None
            and state.slots_out() + need.slots > state.max_concurrent
        )
        if need.slots and slots_full:
            return Refusal("max_concurrent", None)
        if need.requests and state.requests is not None:
            wait = state.requests.wait_s(need.requests, now)
            if wait > 0:
                return Refusal("requests_per_minute", wait)
        if need.tokens and state.tokens is not None:
            wait = state.tokens.wait_s(need.tokens, now)
            if wait > 0:
                return Refusal("tokens_per_minute", wait)
        if need.slots and state.max_concurrent is not None:
            self._add_slots(state, replica, need.slots, now)
        if need.requests and state.requests is not None:
            state.requests.take(need.requests, now)
        if need.tokens and state.tokens is not None:
            state.tokens.take(need.tokens, now)
        return None

    @staticmethod
    def _add_slots(state: _KeyState, replica: str, count: int, now: float) -> None:
        held, _ = state.slots.get(replica, (0, now))
        state.slots[replica] = (held + count, now)

    def _sweep(self, now: float) -> None:
        self._swept_at = now
        for name in list(self._keys):
            state = self._keys[name]
            state.slots = {r: s for r, s in state.slots.items() if now - s[1] < STALE_S}
            # A key whose buckets are full and holds nothing is what a new one would be.
            if state.idle(now):
                del self._keys[name]

    def slots_out(self, key: str) -> int:
        state = self._keys.get(key)
        return state.slots_out() if state else 0

    def level(self, key: str, limit: LimitName) -> float | None:
        """A bucket's level now (tests and introspection)."""
        state = self._keys.get(key)
        bucket = None
        if state is not None:
            bucket = state.requests if limit == "requests_per_minute" else state.tokens
        if bucket is None:
            return None
        bucket.wait_s(0, self._clock())  # refills to now
        return bucket.level


def _prefetch(bucket: TokenBucket | None, want: float, now: float) -> float:
    """Whole units up to `want`, as far as the bucket holds them (never into debt)."""
    if bucket is None or want <= 0:
        return 0.0
    bucket.wait_s(0, now)  # refill to now
    granted = float(min(math.floor(want), math.floor(max(bucket.level, 0.0))))
    if granted > 0:
        bucket.take(granted, now)
    return max(granted, 0.0)


def _view(bucket: TokenBucket | None, now: float) -> BucketView | None:
    if bucket is None:
        return None
    bucket.wait_s(0, now)  # refill to now
    return BucketView(bucket.capacity, bucket.per_second, bucket.level)
