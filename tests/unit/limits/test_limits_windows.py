"""Calendar quota windows against the standard library's dates."""

from __future__ import annotations

from datetime import UTC, date, datetime, timedelta

from hypothesis import given
from hypothesis import strategies as st

from limits.windows import (
    civil_from_days,
    day_index,
    day_window,
    days_from_civil,
    month_index,
    month_window,
)


def ts(*args: int) -> float:
    return datetime(*args, tzinfo=UTC).timestamp()  # type: ignore[misc]


def test_epoch_and_known_dates() -> None:
    assert days_from_civil(1970, 1, 1) == 0
    assert civil_from_days(0) == (1970, 1, 1)
    # 2024-02-29 (leap day) is day 19782: 54 years of days plus the leap days in between.
    assert days_from_civil(2024, 2, 29) == (date(2024, 2, 29) - date(1970, 1, 1)).days == 19782
    assert civil_from_days(19782) == (2024, 2, 29)


def test_day_window_resets_at_utc_midnight() -> None:
    now = ts(2025, 3, 14, 23, 59, 59)
    w = day_window(now)
    assert w.index == day_index(now) == (date(2025, 3, 14) - date(1970, 1, 1)).days
    assert w.resets_at == ts(2025, 3, 15)
    assert w.resets_at_iso == "2025-03-15T00:00:00Z"
    assert day_window(ts(2025, 3, 15)).index == w.index + 1


def test_month_window_across_year_end_and_february() -> None:
    dec = month_window(ts(2024, 12, 31, 12))
    assert dec.index == 2024 * 12 + 11
    assert dec.resets_at == ts(2025, 1, 1)
    feb = month_window(ts(2024, 2, 10))
    assert feb.resets_at == ts(2024, 3, 1)  # 2024 is a leap year: 29 days
    assert month_window(ts(2025, 1, 1)).index == dec.index + 1


@given(st.integers(min_value=-719_162, max_value=2_000_000))
def test_civil_round_trip(days: int) -> None:
    y, m, d = civil_from_days(days)
    assert days_from_civil(y, m, d) == days
    assert date(1970, 1, 1) + timedelta(days=days) == date(y, m, d)


@given(st.floats(min_value=0, max_value=4.1e9))
def test_windows_agree_with_datetime(now: float) -> None:
    when = datetime.fromtimestamp(now, tz=UTC)
    assert month_index(now) == when.year * 12 + when.month - 1
    first_next = datetime(when.year + when.month // 12, when.month % 12 + 1, 1, tzinfo=UTC)
    assert month_window(now).resets_at == first_next.timestamp()
    assert day_window(now).resets_at == datetime(when.year, when.month, when.day, tzinfo=UTC).timestamp() + 86_400
