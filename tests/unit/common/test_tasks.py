"""``common.tasks.stop``: a background task is stopped even when it loses a cancellation."""

from __future__ import annotations

import asyncio

from common.tasks import stop


async def test_a_loop_that_takes_a_cancellation_for_a_timeout_is_still_stopped() -> None:
    turns = 0

    async def loop() -> None:
        nonlocal turns
        while True:
            turns += 1
            try:
                await asyncio.sleep(10)
            except asyncio.CancelledError:
                # What a lost cancellation looks like to the loop: a timeout, and it retries.
                if turns == 1:
                    continue
                raise

    task = asyncio.create_task(loop())
    await asyncio.sleep(0)
    assert await stop(task, timeout_s=2.0, every_s=0.05)
    assert task.cancelled() and turns == 2


async def test_a_task_that_never_ends_costs_the_timeout_not_forever() -> None:
    release = asyncio.Event()

    async def stubborn() -> None:
        while not release.is_set():
            try:
                await asyncio.sleep(10)
            except asyncio.CancelledError:
                continue

    task = asyncio.create_task(stubborn())
    await asyncio.sleep(0)
    loop = asyncio.get_running_loop()
    started = loop.time()
    assert not await stop(task, timeout_s=0.3, every_s=0.05)
    assert 0.25 <= loop.time() - started < 2.0
    release.set()
    await stop(task)


async def test_a_failed_or_finished_task_and_none() -> None:
    async def fail() -> None:
        raise RuntimeError("boom")

    failed = asyncio.create_task(fail())
    await asyncio.sleep(0)
    assert await stop(failed)  # its exception is retrieved, not raised
    assert await stop(None)
