"""The response cache as the gateway sees it: plan, look up, coalesce, store; never fail a request.

Where each call sits on the request path (``gateway.app.Gateway.handle``)::

    3 admit          (limits reserve tokens as usual)
    4 cache          plan = cache.plan(tenant.id, call.model, call.dialect, call.body,
                                       tenant.cache, request.headers.get("Cache-Control"))
                     hit = await cache.find(plan)     exact, then semantic -> replay, settle
                     lead = await cache.coalesce(plan.key, wait_s) if plan.coalesce
                                                      -> a CachedCompletion: replay, settle
    7 proxy          with lead: ... collect the answer (the dialect's answers.from_json,
                     or its answers.collector fed each block the scanner returns, its
                     result read with the scanner's usage and final answer) ...
                         lead.publish(completion)
    8 settle         cache.store_later(plan.key, completion, tenant.cache, plan.semantic)
                     if plan.store

The cache knows no API: what an answer looks like, how it is folded from a stream and
replayed, and what of a body the key leaves out are the request's dialect's
(``Dialect.answers``, ``dialects.answer``); here entries are only stored and found.

Exact first: it costs one Redis read. Only on an exact miss, and only for tenants that
enable it, does the semantic cache embed the request's text (``cache.semantic.cache``); its hit
is the answer stored under the matching question's exact key, fetched the same way.

Failure policy: the cache is an optimisation, so every store failure, timeout or corrupt
entry turns into a miss (or a skipped store), counted in ``fleetgate_cache_*`` metrics and
logged once per outage by the Redis store; it never reaches the client. Lookups are
bounded by ``lookup_timeout_ms`` (plus ``cache.semantic.embed_timeout_ms`` for a semantic
one); a dead Redis costs nothing once its breaker opens.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from types import TracebackType
from typing import Any

from cache.coalesce import Coalescer, Leader, Wake
from cache.config import CacheServiceSettings, CacheSettings
from cache.keys import (
    Cacheability,
    CachePlan,
    SemanticQuery,
    cacheability,
    parse_cache_control,
    plan_request,
    semantic_query,
    semantic_text,
)
from cache.memory_store import MemoryStore
from cache.metrics import CacheMetrics
from cache.redis_store import RedisStore
from cache.semantic.cache import SEMANTIC, SemanticCache
from cache.semantic.redis_store import RedisSemanticStore, SemanticLog
from cache.semantic.store import MemorySemanticStore, SemanticStore
from cache.store import CacheStore, CacheUnavailable
from dialects.answer import CachedCompletion, EntryCorrupt
from dialects.base import Dialect
from redisconn.config import RedisSecurity
from redisconn.factory import ClientOptions, connect

log = logging.getLogger("fleetgate.cache")

EXACT = "exact"
# Bypass reasons of the semantic part alone (the exact cache still serves the request).
SEMANTIC_NO_TEXT = "semantic_no_text"  # no last user message / single prompt string to compare
SEMANTIC_LONG_TEXT = "semantic_long_text"  # longer than cache.semantic.max_text_chars
# The sync connection's reads block up to sync_block_ms; its socket may wait this much longer.
SYNC_SOCKET_SLACK_S = 2.0
# The sync blocks on one stream read at a time; spares cover a load or a position check beside it.
SYNC_MAX_CONNECTIONS = 4
# The stores bound their own calls; this outer bound only catches a store that does not,
# and is wider so that a store's own timeout (which feeds its breaker) fires first.
BACKSTOP_FACTOR = 2.0


@dataclass(frozen=True, slots=True)
class CacheHit:
    """An answer from the cache, and which cache found it (``exact`` or ``semantic``)."""

    kind: str
    completion: CachedCompletion


class ResponseCache:
    """The response cache of one gateway process: exact, and semantic when it is given one.

    ``start_semantic``: load the semantic cache when entering the context (a configured
    tenant enables it); otherwise it starts on the first request of a tenant that does.
    """

    def __init__(
        self,
        store: CacheStore,
        settings: CacheServiceSettings | None = None,
        metrics: CacheMetrics | None = None,
        *,
        semantic: SemanticCache | None = None,
        start_semantic: bool = False,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.settings = settings or CacheServiceSettings()
        self.metrics = metrics or CacheMetrics()
        self.store_backend = store
        self.semantic = semantic
        self._start_semantic = start_semantic
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
        dialect: Dialect,
        body: dict[str, Any],
        settings: CacheSettings,
        cache_control: str | None,
    ) -> CachePlan:
        """What to do for this request (pure, see ``cache.keys.plan_request``), counted."""
        plan = plan_request(tenant_id, model, dialect, body, settings, cache_control)
        if plan.reason is not Cacheability.CACHEABLE:
            self.metrics.bypassed(plan.reason.value).inc()
        if plan.key is None or not settings.semantic.enabled or self.semantic is None:
            return plan
        query = semantic_query(tenant_id, model, dialect, body)
        if query is None:
            self.metrics.bypassed(SEMANTIC_NO_TEXT).inc()
            return plan
        if len(query.text) > self.semantic.settings.max_text_chars:
            self.metrics.bypassed(SEMANTIC_LONG_TEXT).inc()
            return plan
        self.semantic.start_soon()  # a no-op once started
        return replace(plan, semantic=query)

    def semantic_text(
        self, dialect: Dialect, body: dict[str, Any], settings: CacheSettings, cache_control: str | None
    ) -> str | None:
        """The text the semantic cache will embed for this request (to look it up, or to store
        its answer), or None: the same conditions as ``plan``'s, known before the model is.

        Pure and uncounted: the classifier asks it before ``plan`` runs.
        """
        semantic = self.semantic
        if semantic is None or not settings.semantic.enabled:
            return None
        if cacheability(dialect, body, settings) is not Cacheability.CACHEABLE:
            return None
        directives = parse_cache_control(cache_control)
        if not directives.lookup and not directives.store:
            return None
        text = semantic_text(dialect, body)
        if text is None or len(text) > semantic.settings.max_text_chars:
            return None
        return text

    @staticmethod
    def tokens_to_charge(completion: CachedCompletion, settings: CacheSettings) -> int:
        """Tokens a hit charges to the tenant's token rate (the request rate counts it anyway)."""
        return completion.total_tokens if settings.hits_count_tokens else 0

    # -- I/O --------------------------------------------------------------------------------

    async def find(self, plan: CachePlan) -> CacheHit | None:
        """The answer for a planned request: exact first, then (if planned) semantic."""
        if not plan.lookup or plan.key is None:
            return None
        completion = await self.lookup(plan.key)
        if completion is not None:
            return CacheHit(EXACT, completion)
        if plan.semantic is None:
            return None
        completion = await self.lookup_semantic(plan.semantic)
        return CacheHit(SEMANTIC, completion) if completion is not None else None

    async def lookup(self, key: str) -> CachedCompletion | None:
        """The cached answer for ``key``, or None on a miss or any store trouble (bounded)."""
        started = self._clock()
        result, completion = await self._read(key)
        self.metrics.record_lookup(EXACT, result, self._clock() - started)
        return completion

    async def lookup_semantic(self, query: SemanticQuery) -> CachedCompletion | None:
        """The answer to a question of the same scope that means the same, or None (bounded)."""
        started = self._clock()
        result, completion = "unavailable", None
        semantic = self.semantic
        try:
            if semantic is not None and not self._degraded():
                probe = await semantic.lookup(query)
                result = probe.result
                if probe.entry is not None:
                    result, completion = await self._read(probe.entry.answer_key)
                    if result == "miss":
                        semantic.forget(probe.entry)
                    elif result == "hit":
                        semantic.touch_later(probe.entry)
        except Exception:
            log.exception("semantic cache lookup failed")
            result = "error"
        self.metrics.record_lookup(SEMANTIC, result, self._clock() - started)
        return completion

    async def _read(self, key: str) -> tuple[str, CachedCompletion | None]:
        """``(metrics result, answer)`` for ``key``; any store trouble is a result, not an error."""
        try:
            async with asyncio.timeout(self.settings.lookup_timeout_s * BACKSTOP_FACTOR):
                raw = await self.store_backend.get(key)
            if raw is None:
                return "miss", None
            return "hit", CachedCompletion.from_bytes(raw)
        except CacheUnavailable as exc:
            return ("timeout" if exc.reason == "timeout" else "unavailable"), None
        except TimeoutError:
            return "timeout", None
        except EntryCorrupt:
            log.warning("unreadable cache entry ignored", extra={"key": key})
            return "error", None
        except Exception:
            # A bug in a store must not fail the request it was meant to speed up.
            log.exception("cache lookup failed", extra={"key": key})
            return "error", None

    def _degraded(self) -> bool:
        """The shared store is being kept away from: a semantic hit could not be fetched."""
        return isinstance(self.store_backend, RedisStore) and self.store_backend.degraded

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

    def store_later(
        self,
        key: str,
        completion: CachedCompletion,
        settings: CacheSettings,
        semantic: SemanticQuery | None = None,
    ) -> None:
        """``store`` in the background: the response need not wait for Redis.

        With ``semantic`` (the plan's), the question is then indexed for the semantic cache,
        pointing at the answer just kept (only if it was kept).
        """
        if self._closed:
            return
        task = asyncio.create_task(self._keep(key, completion, settings, semantic), name="cache-store")
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def _keep(
        self, key: str, completion: CachedCompletion, settings: CacheSettings, semantic: SemanticQuery | None
    ) -> bool:
        stored = await self.store(key, completion, settings)
        if not stored or semantic is None or self.semantic is None:
            return stored
        try:
            return await self.semantic.store(semantic, key, settings)
        except Exception:
            log.exception("semantic cache store failed")
            self.metrics.stores.labels(SEMANTIC, "error").inc()
            return False

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
        """Let pending stores finish (bounded), then close the semantic cache and the store."""
        if self._closed:
            return
        self._closed = True
        if self._pending:
            _, late = await asyncio.wait(set(self._pending), timeout=self.settings.store_timeout_s * BACKSTOP_FACTOR)
            for task in late:
                task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.gather(*late, return_exceptions=True)
        if self.semantic is not None:
            await self.semantic.close()
        await self.store_backend.close()

    async def __aenter__(self) -> ResponseCache:
        if self._start_semantic and self.semantic is not None:
            try:
                await self.semantic.start()
            except BaseException:
                await self.close()
                raise
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()


