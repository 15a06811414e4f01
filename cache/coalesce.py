"""Request coalescing: identical cacheable requests in flight together go upstream once.

The first request for a key becomes the *leader* of a flight and goes upstream; requests
for the same key that arrive while it is in flight become *followers* and wait for the
leader's answer, which each then replays in its own shape (JSON or SSE). Pure asyncio,
one process: gateway processes do not coalesce with each other (the shared cache still
serves the second process once the first one stored the answer).

How a flight ends, and what followers do then:

    published   the leader got a complete answer: every follower replays it. The flight
                stays joinable for ``linger_s`` more, which covers a request whose cache
                lookup missed just before the answer was stored.
    handoff     the leader was cancelled (its client left): followers join again and the
                first one leads a new flight. One upstream request instead of a stampede.
    solo        the leader failed or its answer is not worth keeping (an upstream error, a
                4xx, an aborted or oversized answer): every follower goes upstream on its
                own, as it would have without coalescing. Sharing the leader's error would
                hand a request a failure it never had a chance to avoid, and re-electing a
                leader would run the followers one after another.

Followers wait with their own timeout; a follower that times out or is cancelled leaves
the flight untouched (its cancellation never reaches the leader or the other followers).
A leader is a context manager: leaving the block without publishing ends the flight, as a
handoff if the block was cancelled, solo otherwise, so a flight can never be left hanging.
"""

from __future__ import annotations

import asyncio
from enum import StrEnum
from types import TracebackType

from dialects.answer import CachedCompletion


class Wake(StrEnum):
    """Why a follower stopped waiting without an answer."""

    HANDOFF = "handoff"  # the leader was cancelled: join again
    SOLO = "solo"  # the leader could not produce a shareable answer: go upstream alone
    TIMEOUT = "timeout"  # the follower's own wait ran out: go upstream alone


class _Flight:
    __slots__ = ("followers", "future")

    def __init__(self, future: asyncio.Future[CachedCompletion | Wake]) -> None:
        self.future = future
        self.followers = 0


class Leader:
    """The request that goes upstream for a key; publishes the answer or ends the flight.

    A *solo* leader belongs to no flight (coalescing off, or a follower that gave up
    waiting): its ``publish`` and ``abandon`` do nothing, so the caller's code is the same.
    """

    __slots__ = ("_coalescer", "_flight", "key")

    def __init__(self, coalescer: Coalescer | None, key: str, flight: _Flight | None) -> None:
        self._coalescer = coalescer
        self._flight = flight
        self.key = key

    @property
    def solo(self) -> bool:
        return self._flight is None

    @property
    def followers(self) -> int:
        """How many requests are waiting on this leader so far."""
        return self._flight.followers if self._flight is not None else 0

    def publish(self, completion: CachedCompletion) -> None:
        """Hand ``completion`` to every follower (and to late joiners for the linger time)."""
        flight, self._flight = self._flight, None
        if flight is not None and self._coalescer is not None and not flight.future.done():
            flight.future.set_result(completion)
            self._coalescer._published(self.key, flight)

    def abandon(self, wake: Wake = Wake.SOLO) -> None:
        """End the flight without an answer; followers hand off or go solo per ``wake``."""
        flight, self._flight = self._flight, None
        if flight is not None and self._coalescer is not None and not flight.future.done():
            flight.future.set_result(wake)
            self._coalescer._forget(self.key, flight)

    def __enter__(self) -> Leader:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._flight is not None:
            cancelled = exc_type is not None and issubclass(exc_type, asyncio.CancelledError)
            self.abandon(Wake.HANDOFF if cancelled else Wake.SOLO)


class Follower:
    """A request waiting for a leader's answer."""

    __slots__ = ("_future", "key")

    def __init__(self, key: str, future: asyncio.Future[CachedCompletion | Wake]) -> None:
        self.key = key
        self._future = future

    async def wait(self, timeout_s: float) -> CachedCompletion | Wake:
        """The leader's answer, or why there is none; waits at most ``timeout_s``."""
        # asyncio.wait neither cancels the shared future on timeout nor when this task is
        # cancelled, so one follower leaving never disturbs the flight.
        done, _ = await asyncio.wait((self._future,), timeout=max(0.0, timeout_s))
        if not done:
            return Wake.TIMEOUT
        return self._future.result()


class Coalescer:
    """In-flight requests by exact cache key (tenant-scoped, so never shared across tenants)."""

    def __init__(self, *, linger_s: float = 1.0) -> None:
        self._linger_s = linger_s
        self._flights: dict[str, _Flight] = {}

    def __len__(self) -> int:
        return len(self._flights)

    def join(self, key: str) -> Leader | Follower:
        """Lead a new flight for ``key``, or follow the one in progress (or lingering)."""
        flight = self._flights.get(key)
        if flight is not None:
            flight.followers += 1
            return Follower(key, flight.future)
        flight = _Flight(asyncio.get_running_loop().create_future())
        self._flights[key] = flight
        return Leader(self, key, flight)

    def solo(self, key: str) -> Leader:
        """A leader outside any flight: goes upstream, shares nothing."""
        return Leader(None, key, None)

    def waiting(self, key: str) -> int:
        """Followers that joined the current flight for ``key`` (0 if none)."""
        flight = self._flights.get(key)
        return flight.followers if flight is not None else 0

    def _published(self, key: str, flight: _Flight) -> None:
        if self._linger_s <= 0:
            self._forget(key, flight)
            return
        flight.future.get_loop().call_later(self._linger_s, self._forget, key, flight)

    def _forget(self, key: str, flight: _Flight) -> None:
        # A newer flight may hold the key by now; leave it alone.
        if self._flights.get(key) is flight:
            del self._flights[key]
