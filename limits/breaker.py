"""A circuit breaker for the shared limit store, driven by the time it is given.

closed     every call goes to the store; ``failures`` consecutive failures open it.
open       no call goes to the store for ``cooldown_s``; the limiter applies the fail
           policy instead (local buckets, or 503), so requests do not each wait for a
           timeout while Redis is down.
half-open  after the cool-down, one probe call goes through; success closes the breaker,
           failure opens it for another cool-down. A probe that never reports back (its
           task was cancelled) stops counting as in flight after ``probe_timeout_s``.
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
    """When to stop calling the store, and when to try it again."""

    failures: int = 3
    cooldown_s: float = 2.0
    probe_timeout_s: float = 5.0


class CircuitBreaker:
    """Consecutive-failure breaker with a single half-open probe."""

    def __init__(self, config: BreakerConfig | None = None) -> None:
        self.config = config or BreakerConfig()
        self.state = BreakerState.CLOSED
        self._failures = 0
        self._opened_at = 0.0
        self._probe_started: float | None = None

    def allow(self, now: float) -> bool:
        """Whether this call may go to the store; may start the half-open probe."""
        if self.state is BreakerState.CLOSED:
            return True
        if self.state is BreakerState.OPEN:
            if now - self._opened_at < self.config.cooldown_s:
                return False
            self.state = BreakerState.HALF_OPEN
            self._probe_started = now
            return True
        # Half-open: one probe at a time, unless the last one went silent.
        if self._probe_started is None or now - self._probe_started >= self.config.probe_timeout_s:
            self._probe_started = now
            return True
        return False

    def record_success(self) -> bool:
        """Note a successful call; True if this closed the breaker."""
        recovered = self.state is not BreakerState.CLOSED
        self.state = BreakerState.CLOSED
        self._failures = 0
        self._probe_started = None
        return recovered

    def record_failure(self, now: float) -> bool:
        """Note a failed call; True if this opened the breaker."""
        self._failures += 1
        if self.state is BreakerState.HALF_OPEN or (
            self.state is BreakerState.CLOSED and self._failures >= self.config.failures
        ):
            was_closed = self.state is BreakerState.CLOSED
            self.state = BreakerState.OPEN
            self._opened_at = now
            self._probe_started = None
            return was_closed
        return False

    def abandon_probe(self) -> None:
        """The probe's task ended without an answer; let the next call probe."""
        self._probe_started = None

    @property
    def degraded(self) -> bool:
        return self.state is not BreakerState.CLOSED
