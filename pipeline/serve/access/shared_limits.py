"""Per-key limits of one ingress replica among several: admission from a lease on the app's
ledger (pipeline.serve.access.limit_ledger), so the limits hold over all ingress replicas together.

Each replica holds, per key, a lease: a few requests and tokens taken from the key's buckets in
the coordinator, and the max_concurrent slots it was given. A request that its key's lease
covers is admitted here and now, with no remote call; a background task refills a lease that
runs low (below half of a slice: 1/(LeaseTuning.slices * N) of a minute's budget, at least
one unit), hands back what an idle (`idle_s`) or contended key holds and any excess, and
reports the slots held, all in one batched `exchange` per round (at most every `refresh_s`,
sooner when woken). Only a request its lease cannot cover waits for a round, which then
carries its need; requests waiting together share that call.

What holds, N being the most ingress replicas the app can have:
- The coordinator reachable: every admitted unit was taken from the key's one bucket first,
  so over all replicas a key gets at most what one bucket allows, its budget per minute plus
  one bucket (the one-replica bound), with no slack from the leasing; slots held over all
  replicas never exceed max_concurrent. Leasing can only under-admit: up to N slices (an
  eighth of a minute's budget at most) sit in other replicas' leases; at the limit a refusal
  marks the key contended, and within about two rounds they hand everything back and stop
  refilling, so the next try after Retry-After finds it. Retry-After is still that key's own
  bucket's refill time.
- The coordinator unreachable (it died, or an exchange took over its timeout): the replica
  keeps serving from a Ledger of its own with every limit divided by N (rounded up), the
  slots it already holds counted in it, and retries the coordinator every `reconnect_s`.
  While every replica is cut off a key gets at most its limits in total (plus up to N - 1
  units of each from rounding up); the switch itself can admit up to one more minute's
  budget (the own ledgers start full), and a coordinator Ray restarts starts full too.
- A keys-file reload: each exchange carries the replica's limits, so the coordinator follows a
  change when the first replica that reloaded the file talks to it; the budget used so far
  carries over, as with one replica.
With one ingress replica none of this runs: pipeline.serve.access.limits.Limiter, all in memory.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from pipeline.serve.access.keys import ApiKey, KeyLimits
from pipeline.serve.access.limit_coordinator import (
    Coordinator,
    CoordinatorUnavailable,
    RemoteCoordinator,
)
from pipeline.serve.access.limit_ledger import STALE_S, Ask, Grant, Ledger, Need, Refusal
from pipeline.serve.access.limits import (
    Admission,
    Limiter,
    LimitExceeded,
    LimitName,
    TokenBucket,
    concurrency_exceeded,
    requests_exceeded,
    tokens_exceeded,
)
from pipeline.serve.spec import ServeSpec

logger = logging.getLogger(__name__)

NOTHING = Need()


@dataclass(frozen=True)
class LeaseTuning:
    replicas: int  # N: the most ingress replicas the app can have (fallback share)
    slices: int = 8  # a lease holds at most 1/(slices * N) of a minute's budget
    refresh_s: float = 0.5  # rounds: refills, hand-backs, slot reports, contention news
    idle_s: float = 2.0  # a key unused this long hands its lease back
    contended_s: float = 2.0  # after the ledger said contended: no refills, views refreshed
    reconnect_s: float = 5.0  # while cut off, how often the coordinator is tried again

    def slice(self, budget: int) -> float:
        return float(max(1, math.floor(budget / (self.slices * self.replicas))))


@dataclass
class KeyHold:
    """One key's lease in this replica."""

    limits: KeyLimits
    used_at: float
    requests: float = 0.0  # leased, unspent
    tokens: float = 0.0  # leased, unspent; negative: used beyond the charges (a debt)
    slots: int = 0  # slots held, in use or idle (in use: in_flight)
    in_flight: int = 0
    contended_until: float = 0.0
    reported_at: float = -math.inf  # last slot report (it expires in the ledger after STALE_S)
    slots_changed: bool = False  # slots handed back, not yet reported
    views: dict[LimitName, TokenBucket] = field(default_factory=dict)  # the ledger's buckets

    def contended(self, now: float) -> bool:
        return now < self.contended_until


