"""The Redis cache store against a real redis-server: sharing, TTL, bounds, outages, isolation."""

from __future__ import annotations

import asyncio
import sys
import time

import pytest
import redis.asyncio as aioredis

from cache.config import CacheServiceSettings, CacheSettings
from cache.keys import exact_key
from cache.metrics import CacheMetrics
from cache.redis_store import RedisStore
from cache.service import ResponseCache
from cache.store import CacheUnavailable
from dialects.answer import CachedCompletion
from dialects.openai import CHAT
from tests.integration.redis_server import RedisServer

pytestmark = pytest.mark.redis

ANSWER = CachedCompletion("chat", "m", "cached answer", "stop", 4, 2)
HOUR = 3600.0
# Short enough to keep the outage tests quick, long enough to see the breaker hold.
COOLDOWN_S = 0.3
SETTINGS = CacheServiceSettings(lookup_timeout_ms=50, store_timeout_ms=200, breaker_cooldown_s=COOLDOWN_S)


def body(n: int = 0) -> dict[str, object]:
    return {"model": "m", "messages": [{"role": "user", "content": f"question {n}"}], "temperature": 0}


def key(tenant: str = "t1", n: int = 0) -> str:
    return exact_key(tenant, "m", CHAT, body(n))


async def test_set_get_and_layout(redis_server: RedisServer) -> None:
    store = RedisStore.from_url(redis_server.url, SETTINGS)
    raw = redis_server_client(redis_server)
    try:
        k = key()
        assert await store.get(k) is None
        assert await store.set(k, ANSWER.to_bytes(), ttl_s=60, max_entries=10) == 0
        assert CachedCompletion.from_bytes(await store.get(k) or b"") == ANSWER
        digest = k.split(":")[1]
        # One hash tag per tenant; the value carries the TTL.
        assert sorted(await raw.keys("*")) == [b"fg:c:{t1}:e:" + digest.encode(), b"fg:c:{t1}:lru"]
        assert 59_000 < await raw.pttl(f"fg:c:{{t1}}:e:{digest}") <= 60_000
        assert await raw.zcard("fg:c:{t1}:lru") == 1
    finally:
        await store.close()
        await raw.aclose()


async def test_ttl_expires(redis_server: RedisServer) -> None:
    store = RedisStore.from_url(redis_server.url, SETTINGS)
    try:
        await store.set(key(), b"v", ttl_s=0.15, max_entries=10)
        assert await store.get(key()) == b"v"
        await asyncio.sleep(0.25)
        assert await store.get(key()) is None
    finally:
        await store.close()


async def test_per_tenant_bound_evicts_least_recently_used(redis_server: RedisServer) -> None:
    store = RedisStore.from_url(redis_server.url, SETTINGS)
    try:
        for n in range(3):
            assert await store.set(key("small", n), b"%d" % n, ttl_s=HOUR, max_entries=3) == 0
        await store.set(key("big", 0), b"big", ttl_s=HOUR, max_entries=100)
        assert await store.get(key("small", 0)) == b"0"  # now 1 is the least recently used
        assert await store.set(key("small", 3), b"3", ttl_s=HOUR, max_entries=3) == 1
        assert await store.get(key("small", 1)) is None
        assert [await store.get(key("small", n)) for n in (0, 2, 3)] == [b"0", b"2", b"3"]
        # Two more into a bound of 3: two evictions, none of them another tenant's.
        assert await store.set(key("small", 4), b"4", ttl_s=HOUR, max_entries=3) == 1
        assert await store.set(key("small", 5), b"5", ttl_s=HOUR, max_entries=3) == 1
        assert await store.get(key("big", 0)) == b"big"
    finally:
        await store.close()


async def test_expired_members_are_pruned_not_evicted(redis_server: RedisServer) -> None:
    store = RedisStore.from_url(redis_server.url, SETTINGS)
    raw = redis_server_client(redis_server)
    try:
        await store.set(key("t1", 0), b"old", ttl_s=0.05, max_entries=2)
        await asyncio.sleep(0.1)
        await store.set(key("t1", 1), b"a", ttl_s=HOUR, max_entries=2)
        assert await store.set(key("t1", 2), b"b", ttl_s=HOUR, max_entries=2) == 0
        assert await raw.zcard("fg:c:{t1}:lru") == 2
    finally:
        await store.close()
        await raw.aclose()


async def test_tenants_never_share_entries(redis_server: RedisServer) -> None:
    cache = ResponseCache(RedisStore.from_url(redis_server.url, SETTINGS), SETTINGS)
    try:
        tenant = CacheSettings()
        k1, k2 = key("t1"), key("t2")  # the same prompt, two tenants
        assert k1 != k2 and k1.split(":")[1] != k2.split(":")[1]
        await cache.store(k1, ANSWER, tenant)
        assert await cache.lookup(k1) == ANSWER
        assert await cache.lookup(k2) is None
    finally:
        await cache.close()


