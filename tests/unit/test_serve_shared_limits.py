"""Per-key limits shared by several ingress replicas, on a fake clock: the ledger's buckets and
slots, and SharedLimiter replicas leasing from one ledger (in process, standing in for the
coordinator actor) that together never admit more than a key's budget, hand idle leases back,
and keep serving on their own share when the coordinator is gone."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Coroutine, Sequence

import pytest

from pipeline.serve.access.keys import ApiKey, KeyLimits
from pipeline.serve.access.limit_coordinator import CoordinatorUnavailable
from pipeline.serve.access.limit_ledger import STALE_S, Ask, Grant, Ledger, Need, scaled
from pipeline.serve.access.limits import Limiter, LimitExceeded
from pipeline.serve.access.shared_limits import (
    LeaseTuning,
    SharedLease,
    SharedLimiter,
    admission_for,
)
from pipeline.serve.spec import ServeSpec


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class FakeCoordinator:
    """The coordinator actor's ledger in process; `dead` makes every exchange fail."""

    def __init__(self, ledger: Ledger) -> None:
        self.ledger = ledger
        self.dead = False
        self.calls = 0

    async def exchange(self, replica: str, asks: Sequence[Ask]) -> list[Grant]:
        self.calls += 1
        await asyncio.sleep(0)  # a real call yields to the event loop
        if self.dead:
            raise CoordinatorUnavailable("coordinator gone")
        return self.ledger.exchange(replica, asks)


# Rounds only when a request needs one, or when a test calls sync(): deterministic.
TUNING = LeaseTuning(replicas=2, refresh_s=3600, idle_s=2.0, contended_s=2.0, reconnect_s=0.01)


def key(name: str = "k", **limits: int) -> ApiKey:
    return ApiKey(name, KeyLimits(**limits))


def replicas(
    n: int = 2, tuning: LeaseTuning = TUNING
) -> tuple[Clock, FakeCoordinator, list[SharedLimiter]]:
    clock = Clock()
    coordinator = FakeCoordinator(Ledger(clock))
    limiters = [SharedLimiter(coordinator, f"r{i}", tuning, clock) for i in range(n)]
    return clock, coordinator, limiters


async def try_admit(limiter: SharedLimiter, k: ApiKey) -> SharedLease | LimitExceeded:
    try:
        return await limiter.acquire(k)
    except LimitExceeded as exc:
        return exc


def run(coroutine: Coroutine[None, None, None]) -> None:
    asyncio.run(coroutine)


# --- the ledger ----------------------------------------------------------------------------


def test_ledger_meets_needs_from_one_bucket_and_says_when_it_refills() -> None:
    clock = Clock()
    ledger = Ledger(clock)
    limits = KeyLimits(requests_per_minute=6)  # one per 10 s
    one = Ask("k", limits, needs=(Need(requests=1),), want_requests=2)
    (grant,) = ledger.exchange("a", [one])
    assert grant.outcomes == (None,) and grant.requests == 2  # 1 needed + 2 leased: 3 left
    (grant,) = ledger.exchange("b", [Ask("k", limits, needs=(Need(requests=1),) * 4)])
    refused = grant.outcomes[3]
    assert grant.outcomes[:3] == (None, None, None) and refused is not None
    assert refused.limit == "requests_per_minute"
    assert refused.wait_s == pytest.approx(10.0)  # the key's own bucket: one per 10 s
    # Contended now: a's lease comes back, but no refill is granted to anyone for a while,
    # so the units wait in the bucket for whoever needs them.
    (grant,) = ledger.exchange("a", [Ask("k", limits, give_requests=2, want_requests=5)])
    assert grant.contended and grant.requests == 0
    assert grant.requests_view is not None and grant.requests_view.level == pytest.approx(2.0)
    (grant,) = ledger.exchange("b", [Ask("k", limits, needs=(Need(requests=1),))])
    assert grant.outcomes == (None,)
    # Later, uncontended: refills again, and given back units never overfill the bucket.
    clock.now += 60
    (grant,) = ledger.exchange("a", [Ask("k", limits, want_requests=2)])
    assert not grant.contended and grant.requests == 2
    ledger.exchange("a", [Ask("k", limits, give_requests=5)])
    assert ledger.level("k", "requests_per_minute") == pytest.approx(6.0)