@dataclass
class _Waiter:
    """A request its lease did not cover, waiting for the next round."""

    key: str
    hold: KeyHold
    need: Need  # what the request needs in all (not only what the lease lacks)
    admit: bool  # a new request (it counts in flight), not a token charge
    future: asyncio.Future[None]
    reserved: Need = NOTHING  # what the lease covered, taken while the round runs


class SharedLimiter:
    """Admission from leases; see the module docstring."""

    def __init__(
        self,
        coordinator: Coordinator,
        replica: str,
        tuning: LeaseTuning,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._coordinator = coordinator
        self._replica = replica
        self._tuning = tuning
        self._clock = clock
        self._holds: dict[str, KeyHold] = {}
        self._waiting: list[_Waiter] = []
        self._own: Ledger | None = None  # the fallback ledger, made at the first failure
        self._cut_off = False
        self._task: asyncio.Task[None] | None = None
        self._probe: asyncio.Task[None] | None = None
        self._wake: asyncio.Event | None = None
        self._round_lock: asyncio.Lock | None = None

    # --- admission (the request path) ---------------------------------------------------

    async def acquire(self, key: ApiKey) -> SharedLease:
        now = self._clock()
        hold = self._hold(key, now)
        limits = hold.limits
        need = Need(
            requests=1 if limits.requests_per_minute is not None else 0,
            slots=1 if limits.max_concurrent is not None else 0,
        )
        if not self._take(hold, need, admit=True):
            if need.requests and hold.requests < 1:
                self._refuse_from_view(key.name, hold, "requests_per_minute", 1, now)
            await self._wait(key.name, hold, need, admit=True)
        hold.used_at = now
        self._low_water(hold)
        return SharedLease(key.name, hold, self)

    async def charge(self, key: str, hold: KeyHold, amount: int) -> None:
        """Take prompt + max_tokens from the key's tokens lease (a round if it falls short)."""
        if hold.limits.tokens_per_minute is None:
            return
        need = Need(tokens=amount)
        if not self._take(hold, need, admit=False):
            self._refuse_from_view(key, hold, "tokens_per_minute", amount, self._clock())
            await self._wait(key, hold, need, admit=False)
        self._low_water(hold)

    @staticmethod
    def _take(hold: KeyHold, need: Need, admit: bool) -> bool:
        """Take the whole need from the lease, if it covers it."""
        if hold.requests < need.requests or hold.tokens < need.tokens:
            return False
        if need.slots and hold.slots - hold.in_flight < need.slots:
            return False
        hold.requests -= need.requests
        hold.tokens -= need.tokens
        if admit:
            hold.in_flight += 1  # in one of its slots, when it has max_concurrent
        return True

    def _refuse_from_view(
        self, key: str, hold: KeyHold, limit: LimitName, amount: int, now: float
    ) -> None:
        """A contended key whose bucket, as last seen, cannot hold the amount yet: refuse here
        with its refill time instead of asking (a client hammering at its limit costs no
        remote calls). The view is refreshed every round while the key is contended."""
        view = hold.views.get(limit)
        if view is None or not hold.contended(now):
            return
        held = hold.requests if limit == "requests_per_minute" else hold.tokens
        # The ledger checks what this replica gives back plus its level, against the amount
        # (or a full bucket, for more than a minute's budget).
        need = min(float(amount), view.capacity) - held
        wait = view.wait_s(need, now) if need > 0 else 0.0
        if wait > 0:
            if limit == "requests_per_minute":
                raise requests_exceeded(key, hold.limits, wait)
            raise tokens_exceeded(key, hold.limits, amount, wait)

    async def _wait(self, key: str, hold: KeyHold, need: Need, admit: bool) -> None:
        self._start()
        assert self._wake is not None
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiting.append(_Waiter(key, hold, need, admit, future))
        self._wake.set()
        await future  # LimitExceeded when refused

    def _low_water(self, hold: KeyHold) -> None:
        """A lease below half a slice gets refilled now, before requests find it empty."""
        limits = hold.limits
        low = (
            limits.requests_per_minute is not None
            and hold.requests < self._tuning.slice(limits.requests_per_minute) / 2
        ) or (
            limits.tokens_per_minute is not None
            and hold.tokens < self._tuning.slice(limits.tokens_per_minute) / 2
        )
        if low and not hold.contended(self._clock()) and self._wake is not None:
            self._wake.set()

    def _hold(self, key: ApiKey, now: float) -> KeyHold:
        hold = self._holds.get(key.name)
        if hold is None:
            hold = self._holds[key.name] = KeyHold(key.limits, now)
        elif hold.limits != key.limits:
            # A reloaded keys file. Units of a budget that is gone are dropped (the ledger
            # drops its bucket too); slots in use count against a new max_concurrent.
            old, hold.limits = hold.limits, key.limits
            if key.limits.requests_per_minute is None:
                hold.requests = 0.0
            if key.limits.tokens_per_minute is None:
                hold.tokens = 0.0
            if key.limits.max_concurrent is None:
                hold.slots = 0
            elif old.max_concurrent is None:
                hold.slots = hold.in_flight  # reported, so they count
                hold.slots_changed = True
            hold.views.clear()
        return hold

    # --- the rounds (background) --------------------------------------------------------

    def _start(self) -> None:
        if self._task is None or self._task.done():
            self._wake = asyncio.Event()
            self._round_lock = asyncio.Lock()
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        assert self._wake is not None
        while True:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self._tuning.refresh_s)
            self._wake.clear()
            try:
                await self.sync()
            except Exception:  # never let the task die: requests would wait forever
                logger.exception("limits round failed")

    async def sync(self) -> None:
        """One round: serve waiting requests, refill, hand back, report. Rounds never overlap
        (the slot reports are absolute: one built before another's grant would be stale)."""
        if self._round_lock is None:
            self._start()
        assert self._round_lock is not None
        async with self._round_lock:
            now = self._clock()
            waiting, self._waiting = self._waiting, []
            asks = self._build(waiting, now)
            if not asks:
                return
            try:
                grants = await self._exchange(asks, now)
            except BaseException as exc:
                for waiter in waiting:
                    if not waiter.future.done():
                        self._unreserve(waiter)
                        if isinstance(exc, Exception):
                            waiter.future.set_exception(exc)
                        else:
                            waiter.future.cancel()
                raise
            self._apply(asks, grants, waiting, self._clock())

    async def _exchange(self, asks: list[Ask], now: float) -> list[Grant]:
        if not self._cut_off:
            try:
                return await self._coordinator.exchange(self._replica, asks)
            except CoordinatorUnavailable as exc:
                self._cut_off = True
                self._report_all_slots()
                logger.warning(
                    "%s; each ingress replica now enforces 1/%d of every key's limits on its "
                    "own until it is back",
                    exc,
                    self._tuning.replicas,
                )
                self._probe = asyncio.get_running_loop().create_task(self._reconnect())
        if self._own is None:
            self._own = Ledger(self._clock, share=self._tuning.replicas)
        return self._own.exchange(self._replica, asks)

    async def _reconnect(self) -> None:
        """While cut off: an empty exchange every reconnect_s until one is answered."""
        while self._cut_off:
            await asyncio.sleep(self._tuning.reconnect_s)
            try:
                await self._coordinator.exchange(self._replica, [])
            except CoordinatorUnavailable:
                continue
            logger.warning("limits coordinator reachable again: limits are shared again")
            self._cut_off = False
            self._report_all_slots()

    def _report_all_slots(self) -> None:
        """The other ledger learns this replica's slots in the next round."""
        for hold in self._holds.values():
            if hold.limits.max_concurrent is not None:
                hold.slots_changed = True

    def _build(self, waiting: list[_Waiter], now: float) -> list[Ask]:
        by_key: dict[str, list[_Waiter]] = {}
        for waiter in waiting:
            # An earlier round's refill (or a request's refund) may cover it by now.
            if self._take(waiter.hold, waiter.need, waiter.admit):
                waiter.future.set_result(None)
            else:
                by_key.setdefault(waiter.key, []).append(waiter)
        asks = []
        for name, hold in list(self._holds.items()):
            ask = self._ask(name, hold, by_key.get(name, []), now)
            if ask is not None:
                asks.append(ask)
            elif self._forgettable(hold, now):
                del self._holds[name]
        return asks

    def _ask(self, name: str, hold: KeyHold, waiters: list[_Waiter], now: float) -> Ask | None:
        limits, tuning = hold.limits, self._tuning
        keep = not (hold.contended(now) or (now - hold.used_at > tuning.idle_s))
        give_requests = give_tokens = want_requests = want_tokens = 0.0
        needs = []
        for waiter in waiters:
            needs.append(self._reserve(waiter))
        # A need in a budget gives back all of the lease in it, so the ledger checks the
        # whole of what this replica has (a request larger than the budget needs it full).
        if any(n.requests for n in needs):
            give_requests, hold.requests = hold.requests, 0.0
        if any(n.tokens for n in needs):
            give_tokens, hold.tokens = hold.tokens, 0.0
        if limits.requests_per_minute is not None and not give_requests:
            target = tuning.slice(limits.requests_per_minute) if keep else 0.0
            give_requests, want_requests = _rebalance(hold.requests, target)
            hold.requests -= give_requests
        if limits.tokens_per_minute is not None and not give_tokens:
            target = tuning.slice(limits.tokens_per_minute) if keep else 0.0
            give_tokens, want_tokens = _rebalance(hold.tokens, target)
            hold.tokens -= give_tokens
        report = False
        if limits.max_concurrent is not None:
            if not keep and hold.slots > hold.in_flight:
                hold.slots = hold.in_flight  # idle slots go back with this report
                hold.slots_changed = True
            # Reports are repeated well within STALE_S, after which the ledger drops them.
            report = hold.slots_changed or (
                hold.slots > 0 and now - hold.reported_at >= STALE_S / 4
            )
        if not (
            needs
            or give_requests
            or give_tokens
            or want_requests
            or want_tokens
            or report
            or hold.contended(now)  # refreshes the views local refusals use
        ):
            return None
        if limits.max_concurrent is not None:
            hold.reported_at, hold.slots_changed = now, False
        return Ask(
            name,
            limits,
            give_requests=give_requests,
            give_tokens=give_tokens,
            slots_held=hold.slots,
            needs=tuple(needs),
            want_requests=want_requests,
            want_tokens=want_tokens,
        )

    def _reserve(self, waiter: _Waiter) -> Need:
        """Take what the lease covers of a waiter's need now (so no later request takes it
        during the round); what it lacks goes to the ledger."""
        hold, need = waiter.hold, waiter.need
        missing_requests = need.requests and hold.requests < need.requests
        missing_tokens = need.tokens and hold.tokens < need.tokens
        missing_slots = need.slots and hold.slots - hold.in_flight < need.slots
        reserved = Need(
            requests=0 if missing_requests else need.requests,
            tokens=0 if missing_tokens else need.tokens,
            slots=0 if missing_slots else need.slots,
        )
        hold.requests -= reserved.requests
        hold.tokens -= reserved.tokens
        hold.in_flight += reserved.slots
        waiter.reserved = reserved
        return Need(
            requests=need.requests if missing_requests else 0,
            tokens=need.tokens if missing_tokens else 0,
            slots=need.slots if missing_slots else 0,
        )

    def _unreserve(self, waiter: _Waiter) -> None:
        reserved, hold = waiter.reserved, waiter.hold
        hold.requests += reserved.requests
        hold.tokens += reserved.tokens
        hold.in_flight -= reserved.slots
        waiter.reserved = NOTHING

    def _apply(
        self, asks: list[Ask], grants: list[Grant], waiting: list[_Waiter], now: float
    ) -> None:
        pending = {}
        for waiter in waiting:
            if not waiter.future.done():
                pending.setdefault(waiter.key, []).append(waiter)
        for ask, grant in zip(asks, grants, strict=True):
            waiters = pending.get(ask.key, [])
            for waiter, need, outcome in zip(waiters, ask.needs, grant.outcomes, strict=True):
                self._settle_waiter(waiter, need, outcome)
            hold = self._holds.get(ask.key)
            if hold is None:  # forgotten during the round (a removed key): refill lost
                continue
            hold.requests += grant.requests
            hold.tokens += grant.tokens
            if grant.contended:
                hold.contended_until = now + self._tuning.contended_s
            for limit, view in (
                ("requests_per_minute", grant.requests_view),
                ("tokens_per_minute", grant.tokens_view),
            ):
                if view is not None:
                    hold.views[limit] = view.bucket(now)

    def _settle_waiter(self, waiter: _Waiter, got: Need, outcome: Refusal | None) -> None:
        hold = waiter.hold
        if outcome is None:
            # Met: the new slot is this request's; requests and tokens were taken for it.
            hold.slots += got.slots
            if waiter.admit and not waiter.reserved.slots:
                hold.in_flight += 1  # in the slot just granted, or a key without slots
            waiter.future.set_result(None)
            return
        self._unreserve(waiter)
        waiter.future.set_exception(self._refusal(waiter, outcome))

    @staticmethod
    def _refusal(waiter: _Waiter, outcome: Refusal) -> LimitExceeded:
        limits = waiter.hold.limits
        if outcome.limit == "max_concurrent":
            return concurrency_exceeded(waiter.key, limits)
        wait = outcome.wait_s or 0.0
        if outcome.limit == "requests_per_minute":
            return requests_exceeded(waiter.key, limits, wait)
        return tokens_exceeded(waiter.key, limits, waiter.need.tokens, wait)

    def _forgettable(self, hold: KeyHold, now: float) -> bool:
        return (
            not hold.in_flight
            and not hold.slots
            and hold.requests == 0
            and hold.tokens == 0
            and not hold.contended(now)
            and now - hold.used_at > self._tuning.idle_s
        )

    # --- the rest of Admission -----------------------------------------------------------

    def in_flight(self) -> dict[str, int]:
        return {name: hold.in_flight for name, hold in self._holds.items()}

    def forget(self, keep: set[str]) -> None:
        """Drop idle leases of keys no longer accepted (their units are simply lost: the
        ledger forgets the key once its buckets are full again)."""
        waiting = {w.key for w in self._waiting}
        for name in [
            n
            for n, h in self._holds.items()
            if n not in keep and not h.in_flight and n not in waiting
        ]:
            del self._holds[name]

    def close(self) -> None:
        for task in (self._task, self._probe):
            if task is not None:
                task.cancel()

    # --- what a lease calls ----------------------------------------------------------------

    def refund_request(self, hold: KeyHold) -> None:
        if hold.limits.requests_per_minute is not None:
            hold.requests += 1

    def settle_tokens(self, hold: KeyHold, difference: int) -> None:
        """Charged minus used: a refund goes into the lease (and back in the next round if
        it is more than a slice); a debt is reported in the next round."""
        if hold.limits.tokens_per_minute is not None:
            hold.tokens += difference

    def release(self, hold: KeyHold) -> None:
        hold.in_flight -= 1
        hold.used_at = self._clock()


