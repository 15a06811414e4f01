"""The simulated RTX 3060 reproduces the published single-GPU measurements (BENCHMARKS.md).

Runs the same functions as ``bench/sim_calibration.py``, in virtual time (a few seconds).
"""

from __future__ import annotations

import pytest

from bench.sim_calibration import (
    PUBLISHED_SWEEP,
    PUBLISHED_WALL,
    RunStats,
    memory_wall,
    percentile,
    prefix_caching,
    relative_error,
    sweep,
)

# The bar: throughput and per-user rate within 20% at every published concurrency.
TOLERANCE = 0.20
# TTFT p95 only has to keep the published shape: rising with load, within a factor of two.
TTFT_FACTOR = 2.0


@pytest.fixture(scope="module")
def sweep_runs() -> dict[int, RunStats]:
    return sweep()


@pytest.fixture(scope="module")
def wall_runs() -> dict[int, RunStats]:
    return memory_wall()


@pytest.mark.parametrize("users", list(PUBLISHED_SWEEP))
def test_throughput_and_per_user_rate_within_20_percent(sweep_runs: dict[int, RunStats], users: int) -> None:
    throughput, per_user, _ = PUBLISHED_SWEEP[users]
    run = sweep_runs[users]
    assert abs(relative_error(run.throughput, throughput)) <= TOLERANCE, run.throughput
    assert abs(relative_error(run.per_user, per_user)) <= TOLERANCE, run.per_user


def test_ttft_p95_rises_with_load_like_the_published_curve(sweep_runs: dict[int, RunStats]) -> None:
    p95 = [percentile(sweep_runs[n].ttfts, 95) for n in PUBLISHED_SWEEP]
    assert p95 == sorted(p95)
    for n, simulated in zip(PUBLISHED_SWEEP, p95, strict=True):
        published = PUBLISHED_SWEEP[n][2]
        assert published / TTFT_FACTOR <= simulated <= published * TTFT_FACTOR, (n, simulated)


def test_no_preemption_at_24_users_preemptions_at_32(wall_runs: dict[int, RunStats]) -> None:
    assert [wall_runs[n].preemptions for n in (4, 8, 16, 24)] == [0, 0, 0, 0]
    assert wall_runs[32].preemptions > 0
    kv = [wall_runs[n].peak_kv for n in PUBLISHED_WALL]
    assert kv == sorted(kv)
    assert wall_runs[24].peak_kv >= 0.85  # on the edge, as published (97%)
    assert wall_runs[32].peak_kv >= 0.99


def test_warm_prefix_ttft_is_far_below_cold() -> None:
    cold, warm = prefix_caching()
    cold_p50, warm_p50 = percentile(cold.ttfts, 50), percentile(warm.ttfts, 50)
    assert warm_p50 * 5 < cold_p50  # published: 2.48 s vs 0.15 s
    assert warm.hit_rate > 0.85 and cold.hit_rate < 0.05  # published: 94.3% vs 0%
