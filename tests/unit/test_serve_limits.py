"""Per-key limits on a fake clock: token buckets, Retry-After from the key's own budget, the
up-front token charge and its settlement, max_concurrent, reconfiguration, the ingress gate."""

from __future__ import annotations

import pytest

from pipeline.serve.access.keys import ApiKey, KeyLimits
from pipeline.serve.access.limits import (
    Gate,
    Limiter,
    LimitExceeded,
    TokenBucket,
    retry_after_header,
)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def key(name: str = "k", **limits: int) -> ApiKey:
    return ApiKey(name, KeyLimits(**limits))


def refused(limiter: Limiter, k: ApiKey) -> LimitExceeded:
    with pytest.raises(LimitExceeded) as err:
        limiter.admit(k)
    return err.value


def test_bucket_refills_continuously_and_allows_debt() -> None:
    bucket = TokenBucket.per_minute(60, now=0.0)  # 1 per second, holds 60
    assert bucket.wait_s(60, 0.0) == 0
    bucket.take(60, 0.0)
    assert bucket.wait_s(1, 0.0) == pytest.approx(1.0)
    assert bucket.wait_s(30, 10.0) == pytest.approx(20.0)  # holds 10 at t=10
    # More than a minute's worth needs a full bucket, and leaves a debt behind.
    assert bucket.wait_s(100, 10.0) == pytest.approx(50.0)
    bucket.take(100, 60.0)
    assert bucket.level == pytest.approx(-40.0)
    assert bucket.wait_s(1, 60.0) == pytest.approx(41.0)
    bucket.give(500, 200.0)
    assert bucket.level == 60  # never above its size


def test_retry_after_is_whole_seconds_rounded_up() -> None:
    assert [retry_after_header(s) for s in (0.0, 0.2, 1.0, 1.01, 19.5)] == [
        "1",
        "1",
        "1",
        "2",
        "20",
    ]


def test_requests_per_minute_refuses_with_its_own_retry_after() -> None:
    clock = Clock()
    limiter = Limiter(clock)
    tight, free = key("tight", requests_per_minute=3), key("free")
    for _ in range(3):
        limiter.admit(tight).release()
    err = refused(limiter, tight)
    assert err.limit == "requests_per_minute" and err.key == "tight"
    assert err.retry_after_s == pytest.approx(20.0)  # one request per 20 s
    assert "requests per min" in err.message and "tight" in err.message
    # Another key is not affected.
    for _ in range(10):
        limiter.admit(free).release()
    clock.now += 5
    assert refused(limiter, tight).retry_after_s == pytest.approx(15.0)
    clock.now += 15
    limiter.admit(tight).release()


def test_tokens_are_charged_up_front_and_settled_to_use() -> None:
    clock = Clock()
    limiter = Limiter(clock)
    k = key(tokens_per_minute=600)  # 10 tokens per second
    first = limiter.admit(k)
    first.charge_tokens(500)  # prompt 100 + max_tokens 400
    second = limiter.admit(k)
    with pytest.raises(LimitExceeded) as err:
        second.charge_tokens(200)  # 100 left: 100 more needed
    assert err.value.limit == "tokens_per_minute"
    assert err.value.retry_after_s == pytest.approx(10.0)
    assert "requested 200" in err.value.message
    assert second.released  # a refused charge gives the lease back
    # The first used 100 + 50: 350 come back, so the next 200 fit at once.
    first.settle(150)
    first.release()
    third = limiter.admit(k)
    third.charge_tokens(200)
    # Unknown use (client gone): the charge stands. Settling twice changes nothing.
    third.settle(None)
    third.settle(None)
    budget = limiter._budgets["k"].tokens
    assert budget is not None and budget.level == pytest.approx(600 - 150 - 200)


def test_a_request_larger_than_the_budget_runs_once_the_bucket_is_full() -> None:
    clock = Clock()
    limiter = Limiter(clock)
    k = key(requests_per_minute=2, tokens_per_minute=100)
    big = limiter.admit(k)
    big.charge_tokens(1000)  # full bucket: admitted, 900 in debt
    big.release()
    small = limiter.admit(k)
    with pytest.raises(LimitExceeded) as err:
        small.charge_tokens(10)
    assert err.value.retry_after_s == pytest.approx((900 + 10) / (100 / 60))
    # The refused charge un-counted its request: the second request of the minute is free.
    limiter.admit(k).release()


def test_max_concurrent_counts_until_release() -> None:
    limiter = Limiter(Clock())
    k = key(max_concurrent=2)
    a, b = limiter.admit(k), limiter.admit(k)
    err = refused(limiter, k)
    assert err.limit == "max_concurrent" and err.retry_after_s is None
    a.release()
    a.release()  # idempotent
    c = limiter.admit(k)
    assert limiter.in_flight() == {"k": 2}
    b.release()
    c.release()
    assert limiter.in_flight() == {"k": 0}


def test_changed_limits_carry_the_used_budget_over() -> None:
    clock = Clock()
    limiter = Limiter(clock)
    for _ in range(10):
        limiter.admit(key(requests_per_minute=10)).release()
    # Raised to 20 by a reload: the 10 used stay used (the bucket keeps its level, 0).
    err = refused(limiter, key(requests_per_minute=20))
    assert err.retry_after_s == pytest.approx(3.0)  # 20 per minute: one per 3 s
    # Lifted entirely.
    limiter.admit(key()).release()
    # A key no longer accepted is forgotten once idle; re-added it starts afresh.
    limiter.forget(set())
    assert limiter.in_flight() == {}


def test_gate_refuses_instead_of_queueing() -> None:
    gate = Gate(2)
    assert gate.try_take() and gate.try_take()
    assert not gate.try_take()
    gate.give()
    assert gate.try_take() and gate.in_use == 2
