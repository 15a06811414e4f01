"""The answer of a capacity sweep: the largest load that meets the SLOs, and what breaks first.

SLOs come from the command line as ``METRIC OP VALUE``::

    --slo "ttft_p95<=1.0"  --slo "per_user_tps>=10"  --slo "preemptions==0"  --slo "itl_p95<=200ms"

``METRIC`` is any key of a point's metrics (``capacity.stats.point_metrics`` from the client,
``capacity.fleet_probe.FLEET_METRICS`` from the replicas). Time values take an optional ``s``
or ``ms`` suffix. Pure code: points in, verdicts out.

The capacity is the last level of the unbroken run of passing points from the bottom of
the sweep: a point that passes again above a failure (noise, or a cache that warmed up) is
reported, not trusted. For each SLO the report also gives the level where it first failed
and, interpolating linearly between the two points around it, where it crossed its line.
"""

from __future__ import annotations

import math
import operator
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from capacity.fleet_probe import FLEET_METRICS
from capacity.stats import point_metrics

# Every client-side metric name, read off the reducer itself so the two cannot drift apart.
CLIENT_METRICS: tuple[str, ...] = tuple(point_metrics([], 1.0))
KNOWN_METRICS: frozenset[str] = frozenset(CLIENT_METRICS) | frozenset(FLEET_METRICS)

_OPS: dict[str, Callable[[float, float], bool]] = {
    "<=": operator.le,
    ">=": operator.ge,
    "==": operator.eq,
    "<": operator.lt,
    ">": operator.gt,
}
_NUMBER = r"[-+]?[0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?"
_SLO_RE = re.compile(rf"^\s*([a-z][a-z0-9_]*)\s*(<=|>=|==|<|>)\s*({_NUMBER})\s*(ms|s)?\s*$")
MS_PER_S = 1000.0
# Refinement stops when the rate gap between a passing and a failing point is this small.
RATE_REFINE_RESOLUTION = 0.05


class SloError(ValueError):
    """An SLO that cannot be parsed or names an unknown metric."""


@dataclass(frozen=True)
class Slo:
    """One objective: ``metric op threshold``."""

    metric: str
    op: str
    threshold: float

    @property
    def text(self) -> str:
        return f"{self.metric}{self.op}{self.threshold:g}"

    def holds(self, value: float | None) -> bool:
        """Whether ``value`` meets the objective; an unmeasured value does not."""
        return value is not None and not math.isnan(value) and _OPS[self.op](value, self.threshold)


def parse_slo(text: str) -> Slo:
    """``"ttft_p95<=1.0"`` -> ``Slo("ttft_p95", "<=", 1.0)``; ``ms`` values are turned into seconds."""
    match = _SLO_RE.match(text)
    if match is None:
        raise SloError(f"cannot read SLO {text!r}: write METRIC OP VALUE, e.g. 'ttft_p95<=1.0' (ops: <= >= == < >)")
    metric, op, raw, unit = match.groups()
    if metric not in KNOWN_METRICS:
        raise SloError(f"SLO {text!r}: unknown metric {metric!r} (known: {', '.join(sorted(KNOWN_METRICS))})")
    value = float(raw) / MS_PER_S if unit == "ms" else float(raw)
    return Slo(metric, op, value)


@dataclass(frozen=True)
class Verdict:
    """One point judged against every SLO."""

    level: float
    broken: tuple[tuple[Slo, float | None], ...]  # the failed SLOs and the measured values

    @property
    def passed(self) -> bool:
        return not self.broken


@dataclass(frozen=True)
class SloBreak:
    """Where one SLO first failed as load rose."""

    slo: Slo
    level: float | None  # first failing level; None if it held everywhere
    crossing: float | None  # interpolated level where the metric crossed the threshold


@dataclass(frozen=True)
class Plan:
    """The answer for one target and one load mode."""

    verdicts: tuple[Verdict, ...]
    capacity: float | None  # None: even the lowest level broke an SLO
    first_failure: float | None  # None: nothing broke, the sweep did not go high enough
    breaks: tuple[SloBreak, ...]
    passes_above_failure: tuple[float, ...]

    @property
    def broken_first(self) -> tuple[tuple[Slo, float | None], ...]:
        """The SLOs broken at the first failing level: where the fleet breaks first."""
        for v in self.verdicts:
            if v.level == self.first_failure:
                return v.broken
        return ()


def judge(level: float, metrics: Mapping[str, float | None], slos: Sequence[Slo]) -> Verdict:
    broken = tuple((s, metrics.get(s.metric)) for s in slos if not s.holds(metrics.get(s.metric)))
    return Verdict(level, broken)


def plan(points: Mapping[float, Mapping[str, float | None]], slos: Sequence[Slo]) -> Plan:
    """Judge every point (level -> metrics) and find the capacity."""
    levels = sorted(points)
    verdicts = tuple(judge(lv, points[lv], slos) for lv in levels)
    capacity: float | None = None
    first_failure: float | None = None
    for v in verdicts:
        if not v.passed:
            first_failure = v.level
            break
        capacity = v.level
    above = tuple(v.level for v in verdicts if first_failure is not None and v.level > first_failure and v.passed)
    breaks = tuple(_first_break(s, levels, points) for s in slos)
    return Plan(verdicts, capacity, first_failure, breaks, above)


def _first_break(slo: Slo, levels: list[float], points: Mapping[float, Mapping[str, float | None]]) -> SloBreak:
    for i, level in enumerate(levels):
        value = points[level].get(slo.metric)
        if slo.holds(value):
            continue
        crossing = None
        if i > 0 and slo.op != "==":
            prev = points[levels[i - 1]].get(slo.metric)
            crossing = _crossing(levels[i - 1], prev, level, value, slo.threshold)
        return SloBreak(slo, level, crossing)
    return SloBreak(slo, None, None)


def _crossing(x0: float, y0: float | None, x1: float, y1: float | None, threshold: float) -> float | None:
    """The x where the line through (x0, y0) and (x1, y1) reaches ``threshold``; None if it does not between them."""
    if y0 is None or y1 is None or y0 == y1:
        return None
    t = (threshold - y0) / (y1 - y0)
    return x0 + t * (x1 - x0) if 0.0 <= t <= 1.0 else None


def next_level(result: Plan, *, integer: bool) -> float | None:
    """A level between the capacity and the first failure worth measuring next, or None.

    Bisection: integer levels (concurrency) until the two are adjacent, rates until they
    are within ``RATE_REFINE_RESOLUTION`` of each other.
    """
    lo, hi = result.capacity, result.first_failure
    if lo is None or hi is None:
        return None
    if integer:
        half = (int(lo) + int(hi)) // 2
        return float(half) if int(lo) < half < int(hi) else None
    if (hi - lo) <= RATE_REFINE_RESOLUTION * lo:
        return None
    mid = float(f"{(lo + hi) / 2:.3g}")  # readable rates: 3 significant digits
    return mid if lo < mid < hi else None
