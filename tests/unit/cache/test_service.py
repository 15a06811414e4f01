"""The cache facade: plans, lookups and stores that never fail a request, and their metrics."""

from __future__ import annotations

import asyncio
import time

import pytest

from cache.config import CacheServiceSettings, CacheSettings
from cache.keys import exact_key
from cache.memory_store import MemoryStore
from cache.metrics import CacheMetrics
from cache.service import ResponseCache, create_cache_store
from cache.store import CacheUnavailable
from dialects.answer import CachedCompletion
from dialects.openai import CHAT

ANSWER = CachedCompletion("chat", "m", "hello", "stop", 3, 2)
BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "temperature": 0}
TENANT = CacheSettings()


class BrokenStore:
    """A store whose every call fails like an unreachable Redis."""

    async def get(self, key: str) -> bytes | None:
        raise CacheUnavailable("down", reason="error")

    async def set(self, key: str, value: bytes, *, ttl_s: float, max_entries: int) -> int:
        raise CacheUnavailable("down", reason="timeout")

    async def close(self) -> None:
        pass


class HangingStore(BrokenStore):
    """A store that never answers (and does not bound its own calls)."""

    async def get(self, key: str) -> bytes | None:
        await asyncio.sleep(3600)
        return None


def lookups(cache: ResponseCache, result: str) -> float:
    return cache.metrics.sample("fleetgate_cache_lookups_total", kind="exact", result=result)


async def test_miss_store_hit_and_metrics() -> None:
    cache = ResponseCache(MemoryStore())
    plan = cache.plan("t1", "m", CHAT, BODY, TENANT, None)
    assert plan.key is not None
    assert await cache.lookup(plan.key) is None
    assert await cache.store(plan.key, ANSWER, TENANT)
    assert await cache.lookup(plan.key) == ANSWER
    assert (lookups(cache, "miss"), lookups(cache, "hit")) == (1, 1)
    assert cache.metrics.sample("fleetgate_cache_hit_ratio", kind="exact") == 0.5
    assert cache.metrics.sample("fleetgate_cache_entries", kind="exact") == 1
    assert cache.metrics.sample("fleetgate_cache_stores_total", kind="exact", result="stored") == 1
    assert cache.metrics.sample("fleetgate_cache_lookup_seconds_count", kind="exact") == 2


async def test_bypass_reasons_are_counted() -> None:
    cache = ResponseCache(MemoryStore())
    cache.plan("t1", "m", CHAT, {**BODY, "temperature": 0.8}, TENANT, None)
    cache.plan("t1", "m", CHAT, BODY, TENANT, "no-cache")
    cache.plan("t1", "m", CHAT, BODY, TENANT, "no-store")
    cache.plan("t1", "m", CHAT, BODY, TENANT, None)
    for reason in ("nondeterministic", "no_cache", "no_store"):
        assert cache.metrics.sample("fleetgate_cache_bypass_total", reason=reason) == 1


async def test_a_broken_store_means_misses_and_skipped_stores() -> None:
    cache = ResponseCache(BrokenStore())
    key = exact_key("t1", "m", CHAT, BODY)
    assert await cache.lookup(key) is None
    assert not await cache.store(key, ANSWER, TENANT)
    assert lookups(cache, "unavailable") == 1
    assert cache.metrics.sample("fleetgate_cache_stores_total", kind="exact", result="timeout") == 1


async def test_a_hanging_store_is_cut_by_the_backstop() -> None:
    settings = CacheServiceSettings(lookup_timeout_ms=20)
    cache = ResponseCache(HangingStore(), settings)
    started = time.perf_counter()
    assert await cache.lookup(exact_key("t1", "m", CHAT, BODY)) is None
    # The backstop is twice the lookup timeout: 40 ms; allow a slow machine some slack.
    assert time.perf_counter() - started < 0.5
    assert lookups(cache, "timeout") == 1


async def test_corrupt_entries_are_misses() -> None:
    store = MemoryStore()
    cache = ResponseCache(store)
    key = exact_key("t1", "m", CHAT, BODY)
    await store.set(key, b"garbage", ttl_s=60, max_entries=10)
    assert await cache.lookup(key) is None
    assert lookups(cache, "error") == 1


async def test_too_large_answers_are_not_stored() -> None:
    cache = ResponseCache(MemoryStore())
    key = exact_key("t1", "m", CHAT, BODY)
    big = CachedCompletion("chat", "m", "x" * 2000, "stop", 3, 500)
    assert not await cache.store(key, big, CacheSettings(max_entry_bytes=1000))
    assert cache.metrics.sample("fleetgate_cache_stores_total", kind="exact", result="too_large") == 1


async def test_evictions_are_counted() -> None:
    cache = ResponseCache(MemoryStore())
    bounded = CacheSettings(max_entries=2)
    for n in range(5):
        await cache.store(exact_key("t1", "m", CHAT, {**BODY, "seed": n}), ANSWER, bounded)
    assert cache.metrics.sample("fleetgate_cache_evictions_total", kind="exact") == 3


async def test_store_later_finishes_before_close() -> None:
    store = MemoryStore()
    cache = ResponseCache(store)
    key = exact_key("t1", "m", CHAT, BODY)
    cache.store_later(key, ANSWER, TENANT)
    await asyncio.sleep(0)
    assert await store.get(key) is not None
    async with ResponseCache(MemoryStore()) as other:
        other.store_later(key, ANSWER, TENANT)
    assert other.metrics.sample("fleetgate_cache_stores_total", kind="exact", result="stored") == 1
    await cache.close()


def test_hits_and_token_rates() -> None:
    assert ResponseCache.tokens_to_charge(ANSWER, TENANT) == 0
    assert ResponseCache.tokens_to_charge(ANSWER, CacheSettings(hits_count_tokens=True)) == 5


def test_store_choice_and_private_registries() -> None:
    assert isinstance(create_cache_store(None), MemoryStore)
    # Two caches in one process do not collide on metric names.
    ResponseCache(MemoryStore(), metrics=CacheMetrics())
    ResponseCache(MemoryStore(), metrics=CacheMetrics())


def test_settings_reject_unknown_keys() -> None:
    with pytest.raises(ValueError, match="ttl"):
        CacheSettings.model_validate({"ttl": 5})
    with pytest.raises(ValueError):
        CacheSettings(max_entries=0)
    assert CacheSettings.model_validate({"semantic": {"enabled": True}}).semantic.enabled
