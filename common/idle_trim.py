"""Give memory back to the system once the process goes idle.

After a burst of thousands of concurrent streams the gateway's resident set stays near its
peak although almost nothing the burst allocated is still referenced (bench/results/soak.md):

- objects of the burst caught in reference cycles (a connection and its parser) are only
  freed by the cyclic collector's oldest generation, which runs when *new* allocations
  pile up: on an idle process, never;
- glibc's ``malloc`` keeps freed chunks in its heap for reuse instead of returning the
  pages (it trims only the top of the heap, above ``M_TRIM_THRESHOLD``); ``malloc_trim(0)``
  hands every free page back (``madvise``), wherever it lies in the heap.

So when no request has been in flight for ``idle_after_s``, the process runs a full
collection and ``malloc_trim(0)`` once; it trims again only after new traffic and a new idle
period. Both are synchronous, so no request starts while they run (one event loop); their
duration is logged. CPython's own small-object arenas (1 MiB each) are not touched: an arena
is returned only when every object in it is freed, which a trim cannot force.

``IdleTrim`` decides (pure, time passed in); ``trim_when_idle`` is the asyncio edge.
"""

from __future__ import annotations

import asyncio
import ctypes
import gc
import logging
import platform
import resource
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

# How often the edge looks at the request counters: a trim comes at most this late.
CHECK_EVERY_S = 1.0


class IdleTrim:
    """When to release memory: once per idle period, never with a request in flight.

    An idle period starts at the first observation with no request in flight and no request
    started since the previous observation (a request shorter than the gap between two
    observations is activity too), and ends with the next such request.
    """

    def __init__(self, idle_after_s: float) -> None:
        self.idle_after_s = idle_after_s
        self._idle_since: float | None = None
        self._started_seen: int | None = None
        # Armed at start-up: the imports' and the warm-up's garbage are released once too.
        self._armed = True

    def observe(self, in_flight: int, started: int, now: float) -> bool:
        """True when the caller should release memory now (it then counts as done)."""
        active = in_flight > 0 or (self._started_seen is not None and started != self._started_seen)
        self._started_seen = started
        if active:
            self._idle_since = None
            self._armed = True
            return False
        if self._idle_since is None:
            self._idle_since = now
        if self._armed and now - self._idle_since >= self.idle_after_s:
            self._armed = False
            return True
        return False


def glibc_malloc_trim() -> Callable[[], int] | None:
    """glibc's ``malloc_trim(0)``, or None where the C library is not glibc (musl, macOS)."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    try:
        fn = ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_size_t]
    fn.restype = ctypes.c_int
    return lambda: int(fn(0))


def resident_mb() -> float | None:
    """This process's resident set in MB (Linux), for the log line."""
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return pages * resource.getpagesize() / 1e6


@dataclass(frozen=True)
class Released:
    """What one release did."""

    collected: int
    trimmed: bool
    duration_s: float
    rss_before_mb: float | None
    rss_after_mb: float | None


def release_memory(malloc_trim: Callable[[], int] | None) -> Released:
    """A full collection, then ``malloc_trim`` when there is one; timed."""
    before = resident_mb()
    started = time.perf_counter()
    collected = gc.collect()
    trimmed = malloc_trim is not None and malloc_trim() == 1
    duration = time.perf_counter() - started
    return Released(collected, trimmed, duration, before, resident_mb())


async def trim_when_idle(
    policy: IdleTrim,
    counters: Callable[[], tuple[int, int]],
    release: Callable[[], Released],
    clock: Callable[[], float],
    every_s: float = CHECK_EVERY_S,
) -> None:
    """Every ``every_s``, ask ``policy`` with ``counters()`` (requests in flight, requests
    started so far); release when it says so. Runs until cancelled.

    A release that raises is logged and the loop goes on: the next idle period tries again
    (an exception would otherwise end the task, and idle releases with it, unseen)."""
    while True:
        await asyncio.sleep(every_s)
        in_flight, started = counters()
        if policy.observe(in_flight, started, clock()):
            try:
                done = release()
            except Exception:
                log.exception("idle: memory release failed; trying again after the next idle period")
                continue
            log.info(
                "idle: memory released",
                extra={
                    "collected": done.collected,
                    "malloc_trim": done.trimmed,
                    "duration_ms": round(done.duration_s * 1000, 1),
                    "rss_before_mb": None if done.rss_before_mb is None else round(done.rss_before_mb, 1),
                    "rss_after_mb": None if done.rss_after_mb is None else round(done.rss_after_mb, 1),
                },
            )
