"""GCRA bucket maths: worked examples, and properties against a reference token bucket."""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction

from hypothesis import given, settings
from hypothesis import strategies as st

from limits import gcra
from limits.gcra import FULL, BucketState, Rate

# -- worked examples (600 rpm: one request every 0.1 s) --------------------------------


def test_rate_per_minute() -> None:
    rate = Rate.per_period(600, 10)
    assert rate.interval == 60 / 600 == 0.1
    assert rate.tolerance == 10 * 0.1 == 1.0


def test_burst_then_steady_rate() -> None:
    rate = Rate.per_period(600, 10)
    state, now = FULL, 1000.0
    for n in range(10):
        v = gcra.check(state, 1, now, rate)
        assert v.allowed
        assert v.remaining == 10 - (n + 1)
        state = v.state
    # Eleventh at the same instant: debt would be 11 * 0.1 = 1.1 s > 1.0 s tolerance.
    v = gcra.check(state, 1, now, rate)
    assert not v.allowed
    assert math.isclose(v.retry_after, 0.1)
    assert v.remaining == 0
    assert math.isclose(v.reset_after, 1.0)
    # 0.1 s later one interval has drained: exactly one more fits.
    v = gcra.check(state, 1, now + 0.1, rate)
    assert v.allowed and v.remaining == 0
    v2 = gcra.check(v.state, 1, now + 0.1, rate)
    assert not v2.allowed


def test_retry_after_is_when_it_fits() -> None:
    rate = Rate.per_period(60, 5)  # 1 per second, burst 5
    state = BucketState(debt=5.0, at=100.0)  # empty bucket at t=100
    v = gcra.check(state, 3, 100.0, rate)
    # Debt 5 + 3 = 8 s against a 5 s tolerance: wait 3 s.
    assert not v.allowed and v.retry_after == 3.0
    assert gcra.check(state, 3, 103.0, rate).allowed


def test_cost_larger_than_burst_never_fits() -> None:
    rate = Rate.per_period(1000, 1000)  # tokens: 1000/min, burst 1000
    v = gcra.check(FULL, 1001, 0.0, rate)
    assert not v.allowed and v.retry_after == -1.0
    assert not gcra.fits(1001, rate) and gcra.fits(1000, rate)


def test_exact_burst_at_an_inexact_interval() -> None:
    # 60 / 7 is not a binary fraction: seven summed intervals land an ulp away from the
    # tolerance; the slack keeps the seventh request in the burst.
    rate = Rate.per_period(7, 7)
    state = FULL
    for _ in range(7):
        v = gcra.check(state, 1, 1.7e9, rate)
        assert v.allowed
        state = v.state
    assert not gcra.check(state, 1, 1.7e9, rate).allowed


def test_adjust_refunds_and_charges() -> None:
    rate = Rate.per_period(6000, 6000)  # 100 tokens/s, burst 6000: interval 0.01 s
    state = gcra.check(FULL, 1000, 50.0, rate).state
    assert math.isclose(state.debt, 10.0)  # 1000 tokens * 0.01 s
    # Used 400 of 1000: refund 600 tokens = 6 s, 2 s later (2 s drained): 10 - 2 - 6 = 2.
    refunded = gcra.adjust(state, -600, 52.0, rate)
    assert math.isclose(refunded.debt, 2.0) and refunded.at == 52.0
    # A refund never makes the bucket fuller than full.
    assert gcra.adjust(state, -5000, 52.0, rate).debt == 0
    # Used 7000 of 1000: charge 6000 = 60 s, past the 60 s tolerance: debt 68 s.
    charged = gcra.adjust(state, 6000, 52.0, rate)
    assert math.isclose(charged.debt, 68.0)
    assert not gcra.check(charged, 1, 52.0, rate).allowed


def test_clock_stepping_back_creates_no_debt() -> None:
    rate = Rate.per_period(60, 1)
    state = gcra.check(FULL, 1, 100.0, rate).state
    v = gcra.check(state, 1, 99.0, rate)  # another host's clock, 1 s behind
    assert not v.allowed and v.retry_after == 1.0
    assert v.state.at == 100.0


