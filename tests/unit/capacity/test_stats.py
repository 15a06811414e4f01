"""Percentiles, point metrics and fleet summaries on known samples, with the expected arithmetic written out."""

from __future__ import annotations

import math

import numpy as np
import pytest

from capacity.fleet_probe import KV_USAGE, PREEMPTIONS, PREFIX_HITS, PREFIX_QUERIES, WAITING, FleetWindow
from capacity.stats import (
    RequestSample,
    Summary,
    decode_rate,
    errors_by_kind,
    maybe_percentile,
    median_metrics,
    percentile,
    point_metrics,
    tokens_in_window,
)


def test_percentile_interpolates_between_closest_ranks() -> None:
    values = [1.0, 2.0, 3.0, 4.0]
    # position (n - 1) * q / 100: p50 -> 1.5, between 2 and 3; p95 -> 2.85, 4 - 0.15 * (4 - 3)
    assert percentile(values, 50) == 2.5
    assert percentile(values, 95) == pytest.approx(3.85)
    assert percentile(values, 0) == 1.0
    assert percentile(values, 100) == 4.0


def test_percentile_ignores_order_and_matches_numpy() -> None:
    values = [0.9, 0.1, 0.5, 0.3, 0.7, 0.2, 1.4, 0.05, 0.6, 0.33, 0.8]
    for q in (1, 5, 25, 50, 75, 95, 99):
        assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))


def test_percentile_of_one_value_is_that_value() -> None:
    assert percentile([0.42], 99) == 0.42


def test_percentile_of_one_hundred_values() -> None:
    values = [float(i) for i in range(1, 101)]  # 1..100
    # p95: position 99 * 0.95 = 94.05 -> 95 + 0.05 * (96 - 95)
    assert percentile(values, 95) == pytest.approx(95.05)
    # p99: position 98.01 -> 99.01
    assert percentile(values, 99) == pytest.approx(99.01)


def test_percentile_rejects_empty_and_out_of_range() -> None:
    with pytest.raises(ValueError, match="no values"):
        percentile([], 50)
    with pytest.raises(ValueError, match=r"0\.\.100"):
        percentile([1.0], 101)
    assert maybe_percentile([], 50) is None


def test_summary() -> None:
    s = Summary.of([4.0, 1.0, 3.0, 2.0])
    assert (s.count, s.mean, s.p50, s.max) == (4, 2.5, 2.5, 4.0)
    assert Summary.of([]) == Summary(0, None, None, None, None, None)


def test_decode_rate_counts_tokens_after_the_first() -> None:
    # 200 tokens, first at 1.0 s, last at 4.98 s: 199 tokens in 3.98 s = 50 tok/s
    assert decode_rate(200, 1.0, 4.98) == pytest.approx(50.0)
    assert decode_rate(1, 1.0, 1.0) is None
    assert decode_rate(5, 2.0, 2.0) is None


def test_tokens_in_window_shares_tokens_over_events() -> None:
    events = [0.5, 1.5, 2.5, 3.5]  # 4 events carrying 8 tokens: 2 per event
    assert tokens_in_window(events, 8, 1.0, 3.0) == 4.0  # events at 1.5 and 2.5
    assert tokens_in_window(events, 8, 0.0, 10.0) == 8.0
    assert tokens_in_window([], 8, 0.0, 1.0) == 0.0


def _ok(ttft: float, rate: float, gaps: list[float], prefix: str | None = None) -> RequestSample:
    return RequestSample(
        0,
        "chat",
        0,
        0,
        0.0,
        ttft_s=ttft,
        e2e_s=ttft + 1,
        prompt_tokens=100,
        completion_tokens=50,
        decode_tps=rate,
        gaps=gaps,
        prefix=prefix,
    )