def test_ledger_slots_are_absolute_reports_that_expire() -> None:
    clock = Clock()
    ledger = Ledger(clock)
    limits = KeyLimits(max_concurrent=3)
    slot = Need(slots=1)
    (grant,) = ledger.exchange("a", [Ask("k", limits, needs=(slot, slot))])
    assert grant.outcomes == (None, None) and ledger.slots_out("k") == 2
    (grant,) = ledger.exchange("b", [Ask("k", limits, needs=(slot, slot))])
    assert grant.outcomes[0] is None
    assert grant.outcomes[1] is not None and grant.outcomes[1].limit == "max_concurrent"
    assert grant.outcomes[1].wait_s is None
    # a reports it holds one now (its reply may have been lost: the report is the truth).
    ledger.exchange("a", [Ask("k", limits, slots_held=1)])
    assert ledger.slots_out("k") == 2
    # b stops reporting (gone): after STALE_S its slot is free again, a's too unless repeated.
    clock.now += STALE_S / 2
    ledger.exchange("a", [Ask("k", limits, slots_held=1)])
    clock.now += STALE_S / 2 + 1
    ledger.exchange("c", [])
    assert ledger.slots_out("k") == 1


def test_ledger_follows_a_limits_change_and_carries_usage_over() -> None:
    clock = Clock()
    ledger = Ledger(clock)
    ledger.exchange("a", [Ask("k", KeyLimits(requests_per_minute=10), needs=(Need(1),) * 8)])
    ledger.exchange("a", [Ask("k", KeyLimits(requests_per_minute=20))])
    assert ledger.level("k", "requests_per_minute") == pytest.approx(2.0)
    ledger.exchange("a", [Ask("k", KeyLimits(requests_per_minute=1))])
    assert ledger.level("k", "requests_per_minute") == pytest.approx(1.0)


def test_a_share_divides_every_limit_rounding_up() -> None:
    limits = KeyLimits(requests_per_minute=5, tokens_per_minute=1000, max_concurrent=1)
    assert scaled(limits, 2) == KeyLimits(
        requests_per_minute=3, tokens_per_minute=500, max_concurrent=1
    )
    assert scaled(limits, 1) == limits


# --- replicas sharing one ledger -------------------------------------------------------------


@pytest.mark.parametrize("seed", range(5))
def test_two_replicas_never_admit_more_than_the_budget(seed: int) -> None:
    async def body() -> None:
        clock, coordinator, limiters = replicas()
        budget = 20
        k = key(requests_per_minute=budget)
        rng = random.Random(seed)
        admitted = 0
        # Bursts of concurrent requests over both replicas, rounds in between, no refill.
        for _ in range(8):
            picks = [rng.choice(limiters) for _ in range(rng.randint(1, 9))]
            results = await asyncio.gather(*(try_admit(lim, k) for lim in picks))
            for result in results:
                if isinstance(result, SharedLease):
                    admitted += 1
                    result.release()
                else:
                    assert result.limit == "requests_per_minute"
                    # Retry-After is the key's own refill time: 3 s per request.
                    assert 0 < result.retry_after_s <= 3.0 + 1e-6
            assert admitted <= budget
            await rng.choice(limiters).sync()
        # At the limit, idle leases come back (contended): within a few rounds the other
        # replica can use every unit, so no budget is stranded.
        clock.now += TUNING.idle_s + 0.1
        for limiter in limiters:
            await limiter.sync()
        for limiter in limiters:
            while not isinstance(result := await try_admit(limiter, k), LimitExceeded):
                admitted += 1
                result.release()
        assert admitted == budget
        # What is left is the refill of the 2.1 s that passed: less than one request.
        assert coordinator.ledger.level("k", "requests_per_minute") < 1

    run(body())


def test_within_a_lease_requests_make_no_remote_call() -> None:
    async def body() -> None:
        _, coordinator, (limiter, _) = replicas()
        k = key(requests_per_minute=1600)  # a slice: 1600 / (8 * 2) = 100 requests
        (await limiter.acquire(k)).release()
        assert coordinator.calls == 1  # the first request waited for one exchange
        for _ in range(40):
            (await limiter.acquire(k)).release()
        assert coordinator.calls == 1  # all from the lease; still above its low-water mark

    run(body())


def test_an_idle_lease_goes_back_to_the_ledger() -> None:
    async def body() -> None:
        # Idle after 10 ms: the buckets refill next to nothing meanwhile.
        tuning = LeaseTuning(replicas=2, refresh_s=3600, idle_s=0.01)
        clock, coordinator, (a, _) = replicas(tuning=tuning)
        k = key(requests_per_minute=160, tokens_per_minute=16000)  # slices: 10 and 1000
        lease = await a.acquire(k)
        await lease.charge(100)
        ledger = coordinator.ledger
        assert ledger.level("k", "requests_per_minute") == pytest.approx(160 - 1 - 10)
        # The first exchange leased a slice of tokens too: the charge came from it.
        assert ledger.level("k", "tokens_per_minute") == pytest.approx(16000 - 1000)
        assert coordinator.calls == 1
        lease.settle(30)  # used 30 of the 100 charged: 70 back into the lease
        lease.release()
        clock.now += 0.02
        await a.sync()
        # Everything unspent went back: only the 1 request and the 30 tokens stay used.
        assert ledger.level("k", "requests_per_minute") == pytest.approx(160 - 1, abs=0.1)
        assert ledger.level("k", "tokens_per_minute") == pytest.approx(16000 - 30, abs=10)
        calls = coordinator.calls
        await a.sync()  # nothing left to say: no call, and the empty lease is dropped
        assert coordinator.calls == calls and a.in_flight() == {}

    run(body())


