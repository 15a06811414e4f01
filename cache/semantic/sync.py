"""Keep this process's ``SemanticIndex`` equal to the semantic entries in Redis.

The loop, one task per gateway process::

    load      position = (last event id, counter) read atomically; SCAN every entry hash
              into a fresh index; swap it in; continue from that position
    follow    XREAD BLOCK (bounded) the events after the position, apply them in order
    check     each event carries the counter's value: the next one must be exactly
              last + 1, else events were lost (the stream was trimmed past us, or Redis
              restarted empty) and the loop loads again; an idle read also compares the
              counter, which only ever goes back when Redis lost its data

Events that arrive during a load are applied after it: adds replace, deletes are
idempotent, so replaying an event the load already saw is harmless. A Redis error is
logged once per outage and retried with backoff; the index keeps serving what it has
(its entries still expire on time) and lookups of answers fail fast on the breaker.

``apply_events`` is the pure part: the events, the index, the time, the last counter value.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from redis.exceptions import RedisError

from cache.metrics import CacheMetrics
from cache.semantic.index import SemanticIndex
from cache.semantic.redis_store import Event, SemanticLog
from common.tasks import stop

log = logging.getLogger("fleetgate.cache")

# Events taken per read: a burst of stores is applied in slices that keep the loop responsive.
READ_COUNT = 256
BACKOFF_MIN_S = 0.1
BACKOFF_MAX_S = 5.0


@dataclass(frozen=True, slots=True)
class Applied:
    """What applying a run of events did: the counter reached, and whether one was missing."""

    seq: int
    stream_id: str | None
    applied: int
    gap: bool


def apply_events(index: SemanticIndex, events: Sequence[Event], last_seq: int, now: float) -> Applied:
    """Apply ``events`` in order until one does not follow ``last_seq`` (a gap: reload)."""
    seq, stream_id, applied = last_seq, None, 0
    for event in events:
        if event.seq != seq + 1:
            return Applied(seq, stream_id, applied, gap=True)
        if event.op == "add" and event.entry is not None and event.entry.expires_at > now:
            index.add(event.entry)
        else:
            index.remove(event.entry_id)
        seq, stream_id, applied = event.seq, event.stream_id, applied + 1
    return Applied(seq, stream_id, applied, gap=False)


class SemanticSync:
    """The task that loads and follows the shared log into ``index``."""

    def __init__(
        self,
        source: SemanticLog,
        index: SemanticIndex,
        metrics: CacheMetrics,
        *,
        block_ms: int = 1000,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self._log = source
        self.index = index
        self._metrics = metrics
        self._block_ms = block_ms
        self._wall = wall_clock
        self._stream_id = "0-0"
        self._seq = 0
        self._stale = True
        self._loaded = asyncio.Event()
        # Set after the first load attempt, whatever its outcome: start-up waits for it, so a
        # Redis that refuses connections does not hold a gateway's start for the whole timeout.
        self._tried = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._failing = False

    @property
    def seq(self) -> int:
        """The counter value of the last event applied (or loaded past)."""
        return self._seq

    @property
    def loaded(self) -> bool:
        return self._loaded.is_set()

    async def start(self, timeout_s: float) -> bool:
        """Start following; wait at most ``timeout_s`` for the first load attempt. True if it loaded.

        A failed attempt returns at once (False): the loop keeps retrying in the background.
        """
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="semantic-sync")
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_s):
                await self._tried.wait()
        return self.loaded

    async def close(self) -> None:
        """Stop following and close the log's connection."""
        task, self._task = self._task, None
        await stop(task)
        await self._log.close()

    async def _run(self) -> None:
        backoff = BACKOFF_MIN_S
        while True:
            try:
                if self._stale:
                    await self.load()
                await self.follow()
                backoff = BACKOFF_MIN_S
                if self._failing:
                    self._failing = False
                    log.info("semantic cache log reachable again")
            except (RedisError, OSError, TimeoutError) as exc:
                self._tried.set()
                self._metrics.semantic_sync.labels("error").inc()
                if not self._failing:
                    self._failing = True
                    log.warning("semantic cache log unreachable; retrying", extra={"error": repr(exc)})
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, BACKOFF_MAX_S)

    async def load(self) -> None:
        """Replace the index with every entry in Redis, and continue from the log's position."""
        stream_id, seq = await self._log.position()
        fresh = SemanticIndex(self.index.dimension)
        async for page in self._log.entries():
            now = self._wall()
            for entry in page:
                if entry.expires_at > now:
                    fresh.add(entry)
        self.index.adopt(fresh)
        self._stream_id, self._seq, self._stale = stream_id, seq, False
        self._metrics.semantic_sync.labels("reload").inc()
        self._loaded.set()
        self._tried.set()
        log.info("semantic cache index loaded", extra={"entries": len(self.index), "seq": seq})

    async def follow(self) -> None:
        """One bounded read of the log, applied; marks the index stale on a gap."""
        events = await self._log.read(self._stream_id, count=READ_COUNT, block_ms=self._block_ms)
        if not events:
            if await self._log.counter() < self._seq:
                self._gap("counter went back")
            return
        done = apply_events(self.index, events, self._seq, self._wall())
        if done.stream_id is not None:
            self._stream_id, self._seq = done.stream_id, done.seq
        self._metrics.semantic_sync.labels("applied").inc(done.applied)
        if done.gap:
            self._gap("events missing")

    def _gap(self, why: str) -> None:
        self._metrics.semantic_sync.labels("gap").inc()
        log.info("semantic cache log has a gap; reloading", extra={"reason": why, "seq": self._seq})
        self._stale = True
