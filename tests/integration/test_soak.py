"""The soak bench (bench/soak.py) in a shortened form: 200 concurrent streams for a few
seconds through a real gateway process and two ``fleetgate sim`` processes, then idle."""

from __future__ import annotations

from pathlib import Path

from bench.soak import SoakConfig, run_soak


async def test_a_short_soak_has_no_errors_and_returns_to_baseline(tmp_path: Path) -> None:
    # Probes get 5 s: on a loaded machine a replica can miss three 1 s probes in a row, which
    # is the health prober's matter, not what this test measures.
    cfg = SoakConfig(
        streams=200,
        duration_s=6,
        idle_s=6,
        ramp_s=1,
        tokens_per_s=10,
        max_tokens=20,
        replica_keepalive_s=2,
        health_timeout_s=5.0,
        # The idle release after 2 s without a request, well inside the 6 s idle phase (and
        # before the baseline: SoakConfig.settle_s).
        memory_trim_idle_s=2.0,
    )
    result = await run_soak(cfg, tmp_path)
    assert result.peak_open == cfg.streams
    assert result.streams_done >= cfg.streams  # every worker finished at least one stream
    assert sum(result.errors.values()) == 0, result.errors
    assert result.log_errors == []
    # Every client and replica connection closed again: descriptors exactly as before.
    assert result.after.fds == result.baseline.fds, (result.baseline, result.after)
    assert result.rss_back_ratio <= 0.10, (result.baseline, result.after)
    assert result.loop_lag_p99_s is not None  # the gateway measured its loop throughout
