"""ProgressTimeout: a stream's gap timeout on one timer, pushed back by progress."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from gateway.progress_timeout import DEADLINE, GAP, LIMIT, ProgressTimeout


def test_progress_keeps_a_stream_alive_past_the_gap() -> None:
    async def main() -> bool:
        async with ProgressTimeout(0.05) as timeout:
            for _ in range(8):  # 8 x 0.02 s = 0.16 s, three gaps' worth, never 0.05 s silent
                await asyncio.sleep(0.02)
                timeout.progressed()
        return timeout.expired

    assert asyncio.run(main()) is False


def test_silence_longer_than_the_gap_is_a_timeout() -> None:
    async def main() -> ProgressTimeout:
        timeout = ProgressTimeout(0.03)
        with pytest.raises(TimeoutError):
            async with timeout:
                timeout.progressed()
                await asyncio.sleep(1)
        return timeout

    timeout = asyncio.run(main())
    assert timeout.expired and not timeout.cut


def test_the_cut_comes_at_its_time_whatever_the_progress() -> None:
    async def main() -> tuple[ProgressTimeout, float]:
        loop = asyncio.get_running_loop()
        started = loop.time()
        timeout = ProgressTimeout(0.05, cut_at=started + 0.06)
        with pytest.raises(TimeoutError):
            async with timeout:
                while True:
                    await asyncio.sleep(0.01)
                    timeout.progressed()
        return timeout, loop.time() - started

    timeout, took = asyncio.run(main())
    assert timeout.cut
    assert 0.06 <= took < 0.5


def test_progress_does_not_make_a_timer_per_chunk() -> None:
    """100 chunks within one gap: the timer is set once, not once per chunk."""

    async def main() -> int:
        loop = asyncio.get_running_loop()
        armed = 0
        call_at = loop.call_at

        def counting_call_at(when: float, callback: Any, *args: Any, **kwargs: Any) -> asyncio.TimerHandle:
            nonlocal armed
            armed += 1
            return call_at(when, callback, *args, **kwargs)

        loop.call_at = counting_call_at  # type: ignore[method-assign]
        async with ProgressTimeout(60.0) as timeout:
            for _ in range(100):
                await asyncio.sleep(0)
                timeout.progressed()
        return armed

    assert asyncio.run(main()) == 1


def test_a_timer_due_after_progress_sets_itself_for_what_remains() -> None:
    async def main() -> tuple[bool, float]:
        loop = asyncio.get_running_loop()
        started = loop.time()
        timeout = ProgressTimeout(0.05)
        with pytest.raises(TimeoutError):
            async with timeout:
                await asyncio.sleep(0.03)
                timeout.progressed()  # due at 0.08 now, not 0.05
                await asyncio.sleep(1)
        return timeout.cut, loop.time() - started

    cut, took = asyncio.run(main())
    assert not cut
    assert took >= 0.08


def test_a_cancellation_from_elsewhere_stays_a_cancellation() -> None:
    async def body() -> None:
        async with ProgressTimeout(60.0):
            await asyncio.sleep(10)

    async def main() -> None:
        task = asyncio.create_task(body())
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())


def test_a_sender_vouched_alive_is_waited_for_past_the_gap() -> None:
    """Silent for 4 gaps, the sender alive throughout, then progress: no timeout."""

    async def main() -> bool:
        async with ProgressTimeout(0.02, alive=lambda: True, limit_s=1.0, recheck_s=0.01) as timeout:
            await asyncio.sleep(0.08)
            timeout.progressed()
        return timeout.expired

    assert asyncio.run(main()) is False


def test_the_gap_cuts_within_a_recheck_once_the_sender_is_no_longer_alive() -> None:
    async def main() -> tuple[str | None, float]:
        loop = asyncio.get_running_loop()
        started = loop.time()
        alive = True
        timeout = ProgressTimeout(0.02, alive=lambda: alive, limit_s=10.0, recheck_s=0.02)
        with pytest.raises(TimeoutError):
            async with timeout:
                await asyncio.sleep(0.1)
                alive = False  # its probes took it down
                await asyncio.sleep(10)
        return timeout.reason, loop.time() - started

    reason, took = asyncio.run(main())
    assert reason == GAP
    assert 0.1 <= took < 0.5


def test_the_limit_bounds_silence_however_alive_the_sender_looks() -> None:
    async def main() -> tuple[ProgressTimeout, float]:
        loop = asyncio.get_running_loop()
        started = loop.time()
        timeout = ProgressTimeout(0.02, alive=lambda: True, limit_s=0.1, recheck_s=0.03)
        with pytest.raises(TimeoutError):
            async with timeout:
                await asyncio.sleep(10)
        return timeout, loop.time() - started

    timeout, took = asyncio.run(main())
    assert timeout.reason == LIMIT and not timeout.cut
    assert 0.1 <= took < 0.5


def test_the_deadline_cuts_an_alive_senders_silence_too() -> None:
    async def main() -> str | None:
        loop = asyncio.get_running_loop()
        timeout = ProgressTimeout(0.02, loop.time() + 0.07, alive=lambda: True, limit_s=10.0, recheck_s=0.05)
        with pytest.raises(TimeoutError):
            async with timeout:
                await asyncio.sleep(10)
        return timeout.reason

    assert asyncio.run(main()) == DEADLINE
