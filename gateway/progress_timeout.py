"""A timeout that progress pushes back, on one timer for the whole stream.

A stream is cut when its replica sends nothing for ``chunk_gap_timeout_s``. With
``asyncio.timeout`` that means ``reschedule`` on every chunk: the timer handle is cancelled
and a new one made, under uvloop a handle, a libuv timer (``malloc``) and a copy of the
context, once per chunk of every stream, for a deadline that almost never comes. Here
progress only records the loop's time; the one timer, when it comes due, compares that
time with the gap and sets itself again for what remains, so a stream of N chunks arms it
about duration / gap times instead of N.

Silence past the gap is not always the end: a replica whose engine stalls for a while
(starved of CPU, a long step) still holds the stream and finishes it later. When the gap
passes, ``alive()`` is asked; while it says yes the timer looks again every ``recheck_s``,
until progress comes, ``alive()`` says no, or the silence reaches ``limit_s``, the bound
past which nothing waits however alive the replica looks.

It expires like ``asyncio.timeout``: the task is cancelled, and the cancellation leaves the
``async with`` block as ``TimeoutError`` (any other cancellation stays a cancellation).
``reason`` says which bound it was: ``DEADLINE`` (the fixed ``cut_at``, the client's
deadline), ``GAP`` (silent past the gap, and not vouched alive) or ``LIMIT``.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable
from types import TracebackType
from typing import Final

DEADLINE: Final = "deadline"
GAP: Final = "gap"
LIMIT: Final = "limit"


class ProgressTimeout:
    """``async with ProgressTimeout(gap_s, cut_at, alive=..., limit_s=...) as timeout``: expire
    when ``gap_s`` passes without ``timeout.progressed()`` and ``alive()`` (if given) does not
    vouch for the sender, when ``limit_s`` passes without progress at all, or at loop time
    ``cut_at``, whichever comes first."""

    __slots__ = ("_alive", "_handle", "_last", "_loop", "_task", "cut_at", "gap_s", "limit_s", "reason", "recheck_s")

    def __init__(
        self,
        gap_s: float,
        cut_at: float = math.inf,
        *,
        alive: Callable[[], bool] | None = None,
        limit_s: float = math.inf,
        recheck_s: float = 1.0,
    ) -> None:
        self.gap_s = gap_s
        self.cut_at = cut_at
        self.limit_s = limit_s
        self.recheck_s = recheck_s
        self._alive = alive
        # Which bound expired (DEADLINE, GAP or LIMIT); None while it has not.
        self.reason: str | None = None
        self._last = 0.0
        self._handle: asyncio.TimerHandle | asyncio.Handle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task[object] | None = None

    @property
    def expired(self) -> bool:
        return self.reason is not None

    @property
    def cut(self) -> bool:
        """Whether it expired at ``cut_at`` (the client's deadline)."""
        return self.reason == DEADLINE

    def progressed(self) -> None:
        """Something arrived: the gap counts from now."""
        assert self._loop is not None
        self._last = self._loop.time()

    def _set(self, when: float) -> None:
        assert self._loop is not None
        self._handle = self._loop.call_at(when, self._on_timer)

    def _on_timer(self) -> None:
        assert self._loop is not None and self._task is not None
        self._handle = None
        now, last = self._loop.time(), self._last
        if now >= self.cut_at:
            self._expire(DEADLINE)
        elif now >= last + self.limit_s:
            self._expire(LIMIT)
        elif now < last + self.gap_s:
            self._set(min(last + self.gap_s, self.cut_at))  # progress came since: wait for what remains
        elif self._alive is not None and self._alive():
            self._set(min(now + self.recheck_s, last + self.limit_s, self.cut_at))
        else:
            self._expire(GAP)

    def _expire(self, reason: str) -> None:
        assert self._task is not None
        self.reason = reason
        self._task.cancel()

    async def __aenter__(self) -> ProgressTimeout:
        self._loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        if task is None:
            raise RuntimeError("ProgressTimeout must be used inside a task")
        self._task = task
        self._last = self._loop.time()
        self._set(min(self._last + self.gap_s, self.cut_at))
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        assert self._task is not None
        if self.reason is not None and exc_type is asyncio.CancelledError and self._task.uncancel() == 0:
            raise TimeoutError from exc