def _rebalance(held: float, target: float) -> tuple[float, float]:
    """(give back, want) to bring a lease to `target`: a debt is always reported, more than
    twice the target (refunds) goes back down to it, less than half is refilled."""
    if held < 0:
        return held, target
    if target == 0:
        return held, 0.0
    if held > 2 * target:
        return held - target, 0.0
    if held < target / 2:
        return 0.0, target - held
    return 0.0, 0.0


@dataclass
class SharedLease:
    """One admitted request's hold on its key's lease."""

    key: str
    hold: KeyHold
    limiter: SharedLimiter
    tokens_charged: int = 0
    released: bool = field(default=False, init=False)

    async def charge(self, amount: int) -> None:
        try:
            await self.limiter.charge(self.key, self.hold, amount)
        except LimitExceeded:
            # A request refused for tokens does not count against requests_per_minute.
            self.limiter.refund_request(self.hold)
            self.release()
            raise
        if self.hold.limits.tokens_per_minute is not None:
            self.tokens_charged = amount

    def settle(self, used_tokens: int | None) -> None:
        if used_tokens is None or not self.tokens_charged:
            return
        self.limiter.settle_tokens(self.hold, self.tokens_charged - used_tokens)
        self.tokens_charged = used_tokens

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.limiter.release(self.hold)


def admission_for(spec: ServeSpec, app_name: str, replica: str) -> Admission:
    """One ingress replica: its own Limiter (no actor, no remote call). Several: leases on
    the app's coordinator."""
    replicas = spec.max_ingress_replicas
    if replicas <= 1:
        return Limiter()
    return SharedLimiter(RemoteCoordinator(app_name), replica, LeaseTuning(replicas=replicas))
