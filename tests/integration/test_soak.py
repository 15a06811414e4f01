"""The soak bench (bench/soak.py) in a shortened form: 200 concurrent streams for a few
seconds through a real gateway process and two ``fleetgate sim`` processes, then idle."""

from __future__ import annotations

from pathlib import Path

from bench.soak import EventCounter, SoakConfig, run_soak


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


def test_the_clients_event_count_holds_wherever_the_bytes_are_split() -> None:
    # Content that looks like a marker is not one: it is not at the start of a line.
    event = b'data: {"id":"c","choices":[{"delta":{"content":"data: [DONE]"}}]}\n\n'
    stream = event * 3 + b"data: [DONE]\n\n"
    broken = event + b'data: {"error":{"message":"replica failed"}}\n\n'
    for size in range(1, len(stream) + 1):
        counter = EventCounter()
        for at in range(0, len(stream), size):
            counter.feed(stream[at : at + size])
        assert (counter.count, counter.finished, counter.errored) == (3, True, False), size
        unfinished = EventCounter()
        for at in range(0, len(stream) - 15, size):
            unfinished.feed(stream[: len(stream) - 15][at : at + size])
        assert (unfinished.count, unfinished.finished) == (3, False), size
    for size in range(1, len(broken) + 1):
        counter = EventCounter()
        for at in range(0, len(broken), size):
            counter.feed(broken[at : at + size])
        assert (counter.count, counter.finished, counter.errored) == (2, False, True), size
