"""The exact cache as the gateway sees it: plan, look up, coalesce, store; never fail a request.

Where each call sits on the request path (``gateway.app.Gateway.handle``)::

    3 admit          (limits reserve tokens as usual)
    4 cache          plan = cache.plan(tenant.id, call.model, call.endpoint, call.body,
                                       tenant.cache, request.headers.get("Cache-Control"))
                     hit = await cache.lookup(plan.key) if plan.lookup      -> replay, settle
                     lead = await cache.coalesce(plan.key, wait_s) if plan.coalesce
                                                      -> a CachedCompletion: replay, settle
    7 proxy          with lead: ... collect the answer (entry.from_json_response, or a
                     StreamCollector fed each block SseScanner.feed returns) ...
                         lead.publish(completion)
    8 settle         cache.store_later(plan.key, completion, tenant.cache) if plan.store

Failure policy: the cache is an optimisation, so every store failure, timeout or corrupt
entry turns into a miss (or a skipped store), counted in ``fleetgate_cache_*`` metrics and
logged once per outage by the Redis store; it never reaches the client. Lookups are
bounded by ``lookup_timeout_ms``; a dead Redis costs nothing once its breaker opens.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from types import TracebackType
from typing import Any

from cache.coalesce import Coalescer, Leader, Wake
from cache.config import CacheServiceSettings, CacheSettings
from cache.entry import CachedCompletion, EntryCorrupt, Kind, StreamCollector
from cache.keys import Cacheability, CachePlan, plan_request
from cache.memory_store import MemoryStore
from cache.metrics import CacheMetrics
from cache.redis_store import RedisStore
from cache.store import CacheStore, CacheUnavailable

log = logging.getLogger("fleetgate.cache")

EXACT = "exact"
# The stores bound their own calls; this outer bound only catches a store that does not,
# and is wider so that a store's own timeout (which feeds its breaker) fires first.
BACKSTOP_FACTOR = 2.0


class ResponseCache:
    """The exact response cache of one gateway process, over a memory or Redis store."""

    def __init__(
        self,
        store: CacheStore,
        settings: CacheServiceSettings | None = None,
        metrics: CacheMetrics | None = None,
        *,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.settings = settings or CacheServiceSettings()
        self.metrics = metrics or CacheMetrics()
        self.store_backend = store
        self.coalescer = Coalescer(linger_s=self.settings.coalesce_linger_s)
        self._clock = clock
        self._pending: set[asyncio.Task[bool]] = set()
        self._closed = False
        if isinstance(store, MemoryStore):
            self.metrics.entries.labels(EXACT).set_function(store.__len__)
        if isinstance(store, RedisStore):
            self.metrics.degraded.set_function(lambda: float(store.degraded))

    # -- decisions ------------------------------------------------------------------------

    def plan(
        self,
        tenant_id: str,
        model: str,
        endpoint: str,
        body: dict[str, Any],
        settings: CacheSettings,
        cache_control: str | None,
    ) -> CachePlan:
        """What to do for this request (pure, see ``cache.keys.plan_request``), counted."""
        plan = plan_request(tenant_id, model, endpoint, body, settings, cache_control)
        if plan.reason is not Cacheability.CACHEABLE:
            self.metrics.bypass.labels(plan.reason.value).inc()
        return plan

    @staticmethod
    def collector(kind: Kind, settings: CacheSettings) -> StreamCollector:
        """A collector for a streamed answer that gives up once it could not be stored anyway."""
        # Characters never outnumber UTF-8 bytes, so this bound is safe and cheap to check.
        return StreamCollector(kind, max_chars=settings.max_entry_bytes)

    @staticmethod
    def tokens_to_charge(completion: CachedCompletion, settings: CacheSettings) -> int:
        """Tokens a hit charges to the tenant's token rate (the request rate counts it anyway)."""
        return completion.total_tokens if settings.hits_count_tokens else 0

    # -- I/O --------------------------------------------------------------------------------

    async def lookup(self, key: str) -> CachedCompletion | None:
        """The cached answer for ``key``, or None on a miss or any store trouble (bounded)."""
        started = self._clock()
        result, completion = "miss", None
        try:
            async with asyncio.timeout(self.settings.lookup_timeout_s * BACKSTOP_FACTOR):
                raw = await self.store_backend.get(key)
            if raw is not None:
                completion = CachedCompletion.from_bytes(raw)
                result = "hit"
        except CacheUnavailable as exc:
            result = "timeout" if exc.reason == "timeout" else "unavailable"
        except TimeoutError:
            result = "timeout"
        except EntryCorrupt:
            log.warning("unreadable cache entry ignored", extra={"key": key})
            result = "error"
        except Exception:
            # A bug in a store must not fail the request it was meant to speed up.
            log.exception("cache lookup failed", extra={"key": key})
            result = "error"
        self.metrics.record_lookup(EXACT, result, self._clock() - started)
        return completion

    async def store(self, key: str, completion: CachedCompletion, settings: CacheSettings) -> bool:
        """Keep ``completion`` under ``key`` by the tenant's bounds; False if it was not kept."""
        raw = completion.to_bytes()
        if len(raw) > settings.max_entry_bytes:
            self.metrics.stores.labels(EXACT, "too_large").inc()
            return False
        try:
            async with asyncio.timeout(self.settings.store_timeout_s * BACKSTOP_FACTOR):
                evicted = await self.store_backend.set(key, raw, ttl_s=settings.ttl_s, max_entries=settings.max_entries)
        except CacheUnavailable as exc:
            self.metrics.stores.labels(EXACT, "timeout" if exc.reason == "timeout" else "unavailable").inc()
            return False
        except TimeoutError:
            self.metrics.stores.labels(EXACT, "timeout").inc()
            return False
        except Exception:
            log.exception("cache store failed", extra={"key": key})
            self.metrics.stores.labels(EXACT, "error").inc()
            return False
        self.metrics.stores.labels(EXACT, "stored").inc()
        if evicted:
            self.metrics.evictions.labels(EXACT).inc(evicted)
        return True

    def store_later(self, key: str, completion: CachedCompletion, settings: CacheSettings) -> None:
        """``store`` in the background: the response need not wait for Redis."""
        if self._closed:
            return
        task = asyncio.create_task(self.store(key, completion, settings), name="cache-store")
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def coalesce(self, key: str, wait_s: float) -> Leader | CachedCompletion:
        """Lead the upstream call for ``key``, or wait (at most ``wait_s``) for the one in flight.

        Returns the in-flight answer, or a ``Leader`` to use as a context manager around the
        upstream call (``publish`` the answer inside it). The leader is *solo* (shares
        nothing) when coalescing is off or the wait for another leader failed; the caller's
        code does not change.
        """
        if not self.settings.coalesce:
            return self.coalescer.solo(key)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + min(wait_s, self.settings.coalesce_max_wait_s)
        while True:
            ticket = self.coalescer.join(key)
            if isinstance(ticket, Leader):
                return ticket
            outcome = await ticket.wait(deadline - loop.time())
            if isinstance(outcome, CachedCompletion):
                self.metrics.coalesced.labels("hit").inc()
                return outcome
            self.metrics.coalesced.labels(outcome.value).inc()
            if outcome is not Wake.HANDOFF:
                return self.coalescer.solo(key)

    # -- lifecycle ------------------------------------------------------------------------

    async def close(self) -> None:
        """Let pending stores finish (bounded), then close the store."""
        if self._closed:
            return
        self._closed = True
        if self._pending:
            _, late = await asyncio.wait(set(self._pending), timeout=self.settings.store_timeout_s * BACKSTOP_FACTOR)
            for task in late:
                task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.gather(*late, return_exceptions=True)
        await self.store_backend.close()

    async def __aenter__(self) -> ResponseCache:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()


def create_cache_store(
    redis_url: str | None,
    settings: CacheServiceSettings | None = None,
    *,
    clock: Callable[[], float] = time.monotonic,
) -> CacheStore:
    """The Redis store when ``redis_url`` is set (shared by all gateways), else memory."""
    settings = settings or CacheServiceSettings()
    if redis_url is None:
        return MemoryStore(clock)
    return RedisStore.from_url(redis_url, settings, clock=clock)