def create_response_cache(
    redis_url: str | None,
    settings: CacheServiceSettings,
    metrics: CacheMetrics,
    *,
    start_semantic: bool = False,
    security: RedisSecurity | None = None,
) -> ResponseCache:
    """The gateway's cache: exact over memory or Redis, and the semantic cache beside it.

    The semantic cache loads nothing until started: at entry when ``start_semantic`` (a
    configured tenant enables it), else on the first request of a tenant that does.
    """
    store = create_cache_store(redis_url, settings, security=security)
    semantic_store: SemanticStore
    log_source: Callable[[int], SemanticLog] | None = None
    if isinstance(store, RedisStore):
        assert redis_url is not None
        semantic_store = RedisSemanticStore(store, stream_max_len=settings.semantic.stream_max_len)
        log_source = _log_source(redis_url, settings, security)
    else:
        semantic_store = MemorySemanticStore()
    semantic = SemanticCache(settings.semantic, semantic_store, metrics, log_source=log_source)
    return ResponseCache(store, settings, metrics, semantic=semantic, start_semantic=start_semantic)


def _log_source(
    redis_url: str, settings: CacheServiceSettings, security: RedisSecurity | None
) -> Callable[[int], SemanticLog]:
    """A factory of the sync's reader, on connections of its own that may block."""
    options = ClientOptions(
        socket_timeout_s=settings.semantic.sync_block_ms / 1000 + SYNC_SOCKET_SLACK_S,
        connect_timeout_s=SYNC_SOCKET_SLACK_S,
        max_connections=SYNC_MAX_CONNECTIONS,
        pool_timeout_s=SYNC_SOCKET_SLACK_S,
    )

    def source(dimension: int) -> SemanticLog:
        return SemanticLog(connect(redis_url, options, security), dimension)

    return source


def create_cache_store(
    redis_url: str | None,
    settings: CacheServiceSettings | None = None,
    *,
    clock: Callable[[], float] = time.monotonic,
    security: RedisSecurity | None = None,
) -> CacheStore:
    """The Redis store when ``redis_url`` is set (shared by all gateways), else memory."""
    settings = settings or CacheServiceSettings()
    if redis_url is None:
        return MemoryStore(clock)
    return RedisStore.from_url(redis_url, settings, clock=clock, security=security)