def test_point_metrics_on_known_samples() -> None:
    samples = [
        _ok(0.1, 40.0, [0.02, 0.03], "cold"),
        _ok(0.2, 50.0, [0.02, 0.02], "warm"),
        _ok(0.3, 60.0, [0.04], "warm"),
        RequestSample(0, "chat", 0, 0, 1.0, error="http_429"),
    ]
    m = point_metrics(samples, window_s=10.0, window_tokens=500.0)
    assert m["requests"] == 4
    assert m["errors"] == 1
    assert m["error_rate"] == 0.25
    assert m["request_rate"] == 0.4
    assert m["total_tps"] == 50.0  # 500 tokens in 10 s
    assert m["per_user_tps"] == 50.0  # mean of 40, 50, 60
    assert m["ttft_p50"] == pytest.approx(0.2)
    assert m["ttft_p95"] == pytest.approx(0.29)  # position 1.9: 0.2 + 0.9 * 0.1
    assert m["itl_p50"] == pytest.approx(0.02)  # gaps 0.02 0.02 0.02 0.03 0.04
    assert m["max_gap"] == 0.04
    assert m["ttft_cold_p50"] == 0.1
    assert m["ttft_warm_p50"] == pytest.approx(0.25)
    assert m["prompt_tokens_mean"] == 100.0


def test_point_metrics_with_nothing_successful() -> None:
    m = point_metrics([RequestSample(0, "chat", 0, 0, 0.0, error="timeout")], window_s=5.0)
    assert m["ttft_p95"] is None
    assert m["per_user_tps"] is None
    assert m["error_rate"] == 1.0
    empty = point_metrics([], window_s=5.0)
    assert empty["error_rate"] is None
    assert empty["requests"] == 0.0


def test_errors_by_kind_and_json_leave_out_gaps() -> None:
    samples = [RequestSample(0, "c", 0, 0, 0.0, error=e) for e in ("timeout", "http_429", "http_429")]
    assert errors_by_kind(samples) == {"http_429": 2, "timeout": 1}
    doc = _ok(0.1, 40.0, [0.1]).to_json()
    assert "gaps" not in doc
    assert doc["ttft_s"] == 0.1
    assert not math.isnan(doc["decode_tps"])


def test_fleet_window_summary_counts_deltas_and_peaks() -> None:
    # Two replicas sampled at t = 0, 1, 2, 3; the window is [1, 2].
    window = FleetWindow()
    for t, kv_a, kv_b, waiting, preempted, queries, hits in [
        (0.0, 0.1, 0.1, 0, 5, 100, 50),
        (1.0, 0.5, 0.3, 2, 5, 200, 100),
        (2.0, 0.9, 0.5, 4, 7, 400, 250),
        (3.0, 0.2, 0.2, 0, 9, 500, 300),
    ]:
        window.add(
            t,
            [
                {KV_USAGE: kv_a, WAITING: waiting, PREEMPTIONS: preempted, PREFIX_QUERIES: queries, PREFIX_HITS: hits},
                {KV_USAGE: kv_b, WAITING: 1, PREEMPTIONS: 0, PREFIX_QUERIES: 0, PREFIX_HITS: 0},
            ],
        )
    s = window.summary(1.0, 2.0)
    assert s["kv_peak"] == 0.9  # the fullest replica
    assert s["kv_mean"] == pytest.approx(((0.5 + 0.3) / 2 + (0.9 + 0.5) / 2) / 2)
    assert s["waiting_peak"] == 5  # 4 + 1, summed over replicas
    assert s["preemptions"] == 2  # 7 - 5: from the last sample at or before 1.0 to the first at or after 2.0
    assert s["prefix_hit_rate"] == pytest.approx((250 - 100) / (400 - 200))


def test_fleet_window_without_samples_or_counters() -> None:
    assert FleetWindow().summary(0.0, 1.0)["kv_peak"] is None
    window = FleetWindow()
    window.add(0.5, [{KV_USAGE: 0.4}])  # a fixed-rate simulator has no counters
    s = window.summary(0.0, 1.0)
    assert s["kv_peak"] == 0.4 and s["preemptions"] is None and s["prefix_hit_rate"] is None


def test_median_metrics_over_repeats_ignores_one_spoiled_run() -> None:
    runs: list[dict[str, float | None]] = [
        {"ttft_p95": 0.10, "total_tps": 900.0, "kv_peak": None},
        {"ttft_p95": 0.95, "total_tps": 400.0, "kv_peak": None},  # a burst of other work
        {"ttft_p95": 0.12, "total_tps": 880.0, "kv_peak": 0.3},
    ]
    m = median_metrics(runs)
    assert m == {"ttft_p95": 0.12, "total_tps": 880.0, "kv_peak": 0.3}
