"""The semantic cache's Redis side against a real redis-server: sharing between processes'
indexes, loading at start, following the log, gaps, a Redis that restarts empty or dies.

The hashing embedder stands in for the model here (what is tested is the synchronisation);
tests/integration/test_semantic_cache_gateway.py runs the real model through the gateway.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import pytest
import redis.asyncio as aioredis

from cache.config import CacheServiceSettings, CacheSettings, SemanticCacheSettings, SemanticServiceSettings
from cache.metrics import CacheMetrics
from cache.redis_store import RedisStore
from cache.semantic.cache import SemanticCache
from cache.semantic.embedder import HashingEmbedder
from cache.semantic.index import SemanticIndex
from cache.semantic.redis_store import RedisSemanticStore, SemanticLog
from cache.semantic.sync import SemanticSync
from cache.service import ResponseCache
from dialects.answer import CachedCompletion
from dialects.openai import CHAT
from redisconn.factory import ClientOptions, connect
from tests.integration.redis_server import RedisServer

pytestmark = pytest.mark.redis

ANSWER = CachedCompletion("chat", "m", "Paris.", "stop", 12, 2)
ON = CacheSettings(semantic=SemanticCacheSettings(enabled=True))
SETTINGS = CacheServiceSettings(
    lookup_timeout_ms=100,
    store_timeout_ms=500,
    breaker_cooldown_s=0.3,
    semantic=SemanticServiceSettings(sync_block_ms=100, load_timeout_s=5, stream_max_len=100),
)


# The sync's reader, on any URL scheme (tests/integration/test_redis_topologies.py).
LOG_OPTIONS = ClientOptions(socket_timeout_s=3, connect_timeout_s=3, max_connections=4, pool_timeout_s=3)


def body(question: str) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": question}], "temperature": 0}


@asynccontextmanager
async def gateway_cache(url: str, settings: CacheServiceSettings = SETTINGS) -> AsyncIterator[ResponseCache]:
    """The cache one gateway process builds (``create_response_cache``), with the hashing embedder.

    ``url`` may be any scheme ``redisconn`` reads (single node, cluster, sentinel)."""
    metrics = CacheMetrics()
    store = RedisStore.from_url(url, settings)
    semantic = SemanticCache(
        settings.semantic,
        RedisSemanticStore(store, stream_max_len=settings.semantic.stream_max_len),
        metrics,
        embedder=HashingEmbedder(),
        log_source=lambda dimension: SemanticLog(connect(url, LOG_OPTIONS), dimension),
    )
    async with ResponseCache(store, settings, metrics, semantic=semantic, start_semantic=True) as cache:
        yield cache


async def remember(cache: ResponseCache, question: str, tenant: str = "t1", settings: CacheSettings = ON) -> None:
    plan = cache.plan(tenant, "m", CHAT, body(question), settings, None)
    assert plan.key is not None
    cache.store_later(plan.key, ANSWER, settings, plan.semantic)
    await asyncio.gather(*cache._pending)


async def ask(cache: ResponseCache, question: str, tenant: str = "t1") -> str:
    hit = await cache.find(cache.plan(tenant, "m", CHAT, body(question), ON, None))
    return "miss" if hit is None else hit.kind


def entries(cache: ResponseCache) -> int:
    assert cache.semantic is not None and cache.semantic.index is not None
    return len(cache.semantic.index)


async def until(predicate: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.02)


async def test_processes_share_entries_and_a_new_one_loads_them(redis_server: RedisServer) -> None:
    async with gateway_cache(redis_server.url) as a, gateway_cache(redis_server.url) as b:
        await remember(a, "What is the capital of France?")
        await until(lambda: entries(b) == 1)  # followed from the log
        assert await ask(b, "what is the capital of france") == "semantic"
        assert await ask(b, "what is the capital of france", tenant="t2") == "miss"
    async with gateway_cache(redis_server.url) as c:  # a restart: loaded at start
        assert entries(c) == 1
        assert await ask(c, "WHAT is the capital of France") == "semantic"
        assert c.metrics.sample("fleetgate_cache_semantic_sync_total", event="reload") == 1


async def test_layout_bounds_and_removals_reach_every_process(redis_server: RedisServer) -> None:
    raw = aioredis.Redis.from_url(redis_server.url)
    small = CacheSettings(max_entries=2, semantic=SemanticCacheSettings(enabled=True))
    try:
        async with gateway_cache(redis_server.url) as a, gateway_cache(redis_server.url) as b:
            for n in range(3):
                await remember(a, f"Which river flows through city number {n}?", settings=small)
            await until(lambda: entries(b) == 2)
            assert entries(a) == 2
            assert a.metrics.sample("fleetgate_cache_evictions_total", kind="semantic") == 1
            names = sorted(k.decode() for k in await raw.keys("{fg:s}*"))
            assert names[-3:] == ["{fg:s}:log", "{fg:s}:lru:t1", "{fg:s}:seq"]
            assert len([n for n in names if n.startswith("{fg:s}:e:")]) == 2
            one = next(n for n in names if n.startswith("{fg:s}:e:"))
            fields = await raw.hgetall(one)
            assert sorted(fields) == [b"exp", b"key", b"scope", b"text", b"vec"]
            assert len(fields[b"vec"]) == 384 * 2  # float16
            assert 0 < await raw.pttl(one) <= 3_600_000
            # An answer that vanished from the exact cache takes its entry with it, everywhere.
            await raw.delete(*[k for k in await raw.keys("fg:c:*") if b":e:" in k])
            assert await ask(a, "which river flows through city number 2") == "miss"
            await until(lambda: entries(a) == 1 and entries(b) == 1)
    finally:
        await raw.aclose()


async def test_expired_entries_leave_every_index(redis_server: RedisServer) -> None:
    short = CacheSettings(ttl_s=0.5, semantic=SemanticCacheSettings(enabled=True))
    async with gateway_cache(redis_server.url) as a, gateway_cache(redis_server.url) as b:
        await remember(a, "What is the capital of France?", settings=short)
        await until(lambda: entries(b) == 1)
        assert await ask(b, "what is the capital of france") == "semantic"
        await asyncio.sleep(0.6)
        assert await ask(a, "what is the capital of france") == "miss"
        assert await ask(b, "what is the capital of france") == "miss"
        assert entries(a) == entries(b) == 0


async def test_a_process_that_missed_events_reloads(redis_server: RedisServer) -> None:
    client = aioredis.Redis.from_url(redis_server.url, socket_timeout=3)
    async with gateway_cache(redis_server.url) as writer:
        metrics = CacheMetrics()
        sync = SemanticSync(SemanticLog(client, 384), SemanticIndex(384), metrics, block_ms=50)
        await sync.load()
        assert len(sync.index) == 0
        # 150 entries: more events than the stream keeps (stream_max_len 100, trimmed ~).
        for n in range(150):
            await remember(writer, f"Question {n} about the history of tea?")
        await sync.follow()
        assert metrics.sample("fleetgate_cache_semantic_sync_total", event="gap") == 1
        await sync.load()
        assert len(sync.index) == 150
        await remember(writer, "One more question about coffee?")
        await sync.follow()
        assert len(sync.index) == 151
        assert metrics.sample("fleetgate_cache_semantic_sync_total", event="applied") == 1
    await sync.close()  # closes the client


async def test_redis_restarting_empty_empties_the_indexes(redis_server: RedisServer) -> None:
    async with gateway_cache(redis_server.url) as a:
        await remember(a, "What is the capital of France?")
        assert entries(a) == 1
        redis_server.restart()  # no persistence: the entries and the log are gone
        await until(lambda: entries(a) == 0, timeout_s=10)
        assert a.metrics.sample("fleetgate_cache_semantic_sync_total", event="gap") >= 1
        for _ in range(50):  # the broken pooled connections fail first, then the breaker recovers
            await remember(a, "What is the capital of France?")
            if entries(a) == 1:
                break
            await asyncio.sleep(0.1)
        assert await ask(a, "what is the capital of france") == "semantic"


async def test_dead_redis_means_bounded_misses_and_counted_errors(redis_server: RedisServer) -> None:
    async with gateway_cache(redis_server.url) as a:
        await remember(a, "What is the capital of France?")
        redis_server.kill()
        started = time.perf_counter()
        for _ in range(10):
            assert await ask(a, "what is the capital of france") == "miss"
        assert time.perf_counter() - started < 2.0
        m = a.metrics
        failed = sum(
            m.sample("fleetgate_cache_lookups_total", kind="semantic", result=r) for r in ("unavailable", "timeout")
        )
        assert failed == 10
        await remember(a, "Another question?")
        assert m.sample("fleetgate_cache_stores_total", kind="exact", result="unavailable") >= 1
        await until(lambda: m.sample("fleetgate_cache_semantic_sync_total", event="error") >= 1)
        assert entries(a) == 1  # kept meanwhile: it still expires on time, and answers are fetched


async def test_a_gateway_starts_without_redis_and_catches_up(redis_server: RedisServer) -> None:
    redis_server.kill()
    started = time.perf_counter()
    async with gateway_cache(redis_server.url) as a:
        assert time.perf_counter() - started < 3.0  # not the 5 s load timeout
        assert a.semantic is not None and a.semantic.ready and entries(a) == 0
        redis_server.start()
        for _ in range(50):  # the breaker and the follower's backoff let go within seconds
            await remember(a, "What is the capital of France?")
            if a.metrics.sample("fleetgate_cache_stores_total", kind="semantic", result="stored"):
                break
            await asyncio.sleep(0.2)
        await until(lambda: a.metrics.sample("fleetgate_cache_semantic_sync_total", event="reload") >= 1, 10)
        await until(lambda: entries(a) == 1)
        assert await ask(a, "what is the capital of france") == "semantic"
