"""The circuit breaker, driven by the time it is given: one class for every caller.

Each replica has one (fed by the proxy's outcomes), and so do the limiter's shared store
and the cache's Redis store.

closed     every call goes through; ``failures`` consecutive failures open the breaker.
open       no call goes through for ``cooldown_s``; the caller applies its fail policy
           (another replica, local limits, no cache) instead of waiting on a timeout.
half-open  after the cool-down exactly one call, the trial, goes through; every other call
           is refused until the trial's outcome is recorded. Success closes the breaker,
           failure opens it for another cool-down.

A trial that ends without an outcome (its task was cancelled, the client left) must not
keep the breaker half-open for good: its caller hands it back with ``abandon_trial``, and
the next call becomes the trial. As a last resort a trial that never reports back stops
counting after ``trial_timeout_s`` (None: never, for callers that always hand it back).

``ready(now)`` only asks (the router asks it of every candidate replica, most of which it
does not pick); ``allow(now)`` lets one call through and, after the cool-down, makes it the
trial. Trials are numbered so a late hand-back cannot free a later trial's slot.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class BreakerState(StrEnum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


@dataclass(frozen=True, slots=True)
class BreakerConfig:
    """When to stop calling, and when to try again."""

    failures: int = 3
    cooldown_s: float = 2.0
    trial_timeout_s: float | None = 5.0


class CircuitBreaker:
    """Consecutive-failure breaker with a single half-open trial."""

    __slots__ = ("_failures", "_opened_at", "_state", "_trial", "_trial_started", "_trials", "config")

    def __init__(self, config: BreakerConfig | None = None) -> None:
        self.config = config or BreakerConfig()
        self._state = BreakerState.CLOSED
        self._failures = 0
        self._opened_at = 0.0
        # The number of the trial in flight (None: none) and when it started.
        self._trial: int | None = None
        self._trial_started = 0.0
        self._trials = 0

    @property
    def state(self) -> BreakerState:
        return self._state

    @property
    def failures(self) -> int:
        """Consecutive failures recorded since the last success."""
        return self._failures

    @property
    def degraded(self) -> bool:
        """True unless closed: calls are refused, or only the trial goes through."""
        return self._state is not BreakerState.CLOSED

    @property
    def trial(self) -> int | None:
        """The number of the trial in flight, None when there is none."""
        return self._trial

    def ready(self, now: float) -> bool:
        """Whether ``allow(now)`` would let a call through; changes nothing."""
        if self._state is BreakerState.CLOSED:
            return True
        if self._state is BreakerState.OPEN:
            return now - self._opened_at >= self.config.cooldown_s
        if self._trial is None:
            return True
        timeout = self.config.trial_timeout_s
        return timeout is not None and now - self._trial_started >= timeout

    def allow(self, now: float) -> bool:
        """Whether this call may go through; past the cool-down it becomes the trial."""
        if not self.ready(now):
            return False
        if self._state is not BreakerState.CLOSED:
            self._state = BreakerState.HALF_OPEN
            self._trials += 1
            self._trial = self._trials
            self._trial_started = now
        return True

    def record_success(self) -> bool:
        """Note a successful call; True if this closed the breaker (recovered)."""
        recovered = self._state is not BreakerState.CLOSED
        self._state = BreakerState.CLOSED
        self._failures = 0
        self._trial = None
        return recovered

    def record_failure(self, now: float) -> bool:
        """Note a failed call; True if this opened a closed breaker (an outage begins).

        A failure while half-open opens the breaker for another cool-down but is not a new
        outage. A failure while open (a call sent before it opened) only counts.
        """
        self._failures += 1
        if self._state is BreakerState.HALF_OPEN or (
            self._state is BreakerState.CLOSED and self._failures >= self.config.failures
        ):
            began = self._state is BreakerState.CLOSED
            self._state = BreakerState.OPEN
            self._opened_at = now
            self._trial = None
            return began
        return False

    def abandon_trial(self, trial: int) -> None:
        """Trial ``trial`` ended without an outcome: the next call may be the trial.

        A no-op once that trial's outcome is recorded or a later trial has started.
        """
        if self._trial == trial:
            self._trial = None
