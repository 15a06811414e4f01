"""GCRA token buckets: pure maths over plain numbers, time passed in.

The generic cell rate algorithm keeps one number per bucket, the theoretical arrival time
(TAT): when the bucket would be full again if nothing else arrived. A bucket with rate
``1/interval`` units per second and capacity ``burst`` units admits a cost ``c`` at time
``now`` iff ``max(TAT, now) + c*interval - now <= burst*interval`` (the *tolerance*).
This is exactly a continuous token bucket whose level is ``burst - (TAT - now)/interval``.

We store the TAT as ``(debt, at)`` with ``debt = TAT - at``: the seconds of rate owed as
measured at ``at``. Absolute TATs are ~1.7e9 s, where a double resolves only ~0.24 µs and
every update would round; the debt stays below a few minutes, where a double resolves
femtoseconds, and ``now - at`` is exact for two nearby times (Sterbenz). The Lua scripts in
``limits/lua`` implement the same formulas in the same order, so the memory and Redis
stores take identical decisions for identical inputs.

The functions are generic over the number type: given ``fractions.Fraction`` inputs and
``slack=0`` they compute exactly, which the property tests use against a reference model
(hence the integer zeros below: ``max(x, 0.0)`` would turn a Fraction into a float).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# Float rounding may leave a debt a few ulps above the tolerance at an exact boundary (a
# burst of 7 at 7 rpm sums 7 inexact intervals). One nanosecond of rate absorbs that and
# can never admit a whole extra unit: intervals are at least microseconds.
SLACK_S = 1e-9


@dataclass(frozen=True, slots=True)
class Rate:
    """A bucket's shape: seconds per unit and how many seconds of debt it may carry."""

    interval: float
    tolerance: float

    @classmethod
    def per_period(cls, limit: int, burst: int, period_s: float = 60.0) -> Rate:
        """``limit`` units per ``period_s`` seconds, holding at most ``burst`` units."""
        if limit <= 0 or burst <= 0:
            raise ValueError("limit and burst must be positive")
        interval = period_s / limit
        return cls(interval=interval, tolerance=burst * interval)


@dataclass(slots=True)  # not frozen: built per request, and a frozen __init__ is 3x slower
class BucketState:
    """The stored TAT, as ``debt`` seconds owed measured at time ``at``."""

    debt: float = 0.0
    at: float = 0.0


FULL = BucketState()


@dataclass(slots=True)  # not frozen: built per request, and a frozen __init__ is 3x slower
class Verdict:
    """What one check decided, and the figures the rate-limit headers report."""

    allowed: bool
    # The state to store if the whole admission goes ahead (unchanged debt when rejected).
    state: BucketState
    # Seconds until this cost would fit; 0 when allowed; -1 when it can never fit.
    retry_after: float
    # Units that could still be admitted right now after this decision.
    remaining: int
    # Seconds until the bucket is full again.
    reset_after: float


def debt_at(state: BucketState, now: float) -> float:
    """The debt left at ``now``: it drains at one second per second, never below zero."""
    # A clock that steps back (another host's, a leap smear) must not create debt.
    elapsed = max(now - state.at, 0)
    return max(state.debt - elapsed, 0)


def _remaining(debt: float, rate: Rate, slack: float) -> int:
    return max(math.floor((rate.tolerance - debt + slack) / rate.interval), 0)


def fits(cost: int, rate: Rate, slack: float = SLACK_S) -> bool:
    """Whether ``cost`` could ever be admitted, i.e. is no larger than the burst."""
    return cost * rate.interval <= rate.tolerance + slack


def check(state: BucketState, cost: int, now: float, rate: Rate, slack: float = SLACK_S) -> Verdict:
    """Decide whether ``cost`` units may pass at ``now``."""
    debt = debt_at(state, now)
    at = max(now, state.at)
    new_debt = debt + cost * rate.interval
    if new_debt <= rate.tolerance + slack:
        return Verdict(
            allowed=True,
            state=BucketState(new_debt, at),
            retry_after=0.0,
            remaining=_remaining(new_debt, rate, slack),
            reset_after=new_debt,
        )
    retry = new_debt - rate.tolerance if fits(cost, rate, slack) else -1.0
    return Verdict(
        allowed=False,
        state=BucketState(debt, at),
        retry_after=retry,
        remaining=_remaining(debt, rate, slack),
        reset_after=debt,
    )


def adjust(state: BucketState, units: int, now: float, rate: Rate) -> BucketState:
    """Charge (``units > 0``) or refund (``units < 0``) units after the fact.

    A charge may push the debt past the tolerance: tokens used beyond the reservation were
    really consumed, so later requests wait until the bucket has paid them back. A refund
    stops at an empty debt (a full bucket), as tokens above the capacity are lost anyway.
    """
    debt = debt_at(state, now) + units * rate.interval
    return BucketState(max(debt, 0), max(now, state.at))
