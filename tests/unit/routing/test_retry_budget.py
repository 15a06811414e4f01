"""Retry budget arithmetic: ratio per request, floor per second, capped at burst."""

from __future__ import annotations

import pytest

from routing.retry_budget import RetryBudget


def test_starts_full_and_spends_one_per_retry() -> None:
    b = RetryBudget(ratio=0.0, min_per_s=0.0, burst=3, now=0.0)
    assert [b.withdraw(0.0) for _ in range(4)] == [True, True, True, False]


def test_requests_earn_ratio_of_a_retry() -> None:
    b = RetryBudget(ratio=0.2, min_per_s=0.0, burst=10, now=0.0)
    while b.withdraw(0.0):
        pass
    # 5 requests x 0.2 = one retry; 4 requests are not enough.
    for _ in range(4):
        b.deposit(0.0)
    assert not b.withdraw(0.0)
    b.deposit(0.0)
    assert b.withdraw(0.0)
    assert not b.withdraw(0.0)


def test_floor_refills_with_time_up_to_burst() -> None:
    b = RetryBudget(ratio=0.0, min_per_s=2.0, burst=3, now=0.0)
    for _ in range(3):
        assert b.withdraw(0.0)
    assert not b.withdraw(0.4)  # 0.4 s x 2/s = 0.8 retries
    assert b.withdraw(0.5)  # 1.0
    assert b.balance == pytest.approx(0.0)
    b.deposit(100.0)  # 200 retries' worth of time, capped at 3
    assert b.balance == 3


def test_storm_is_bounded_by_ratio() -> None:
    # 1000 failing requests at ratio 0.1 and burst 10: at most 10 + 100 retries.
    b = RetryBudget(ratio=0.1, min_per_s=0.0, burst=10, now=0.0)
    retries = 0
    for _ in range(1000):
        b.deposit(0.0)
        retries += b.withdraw(0.0)
    assert retries <= 110


def test_burst_below_one_is_refused() -> None:
    with pytest.raises(ValueError):
        RetryBudget(0.2, 1.0, 0.5, 0.0)
