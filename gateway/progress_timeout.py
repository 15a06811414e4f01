"""A timeout that progress pushes back, on one timer for the whole stream.

A stream is cut when its replica sends nothing for ``chunk_gap_timeout_s``. With
``asyncio.timeout`` that means ``reschedule`` on every chunk: the timer handle is cancelled
and a new one made, under uvloop a handle, a libuv timer (``malloc``) and a copy of the
context, once per chunk of every stream, for a deadline that almost never comes. Here
progress only records the loop's time; the one timer, when it comes due, compares that
time with the gap and sets itself again for what remains, so a stream of N chunks arms it
about duration / gap times instead of N.

It expires like ``asyncio.timeout``: the task is cancelled, and the cancellation leaves the
``async with`` block as ``TimeoutError`` (any other cancellation stays a cancellation).
``cut`` tells an expiry at the fixed ``cut_at`` (the client's deadline) from a silent gap.
"""

from __future__ import annotations

import asyncio
import math
from types import TracebackType


class ProgressTimeout:
    """``async with ProgressTimeout(gap_s, cut_at) as timeout``: expire when ``gap_s`` passes
    without ``timeout.progressed()``, or at loop time ``cut_at``, whichever comes first."""

    __slots__ = ("_expired", "_handle", "_last", "_loop", "_task", "cut", "cut_at", "gap_s")

    def __init__(self, gap_s: float, cut_at: float = math.inf) -> None:
        self.gap_s = gap_s
        self.cut_at = cut_at
        # Whether it expired at cut_at (not for a silent gap); meaningful once expired.
        self.cut = False
        self._expired = False
        self._last = 0.0
        self._handle: asyncio.TimerHandle | asyncio.Handle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task[object] | None = None

    @property
    def expired(self) -> bool:
        return self._expired

    def progressed(self) -> None:
        """Something arrived: the gap counts from now."""
        assert self._loop is not None
        self._last = self._loop.time()

    def _due(self) -> float:
        return min(self._last + self.gap_s, self.cut_at)

    def _arm(self) -> None:
        assert self._loop is not None
        self._handle = self._loop.call_at(self._due(), self._on_timer)

    def _on_timer(self) -> None:
        assert self._loop is not None and self._task is not None
        self._handle = None
        if self._loop.time() < self._due():
            self._arm()  # progress came since it was set: wait for what remains
            return
        self._expired = True
        self.cut = self._last + self.gap_s > self.cut_at
        self._task.cancel()

    async def __aenter__(self) -> ProgressTimeout:
        self._loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        if task is None:
            raise RuntimeError("ProgressTimeout must be used inside a task")
        self._task = task
        self._last = self._loop.time()
        self._arm()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        assert self._task is not None
        if self._expired and exc_type is asyncio.CancelledError and self._task.uncancel() == 0:
            raise TimeoutError from exc
