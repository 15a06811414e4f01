"""Calendar quota windows: UTC days and months, as integers, from a Unix time.

Quotas reset at 00:00 UTC each day and on the 1st of each month. A window is named by an
integer (days since the epoch; ``year * 12 + month - 1``) so the Lua scripts can compute
the same names from Redis's clock without a date library. The civil-date conversions are
Howard Hinnant's algorithms (https://howardhinnant.github.io/date_algorithms.html), valid
for every date a gateway will see; ``limits/lua/*.lua`` carries the same code.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Literal

SECONDS_PER_DAY = 86_400

WindowKind = Literal["day", "month"]


def days_from_civil(year: int, month: int, day: int) -> int:
    """Days since 1970-01-01 of a proleptic Gregorian date."""
    year -= month <= 2
    era = year // 400
    yoe = year - era * 400
    mp = month - 3 if month > 2 else month + 9
    doy = (153 * mp + 2) // 5 + day - 1
    doe = yoe * 365 + yoe // 4 - yoe // 100 + doy
    return era * 146_097 + doe - 719_468


def civil_from_days(days: int) -> tuple[int, int, int]:
    """(year, month, day) of a day number since 1970-01-01."""
    z = days + 719_468
    era = z // 146_097
    doe = z - era * 146_097
    yoe = (doe - doe // 1460 + doe // 36_524 - doe // 146_096) // 365
    doy = doe - (365 * yoe + yoe // 4 - yoe // 100)
    mp = (5 * doy + 2) // 153
    day = doy - (153 * mp + 2) // 5 + 1
    month = mp + 3 if mp < 10 else mp - 9
    return yoe + era * 400 + (month <= 2), month, day


def day_index(now: float) -> int:
    """Days since the epoch at Unix time ``now``."""
    return math.floor(now / SECONDS_PER_DAY)


@functools.lru_cache(maxsize=8)
def _month_of_day(day: int) -> tuple[int, float]:
    # Every admission with a quota asks; the answer changes once a day.
    year, month, _ = civil_from_days(day)
    index = year * 12 + month - 1
    next_year, next_month0 = divmod(index + 1, 12)
    return index, float(days_from_civil(next_year, next_month0 + 1, 1) * SECONDS_PER_DAY)


def month_index(now: float) -> int:
    """``year * 12 + month - 1`` at Unix time ``now``."""
    return _month_of_day(day_index(now))[0]


@dataclass(frozen=True, slots=True)
class Window:
    """One quota window: its name and when the next one starts."""

    kind: WindowKind
    index: int
    resets_at: float

    @property
    def resets_at_iso(self) -> str:
        """The reset time as ``2025-02-01T00:00:00Z`` for messages."""
        return datetime.fromtimestamp(self.resets_at, tz=UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def day_window(now: float) -> Window:
    index = day_index(now)
    return Window("day", index, float((index + 1) * SECONDS_PER_DAY))


def month_window(now: float) -> Window:
    index, resets_at = _month_of_day(day_index(now))
    return Window("month", index, resets_at)


def window(kind: WindowKind, now: float) -> Window:
    return day_window(now) if kind == "day" else month_window(now)
