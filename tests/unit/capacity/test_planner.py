"""SLO parsing, the capacity answer and the refinement step."""

from __future__ import annotations

import pytest

from capacity.planner import Slo, SloError, next_level, parse_slo, plan

SLOS = [parse_slo("ttft_p95<=1.0"), parse_slo("per_user_tps>=10"), parse_slo("preemptions==0")]


def test_parse_slo() -> None:
    assert parse_slo("ttft_p95<=1.0") == Slo("ttft_p95", "<=", 1.0)
    assert parse_slo(" per_user_tps >= 10 ") == Slo("per_user_tps", ">=", 10.0)
    assert parse_slo("itl_p95<150ms") == Slo("itl_p95", "<", 0.15)
    assert parse_slo("preemptions==0").text == "preemptions==0"


def test_parse_slo_errors_are_clear() -> None:
    with pytest.raises(SloError, match="cannot read SLO 'ttft_p95 about 1'"):
        parse_slo("ttft_p95 about 1")
    with pytest.raises(SloError, match=r"unknown metric 'ttft_p90'.*known: .*ttft_p95"):
        parse_slo("ttft_p90<=1")


def test_unmeasured_values_do_not_meet_an_slo() -> None:
    slo = parse_slo("preemptions==0")
    assert slo.holds(0.0)
    assert not slo.holds(None)
    assert not slo.holds(float("nan"))


def _point(ttft: float, rate: float, preempted: float) -> dict[str, float | None]:
    return {"ttft_p95": ttft, "per_user_tps": rate, "preemptions": preempted}


def test_capacity_is_the_last_passing_level_and_names_what_breaks_first() -> None:
    points: dict[float, dict[str, float | None]] = {
        1: _point(0.04, 58.9, 0),
        16: _point(0.17, 49.9, 0),
        32: _point(0.28, 32.5, 0),
        64: _point(0.57, 18.8, 0),
        96: _point(1.2, 9.0, 0),
    }
    result = plan(points, SLOS)
    assert result.capacity == 64
    assert result.first_failure == 96
    assert [(s.metric, v) for s, v in result.broken_first] == [("ttft_p95", 1.2), ("per_user_tps", 9.0)]
    breaks = {b.slo.metric: b for b in result.breaks}
    # ttft: 0.57 at 64 -> 1.2 at 96 crosses 1.0 at 64 + (1.0 - 0.57) / (1.2 - 0.57) * 32 = 85.8
    assert breaks["ttft_p95"].crossing == pytest.approx(64 + 0.43 / 0.63 * 32)
    # per-user: 18.8 -> 9.0 crosses 10 at 64 + 8.8 / 9.8 * 32 = 92.7
    assert breaks["per_user_tps"].crossing == pytest.approx(64 + 8.8 / 9.8 * 32)
    assert breaks["preemptions"].level is None


def test_nothing_passes_or_nothing_breaks() -> None:
    assert plan({1: _point(2.0, 50, 0)}, SLOS).capacity is None
    held = plan({1: _point(0.1, 50, 0), 2: _point(0.2, 40, 0)}, SLOS)
    assert (held.capacity, held.first_failure, held.broken_first) == (2, None, ())


def test_a_pass_above_a_failure_is_reported_not_trusted() -> None:
    result = plan({8: _point(0.1, 50, 0), 16: _point(0.2, 40, 3), 32: _point(0.3, 30, 0)}, SLOS)
    assert result.capacity == 8
    assert result.passes_above_failure == (32,)
    assert result.breaks[2].crossing is None  # equality SLOs are not interpolated


def test_next_level_bisects() -> None:
    result = plan({32: _point(0.3, 30, 0), 64: _point(1.5, 8, 0)}, SLOS)
    assert next_level(result, integer=True) == 48
    adjacent = plan({32: _point(0.3, 30, 0), 33: _point(1.5, 8, 0)}, SLOS)
    assert next_level(adjacent, integer=True) is None
    rates = plan({1.0: _point(0.3, 30, 0), 2.0: _point(1.5, 8, 0)}, SLOS)
    assert next_level(rates, integer=False) == 1.5
    close = plan({1.0: _point(0.3, 30, 0), 1.04: _point(1.5, 8, 0)}, SLOS)
    assert next_level(close, integer=False) is None