# -- property: GCRA == a continuous token bucket, exactly ------------------------------


@dataclass
class ReferenceBucket:
    """The textbook token bucket: a level that refills continuously up to capacity."""

    capacity: Fraction
    per_second: Fraction
    level: Fraction
    last: Fraction

    def refill(self, now: Fraction) -> None:
        if now > self.last:
            self.level = min(self.capacity, self.level + (now - self.last) * self.per_second)
            self.last = now

    def take(self, cost: int, now: Fraction) -> tuple[bool, Fraction]:
        self.refill(now)
        if cost <= self.level:
            self.level -= cost
            return True, Fraction(0)
        return False, (cost - self.level) / self.per_second

    def adjust(self, units: int, now: Fraction) -> None:
        self.refill(now)
        self.level = min(self.capacity, self.level - units)


ops = st.lists(
    st.tuples(
        st.fractions(min_value=0, max_value=5, max_denominator=1000),  # time step
        st.sampled_from(["take", "adjust"]),
        st.integers(min_value=-40, max_value=40),
    ),
    max_size=60,
)


@settings(max_examples=300, deadline=None)
@given(
    limit=st.integers(min_value=1, max_value=600),
    burst=st.integers(min_value=1, max_value=50),
    steps=ops,
)
def test_gcra_matches_reference_bucket_exactly(limit: int, burst: int, steps: list[tuple[Fraction, str, int]]) -> None:
    rate = Rate.per_period(limit, burst, period_s=Fraction(60))
    ref = ReferenceBucket(
        capacity=Fraction(burst),
        per_second=Fraction(limit, 60),
        level=Fraction(burst),
        last=Fraction(0),
    )
    state, now = BucketState(Fraction(0), Fraction(0)), Fraction(0)
    for step, op, amount in steps:
        now += step
        if op == "adjust":
            ref.adjust(amount, now)
            state = gcra.adjust(state, amount, now, rate)
            continue
        cost = abs(amount) % (burst + 3) + 1
        v = gcra.check(state, cost, now, rate, slack=0)
        ok, wait = ref.take(cost, now)
        assert v.allowed == ok
        if ok:
            state = v.state
        elif cost <= burst:
            assert v.retry_after == wait
        else:
            assert v.retry_after == -1
        # The headers' figures: whole units left, and seconds until full.
        assert v.remaining == max(math.floor(ref.level), 0)
        assert v.reset_after == (ref.capacity - ref.level) / ref.per_second


# -- property: with floats, no window ever admits more than burst + rate * length -------


@settings(max_examples=300, deadline=None)
@given(
    limit=st.integers(min_value=1, max_value=100_000),
    burst=st.integers(min_value=1, max_value=200),
    start=st.floats(min_value=1.6e9, max_value=2.0e9),
    steps=st.lists(
        st.tuples(
            st.floats(min_value=0, max_value=2, allow_nan=False),
            st.integers(min_value=1, max_value=20),
        ),
        min_size=1,
        max_size=120,
    ),
)
def test_float_gcra_never_exceeds_the_window_bound(
    limit: int, burst: int, start: float, steps: list[tuple[float, int]]
) -> None:
    rate = Rate.per_period(limit, burst)
    state, now = FULL, start
    admitted: list[tuple[float, int]] = []
    for step, cost in steps:
        now += step
        v = gcra.check(state, cost, now, rate)
        if v.allowed:
            state = v.state
            admitted.append((now, cost))
    # In any window [t_i, t_j]: total cost <= burst + (t_j - t_i) / interval, give or take
    # the documented slack (1 ns of rate) and float rounding far below it.
    for i in range(len(admitted)):
        total = 0
        for j in range(i, len(admitted)):
            total += admitted[j][1]
            span = admitted[j][0] - admitted[i][0]
            assert total <= burst + (span + 2 * gcra.SLACK_S) / rate.interval
