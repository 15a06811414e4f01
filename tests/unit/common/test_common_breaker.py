"""The circuit breaker's state machine, driven by explicit times."""

from __future__ import annotations

from common.breaker import BreakerConfig, BreakerState, CircuitBreaker


def make() -> CircuitBreaker:
    return CircuitBreaker(BreakerConfig(failures=3, cooldown_s=2.0, trial_timeout_s=5.0))


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
    b.abandon_trial(b.trial)
    assert b.allow(7.1)


def test_asking_ready_takes_no_trial() -> None:
    b = make()
    for _ in range(3):
        b.record_failure(0.0)
    assert not b.ready(1.9)
    # The router asks every candidate; only the call that goes through takes the trial.
    assert b.ready(2.0) and b.ready(2.0)
    assert b.state is BreakerState.OPEN and b.trial is None
    assert b.allow(2.0) and b.trial is not None
    assert not b.ready(2.0)


def test_trial_in_flight_refuses_every_other_call_until_its_outcome() -> None:
    b = CircuitBreaker(BreakerConfig(failures=1, cooldown_s=2.0, trial_timeout_s=None))
    assert b.record_failure(0.0)
    assert b.allow(2.0)  # the trial
    # No timeout: however long the trial takes, nothing else goes through meanwhile.
    assert not any(b.allow(t) for t in (2.0, 3.0, 60.0, 3600.0))
    assert b.record_success()
    assert b.allow(3600.0) and b.allow(3600.0)  # closed: everyone


def test_cancelled_trial_is_handed_back() -> None:
    b = CircuitBreaker(BreakerConfig(failures=1, cooldown_s=2.0, trial_timeout_s=None))
    b.record_failure(0.0)
    assert b.allow(2.0)
    trial = b.trial
    assert trial is not None
    b.abandon_trial(trial)  # its task was cancelled: no verdict on health
    assert b.state is BreakerState.HALF_OPEN and b.trial is None
    assert b.allow(2.5)  # the next call is the new trial
    assert b.trial is not None and b.trial != trial
    assert not b.allow(2.6)


def test_late_hand_back_does_not_free_a_later_trial() -> None:
    b = CircuitBreaker(BreakerConfig(failures=1, cooldown_s=2.0, trial_timeout_s=None))
    b.record_failure(0.0)
    assert b.allow(2.0)
    first = b.trial
    assert first is not None
    b.record_failure(2.5)  # the first trial failed: open until 4.5
    assert b.allow(4.5)  # the second trial
    b.abandon_trial(first)  # the first one's owner lets go late: nothing changes
    assert not b.allow(4.6)


def test_failure_of_a_call_sent_before_opening_only_counts() -> None:
    b = make()
    for _ in range(3):
        b.record_failure(0.0)
    assert not b.record_failure(1.0)  # a straggler: the cool-down still ends at 2.0
    assert b.failures == 4
    assert b.allow(2.0)