async def test_a_new_store_and_another_process_see_the_entries(redis_server: RedisServer) -> None:
    first = RedisStore.from_url(redis_server.url, SETTINGS)
    await first.set(key(), ANSWER.to_bytes(), ttl_s=60, max_entries=10)
    await first.close()
    # A gateway restart: a new store, new connections, same Redis.
    second = RedisStore.from_url(redis_server.url, SETTINGS)
    try:
        assert CachedCompletion.from_bytes(await second.get(key()) or b"") == ANSWER
    finally:
        await second.close()
    # Another gateway process.
    script = (
        "import asyncio, sys\n"
        "from cache.config import CacheServiceSettings\n"
        "from cache.redis_store import RedisStore\n"
        "async def main():\n"
        "    store = RedisStore.from_url(sys.argv[1], CacheServiceSettings(lookup_timeout_ms=1000))\n"
        "    value = await store.get(sys.argv[2])\n"
        "    await store.close()\n"
        "    sys.stdout.buffer.write(value or b'MISSING')\n"
        "asyncio.run(main())\n"
    )
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", script, redis_server.url, key(), stdout=asyncio.subprocess.PIPE
    )
    stdout, _ = await asyncio.wait_for(proc.communicate(), timeout=30)
    assert proc.returncode == 0
    assert CachedCompletion.from_bytes(stdout) == ANSWER


async def test_redis_restart_comes_back_empty_and_usable(redis_server: RedisServer) -> None:
    store = RedisStore.from_url(redis_server.url, SETTINGS)
    try:
        await store.set(key(), b"v", ttl_s=60, max_entries=10)
        redis_server.restart()  # no persistence: nothing survives, scripts are gone too
        deadline = time.monotonic() + 5
        value: bytes | None = b"?"
        while time.monotonic() < deadline:
            try:
                value = await store.get(key())
                break
            except CacheUnavailable:
                await asyncio.sleep(0.05)  # the old connection broke, the breaker may be open
        assert value is None
        assert await store.set(key(), b"again", ttl_s=60, max_entries=10) == 0  # NOSCRIPT handled
        assert await store.get(key()) == b"again"
    finally:
        await store.close()


async def test_dead_redis_costs_little_and_recovers(redis_server: RedisServer) -> None:
    metrics = CacheMetrics()
    cache = ResponseCache(RedisStore.from_url(redis_server.url, SETTINGS), SETTINGS, metrics)
    tenant = CacheSettings()
    try:
        await cache.store(key(), ANSWER, tenant)
        assert await cache.lookup(key()) == ANSWER
        redis_server.kill()
        durations = []
        for _ in range(20):
            started = time.perf_counter()
            assert await cache.lookup(key()) is None
            durations.append(time.perf_counter() - started)
        # Every lookup is bounded by the 50 ms timeout (plus scheduling slack); once the
        # breaker opened (3 failures), lookups do not touch the network at all.
        assert max(durations) < 0.25
        assert max(durations[3:]) < 0.005
        assert metrics.sample("fleetgate_cache_store_degraded") == 1
        assert metrics.sample("fleetgate_cache_lookups_total", kind="exact", result="unavailable") >= 17
        assert not await cache.store(key(), ANSWER, tenant)

        redis_server.start()  # empty: no persistence
        await asyncio.sleep(COOLDOWN_S)
        await cache.store(key(), ANSWER, tenant)  # the half-open probe succeeds
        assert await cache.lookup(key()) == ANSWER
        assert metrics.sample("fleetgate_cache_store_degraded") == 0
    finally:
        await cache.close()


async def test_slow_redis_is_a_bounded_miss(redis_server: RedisServer) -> None:
    metrics = CacheMetrics()
    cache = ResponseCache(RedisStore.from_url(redis_server.url, SETTINGS), SETTINGS, metrics)
    raw = redis_server_client(redis_server)
    try:
        await cache.store(key(), ANSWER, CacheSettings())
        await raw.client_pause(500, all=True)  # Redis stops answering for 0.5 s
        started = time.perf_counter()
        assert await cache.lookup(key()) is None
        assert time.perf_counter() - started < 0.25  # 50 ms timeout, not 500 ms
        assert metrics.sample("fleetgate_cache_lookups_total", kind="exact", result="timeout") == 1
    finally:
        await raw.aclose()
        await cache.close()


def redis_server_client(server: RedisServer) -> aioredis.Redis:
    return aioredis.Redis.from_url(server.url)
