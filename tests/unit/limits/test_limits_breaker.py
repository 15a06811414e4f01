"""The circuit breaker's state machine, driven by explicit times."""

from __future__ import annotations

from limits.breaker import BreakerConfig, BreakerState, CircuitBreaker


def make() -> CircuitBreaker:
    return CircuitBreaker(BreakerConfig(failures=3, cooldown_s=2.0, probe_timeout_s=5.0))


def test_opens_after_consecutive_failures_only() -> None:
    b = make()
    assert not b.record_failure(0.0)
    assert not b.record_failure(0.1)
    b.record_success()  # a success resets the count
    assert not b.record_failure(0.2)
    assert not b.record_failure(0.3)
    assert b.record_failure(0.4)  # third in a row: opened
    assert b.state is BreakerState.OPEN and b.degraded
    assert not b.allow(0.5)


def test_half_open_lets_one_probe_through() -> None:
    b = make()
    for t in (0.0, 0.0, 0.0):
        b.record_failure(t)
    assert not b.allow(1.99)
    assert b.allow(2.0)  # cool-down over: this call is the probe
    assert b.state is BreakerState.HALF_OPEN
    assert not b.allow(2.1)  # others wait for the probe's verdict
    assert b.record_success()  # recovered
    assert b.state is BreakerState.CLOSED and b.allow(2.2)


def test_failed_probe_reopens_for_another_cooldown() -> None:
    b = make()
    for _ in range(3):
        b.record_failure(0.0)
    assert b.allow(2.0)
    assert not b.record_failure(2.05)  # already degraded: not a new opening
    assert b.state is BreakerState.OPEN
    assert not b.allow(4.0)
    assert b.allow(4.05)


def test_silent_probe_is_replaced() -> None:
    b = make()
    for _ in range(3):
        b.record_failure(0.0)
    assert b.allow(2.0)
    assert not b.allow(6.9)
    assert b.allow(7.0)  # the first probe never reported back within 5 s
    b.abandon_probe()
    assert b.allow(7.1)
