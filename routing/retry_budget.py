"""Retry budget: retries may add at most a fraction of recent requests, plus a small floor.

Without a budget, a fleet that fails every request gets ``max_attempts`` times its traffic
(a retry storm), just when it can least take it. With one, retries stop once they would
exceed ``ratio`` of recent requests; a healthy fleet, whose failures are rare, retries
every one of them. The floor (``min_per_s``) lets a quiet pool retry at all.

The bucket is the one of Finagle's ``RetryBudget`` and linkerd's retry budgets (deposit per
request, withdraw per retry), with the window expressed as a cap on the balance instead of
a time-to-live: pure, clock passed in.
"""

from __future__ import annotations


class RetryBudget:
    """A token bucket of retries: ``ratio`` per request and ``min_per_s`` per second, capped at ``burst``."""

    __slots__ = ("_balance", "_updated", "burst", "min_per_s", "ratio")

    def __init__(self, ratio: float, min_per_s: float, burst: float, now: float) -> None:
        if burst < 1:
            raise ValueError("burst must allow at least one retry")
        self.ratio = ratio
        self.min_per_s = min_per_s
        self.burst = burst
        # A new pool may retry a little at once: a cold start is no storm.
        self._balance = burst
        self._updated = now

    @property
    def balance(self) -> float:
        return self._balance

    def deposit(self, now: float) -> None:
        """One request went upstream: it earns ``ratio`` of a retry."""
        self._refill(now)
        self._balance = min(self.burst, self._balance + self.ratio)

    def withdraw(self, now: float) -> bool:
        """Spend one retry; False (and nothing spent) when the budget is empty."""
        self._refill(now)
        if self._balance < 1.0:
            return False
        self._balance -= 1.0
        return True

    def _refill(self, now: float) -> None:
        elapsed = now - self._updated
        if elapsed > 0:
            self._balance = min(self.burst, self._balance + elapsed * self.min_per_s)
            self._updated = now