def test_a_token_charge_over_the_budget_refuses_and_uncounts_the_request() -> None:
    async def body() -> None:
        _, _, (a, b) = replicas()
        k = key(requests_per_minute=100, tokens_per_minute=600)  # 10 tokens per second
        first = await a.acquire(k)
        await first.charge(500)
        second = await b.acquire(k)
        with pytest.raises(LimitExceeded) as err:
            await second.charge(200)  # 100 left in the bucket at most
        assert err.value.limit == "tokens_per_minute"
        assert "requested 200" in err.value.message
        # From the key's bucket: 100 tokens short at 10 per second, plus the slice (37) that
        # a's lease holds (it comes back once a syncs: the key is contended now).
        slice_ = TUNING.slice(600)
        assert err.value.retry_after_s == pytest.approx((100 + slice_) / 10)
        assert second.released and b.in_flight().get("k", 0) == 0

    run(body())


def test_max_concurrent_holds_over_replicas_and_slots_circulate() -> None:
    async def body() -> None:
        clock, coordinator, (a, b) = replicas()
        k = key(max_concurrent=2)
        held = [await a.acquire(k), await b.acquire(k)]
        refused = await try_admit(a, k)
        assert isinstance(refused, LimitExceeded) and refused.limit == "max_concurrent"
        assert refused.retry_after_s is None
        held[0].release()
        # a reuses its own freed slot without asking.
        calls = coordinator.calls
        again = await a.acquire(k)
        assert coordinator.calls == calls
        again.release()
        # b cannot have it while a holds it idle; once a is idle and syncs, b can.
        assert isinstance(await try_admit(b, k), LimitExceeded)
        clock.now += TUNING.idle_s + 0.1
        await a.sync()
        assert coordinator.ledger.slots_out("k") == 1
        lease = await b.acquire(k)
        assert b.in_flight() == {"k": 2}
        assert coordinator.ledger.slots_out("k") == 2
        lease.release()
        held[1].release()

    run(body())


def test_a_dead_coordinator_leaves_replicas_serving_their_share() -> None:
    async def body() -> None:
        clock, coordinator, (a, b) = replicas()
        coordinator.dead = True
        k, other = key(requests_per_minute=10, max_concurrent=4), key("other")
        counts = []
        for limiter in (a, b):
            admitted = 0
            while not isinstance(result := await try_admit(limiter, k), LimitExceeded):
                admitted += 1
                result.release()
            assert result.limit == "requests_per_minute"
            assert result.retry_after_s == pytest.approx(12.0)  # its share: 5 per minute
            counts.append(admitted)
            # Keys without limits never need the coordinator at all.
            (await limiter.acquire(other)).release()
        assert counts == [5, 5]  # half of the budget each: the limit holds in total
        # Back again: a finds it (the reconnect probe), and leases from it once more.
        coordinator.dead = False
        for _ in range(100):
            await asyncio.sleep(0.01)
            if not a._cut_off:
                break
        assert not a._cut_off
        clock.now += 60  # refills every bucket
        lease = await a.acquire(k)
        assert coordinator.ledger.level("k", "requests_per_minute") is not None
        lease.release()
        for limiter in (a, b):
            limiter.close()

    run(body())


def test_a_changed_limit_reaches_the_ledger_from_the_replicas() -> None:
    async def body() -> None:
        _, coordinator, (a, b) = replicas()
        for _ in range(3):
            (await a.acquire(key(requests_per_minute=4))).release()
        # Reloaded keys file: the limit is 2 now; the 3 used stay used.
        refused = await try_admit(b, key(requests_per_minute=2))
        assert isinstance(refused, LimitExceeded)
        assert refused.retry_after_s == pytest.approx(30.0, abs=0.5)
        # Lifted entirely: no coordinator involved.
        calls = coordinator.calls
        (await b.acquire(key())).release()
        assert coordinator.calls == calls

    run(body())


def test_one_ingress_replica_keeps_the_in_memory_limiter() -> None:
    spec = {
        "name": "s",
        "models": [
            {"name": "m", "model": {"path": "/m"}, "engine": {"kind": "reference"}},
            {"name": "n", "model": {"path": "/m"}, "engine": {"kind": "reference"}},
        ],
        "auth": {"api_keys_env": "X"},
    }
    one = ServeSpec.model_validate(spec)
    assert isinstance(admission_for(one, "app", "r"), Limiter)
    two = ServeSpec.model_validate({**spec, "http": {"ingress_replicas": 2}})
    assert isinstance(admission_for(two, "app", "r"), SharedLimiter)
