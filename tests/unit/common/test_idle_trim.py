"""When the process releases memory: once per idle period, never with a request in flight."""

from __future__ import annotations

import asyncio
import logging

import pytest

from common.idle_trim import IdleTrim, Released, glibc_malloc_trim, release_memory, trim_when_idle


def test_releases_once_after_the_idle_delay_then_not_again_until_new_traffic() -> None:
    p = IdleTrim(idle_after_s=10)
    assert not p.observe(0, 0, now=0.0)  # idle from t=0
    assert not p.observe(0, 0, now=9.9)
    assert p.observe(0, 0, now=10.0)  # 10 s idle: release
    assert not p.observe(0, 0, now=11.0)  # same idle period: once only
    assert not p.observe(0, 0, now=500.0)
    assert not p.observe(1, 1, now=501.0)  # traffic re-arms it
    assert not p.observe(0, 1, now=502.0)  # a new idle period starts at 502
    assert not p.observe(0, 1, now=511.9)
    assert p.observe(0, 1, now=512.0)  # 502 + 10


def test_never_with_a_request_in_flight() -> None:
    p = IdleTrim(idle_after_s=1)
    # One long stream, observed every second for a minute: never idle.
    assert not any(p.observe(1, 1, now=float(t)) for t in range(60))
    assert not p.observe(0, 1, now=60.0)  # it ended: idle from 60
    assert p.observe(0, 1, now=61.0)


def test_a_request_that_started_and_ended_between_two_looks_is_activity() -> None:
    p = IdleTrim(idle_after_s=5)
    assert not p.observe(0, 7, now=0.0)
    # In flight 0 at every look, but 3 requests started between t=4 and t=5: idle from 6.
    assert not p.observe(0, 7, now=4.0)
    assert not p.observe(0, 10, now=5.0)
    assert not p.observe(0, 10, now=6.0)
    assert not p.observe(0, 10, now=10.9)
    assert p.observe(0, 10, now=11.0)  # 6 + 5


async def test_the_edge_releases_once_per_idle_period_and_logs_it(caplog: pytest.LogCaptureFixture) -> None:
    clock = [0.0]
    counters = [(0, 0)]
    seen: list[tuple[int, int]] = []

    def release() -> Released:
        seen.append(counters[0])
        return Released(collected=3, trimmed=True, duration_s=0.002, rss_before_mb=120.0, rss_after_mb=90.0)

    caplog.set_level(logging.INFO, logger="common.idle_trim")
    task = asyncio.create_task(trim_when_idle(IdleTrim(2), lambda: counters[0], release, lambda: clock[0], 0.001))
    script = [(0, 0)] * 4 + [(3, 5)] * 5 + [(0, 9)] * 6  # idle, busy, idle again
    for step in script:
        counters[0] = step
        clock[0] += 1.0
        await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    # Once in the first idle period, once in the second; never while 3 were in flight.
    assert seen == [(0, 0), (0, 9)]
    assert [r.message for r in caplog.records] == ["idle: memory released"] * 2


def test_release_memory_collects_cycles_and_reports_its_duration() -> None:
    class Node:
        other: object

    a, b = Node(), Node()
    a.other, b.other = b, a  # a cycle: only the collector frees it
    del a, b
    done = release_memory(None)
    assert done.collected >= 2
    assert done.trimmed is False  # no trim function given
    assert done.duration_s >= 0


def test_malloc_trim_is_found_on_glibc_only() -> None:
    import platform

    trim = glibc_malloc_trim()
    if platform.system() == "Linux" and platform.libc_ver()[0] == "glibc":
        assert trim is not None
        assert trim() in (0, 1)  # 1: memory was returned, 0: there was none to return
    else:
        assert trim is None


async def test_a_release_that_raises_is_logged_and_the_next_idle_period_releases_again(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = [0.0]
    counters = [(0, 0)]
    calls: list[tuple[int, int]] = []

    def release() -> Released:
        calls.append(counters[0])
        if len(calls) == 1:
            raise OSError("madvise failed")
        return Released(collected=0, trimmed=True, duration_s=0.001, rss_before_mb=None, rss_after_mb=None)

    caplog.set_level(logging.INFO, logger="common.idle_trim")
    task = asyncio.create_task(trim_when_idle(IdleTrim(2), lambda: counters[0], release, lambda: clock[0], 0.001))
    for step in [(0, 0)] * 4 + [(1, 1)] * 2 + [(0, 1)] * 5:  # idle (fails), busy, idle (succeeds)
        counters[0] = step
        clock[0] += 1.0
        await asyncio.sleep(0.01)
    assert not task.done()  # the failure did not end the task
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert calls == [(0, 0), (0, 1)]
    assert [r.levelname for r in caplog.records] == ["ERROR", "INFO"]
    assert caplog.records[0].exc_info is not None
