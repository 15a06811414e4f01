"""The soak bench (bench/soak.py) in a shortened form: two bursts of 500 concurrent streams
through a real gateway process and two ``fleetgate sim`` processes, each followed by idle."""

from __future__ import annotations

from pathlib import Path

from bench.soak import EventCounter, SoakConfig, bar_failures, run_soak

# RSS after burst 2 against after burst 1 (each after its idle release), at most this much
# more. Burst 2 completes at least one stream per worker (500; about 800-1,000 in practice),
# so a leak of 10 KB per stream adds at least 500 x 10 KB = 4.9 MB; without a leak the growth
# stays under 1 MB, quiet machine or loaded (bench/results/soak.md, "The shortened test").
GROWTH_BOUND_MB = 3.0
LEAK_KB_PER_STREAM = 10


async def test_two_short_bursts_have_no_errors_no_growth_and_descriptors_back(tmp_path: Path) -> None:
    """The bar of the full soak (five bursts of 5,000) on what fits a test run: 0 errors,
    descriptors exactly at baseline after each idle, and no growth from burst 1 to burst 2
    beyond ``GROWTH_BOUND_MB``. The full bar's 3% of burst 5 against burst 2 needs bursts
    past the second; here burst 1 sets the high-water mark, and burst 2, finding it, should
    add nothing a leak would not. The bound is absolute: a 500-stream burst's residue is
    small, and what a leak adds grows with the streams served, not with the RSS."""
    # Probes get 5 s: on a loaded machine a replica can miss three 1 s probes in a row, which
    # is the health prober's matter, not what this test measures.
    cfg = SoakConfig(
        streams=500,
        duration_s=3,
        idle_s=3,
        ramp_s=1,
        tokens_per_s=10,
        max_tokens=20,
        replica_keepalive_s=1,
        health_timeout_s=5.0,
        # The idle release after 1 s without a request (logged; each measure waits for it).
        memory_trim_idle_s=1.0,
        sample_every_s=0.5,
        bursts=2,
    )
    result = await run_soak(cfg, tmp_path)
    assert bar_failures(result) == []  # 0 errors, descriptors back, each measure after a release
    assert result.peak_open == cfg.streams
    first, second = result.bursts
    assert second.done >= cfg.streams  # every worker finished at least one stream
    assert second.done * LEAK_KB_PER_STREAM / 1024 > GROWTH_BOUND_MB  # such a leak would show
    growth_mb = second.after.rss_mb - first.after.rss_mb
    assert growth_mb <= GROWTH_BOUND_MB, (result.baseline, first.after, second.after)
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
