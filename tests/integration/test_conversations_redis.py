"""The Redis response store against a real redis-server: layout, TTL, bounds, pods, outages."""

from __future__ import annotations

import asyncio
import os
import shutil
import time
from typing import Any

import pytest
import redis.asyncio as aioredis

from conversations.config import ResponsesSettings
from conversations.factory import create_response_store
from conversations.redis_store import RedisResponseStore
from conversations.store import RecordTooLarge, StoreUnavailableError
from tests.integration.redis_server import REDIS_BINARY, RedisServer
from tests.integration.redis_topology import REDIS_CLI, LocalCluster

pytestmark = pytest.mark.redis

DAY = 86_400.0
TIMEOUT_MS = 200
# Short enough to keep the outage test quick, long enough to see the breaker hold.
COOLDOWN_S = 0.3
SETTINGS = ResponsesSettings(redis_timeout_ms=TIMEOUT_MS, breaker_cooldown_s=COOLDOWN_S)
# What a call may take past its deadline on a loaded two-core machine.
SLACK_S = 0.3


def raw_client(server: RedisServer) -> aioredis.Redis:
    return aioredis.Redis.from_url(server.url)


async def index(raw: aioredis.Redis, tenant: str) -> tuple[int, dict[Any, int], list[Any], list[Any]]:
    """(counted bytes, sizes, ids by age, ids by expiry) of a tenant, read straight from Redis."""
    base = f"fg:resp:{{{tenant}}}"
    used = int(await raw.hget(f"{base}:meta", "bytes") or 0)
    sizes = {k: int(v) for k, v in (await raw.hgetall(f"{base}:size")).items()}
    return used, sizes, await raw.zrange(f"{base}:age", 0, -1), await raw.zrange(f"{base}:exp", 0, -1)


async def test_put_get_delete_and_layout(redis_server: RedisServer) -> None:
    store = create_response_store(redis_server.url, SETTINGS)
    assert isinstance(store, RedisResponseStore)
    raw = raw_client(redis_server)
    try:
        async with store:
            assert await store.get("t1", "resp_1") is None
            await store.put("t1", "resp_1", b'{"id":"resp_1"}', 60, 1000)
            assert await store.get("t1", "resp_1") == b'{"id":"resp_1"}'
            # One hash tag per tenant; the record carries the TTL, the index lives as long.
            assert sorted(await raw.keys("*")) == [
                b"fg:resp:{t1}:age",
                b"fg:resp:{t1}:exp",
                b"fg:resp:{t1}:meta",
                b"fg:resp:{t1}:r:resp_1",
                b"fg:resp:{t1}:size",
            ]
            assert 59_000 < await raw.pttl("fg:resp:{t1}:r:resp_1") <= 60_000
            for name in ("age", "exp", "meta", "size"):
                assert 59_000 < await raw.pttl(f"fg:resp:{{t1}}:{name}") <= 60_000
            assert await index(raw, "t1") == (15, {b"resp_1": 15}, [b"resp_1"], [b"resp_1"])

            assert await store.delete("t1", "resp_1") is True
            assert await store.get("t1", "resp_1") is None
            assert await store.delete("t1", "resp_1") is False
            assert await raw.keys("*") == []  # the last record took its index with it
    finally:
        await raw.aclose()


async def test_tenant_escaping_keeps_one_hash_tag(redis_server: RedisServer) -> None:
    raw = raw_client(redis_server)
    async with RedisResponseStore.from_url(redis_server.url, SETTINGS) as store:
        await store.put("a}b:c{%", "r", b"v", 60, 100)
        assert await store.get("a}b:c{%", "r") == b"v"
        assert await store.get("a", "r") is None
        assert b"fg:resp:{a%7Db%3Ac%7B%25}:r:r" in await raw.keys("*")
        with pytest.raises(ValueError):
            await store.get("", "r")
    await raw.aclose()


async def test_ttl_expires_and_the_next_put_sweeps_the_index(redis_server: RedisServer) -> None:
    raw = raw_client(redis_server)
    async with RedisResponseStore.from_url(redis_server.url, SETTINGS) as store:
        await store.put("t1", "long", b"L" * 100, DAY, 1000)  # the oldest, but lives longest
        await store.put("t1", "short", b"S" * 200, 0.15, 1000)
        assert await store.get("t1", "short") == b"S" * 200
        assert (await index(raw, "t1"))[0] == 300
        await asyncio.sleep(0.25)
        assert await store.get("t1", "short") is None
        assert await store.delete("t1", "short") is False  # expired: not a live record
        await store.put("t1", "new", b"N" * 10, DAY, 1000)
        assert await index(raw, "t1") == (110, {b"long": 100, b"new": 10}, [b"long", b"new"], [b"long", b"new"])
    await raw.aclose()


async def test_the_index_expires_with_its_longest_lived_record(redis_server: RedisServer) -> None:
    raw = raw_client(redis_server)
    async with RedisResponseStore.from_url(redis_server.url, SETTINGS) as store:
        await store.put("t1", "a", b"a", 0.2, 100)
        await store.put("t1", "b", b"b", 0.1, 100)
        await asyncio.sleep(0.3)
        assert await raw.keys("*") == []
    await raw.aclose()


async def test_two_pods_share_records_and_one_bound(redis_server: RedisServer) -> None:
    raw = raw_client(redis_server)
    pod_a = RedisResponseStore.from_url(redis_server.url, SETTINGS)
    pod_b = RedisResponseStore.from_url(redis_server.url, SETTINGS)
    try:
        bound = 100
        await pod_a.put("t1", "r1", b"1" * 30, DAY, bound)
        await pod_b.put("t1", "r2", b"2" * 30, DAY, bound)
        await pod_a.put("t1", "r3", b"3" * 30, DAY, bound)
        await pod_b.put("other", "x", b"x" * 90, DAY, bound)
        assert await pod_b.get("t1", "r1") == b"1" * 30  # stored by A, read by B
        # 90 + 10 = 100 fits exactly: nothing goes.
        await pod_b.put("t1", "r4", b"4" * 10, DAY, bound)
        assert (await index(raw, "t1"))[0] == 100
        # 100 + 25 > 100: r1 (30) goes, 70 + 25 = 95.
        await pod_b.put("t1", "r5", b"5" * 25, DAY, bound)
        assert await pod_a.get("t1", "r1") is None
        # 95 + 60 > 100: r2 then r3 go, 35 + 60 = 95.
        await pod_a.put("t1", "r6", b"6" * 60, DAY, bound)
        assert [await pod_b.get("t1", r) is not None for r in ("r2", "r3", "r4", "r5", "r6")] == [
            False,
            False,
            True,
            True,
            True,
        ]
        assert await index(raw, "t1") == (
            95,
            {b"r4": 10, b"r5": 25, b"r6": 60},
            [b"r4", b"r5", b"r6"],
            [b"r4", b"r5", b"r6"],
        )
        assert await pod_a.get("other", "x") == b"x" * 90  # never another tenant's
        # Stored again: replaced, and now the newest (r4 becomes the next to go).
        await pod_b.put("t1", "r4", b"4" * 5, DAY, bound)
        assert (await index(raw, "t1"))[:3] == (90, {b"r4": 5, b"r5": 25, b"r6": 60}, [b"r5", b"r6", b"r4"])
    finally:
        await pod_a.close()
        await pod_b.close()
        await raw.aclose()


async def test_concurrent_puts_from_two_pods_keep_the_bound_exact(redis_server: RedisServer) -> None:
    raw = raw_client(redis_server)
    pods = [RedisResponseStore.from_url(redis_server.url, SETTINGS) for _ in range(2)]
    try:
        bound = 1000
        sizes = [37 + (n * 53) % 200 for n in range(60)]
        await asyncio.gather(*(pods[n % 2].put("t1", f"r{n}", b"x" * size, DAY, bound) for n, size in enumerate(sizes)))
        used, held, by_age, _ = await index(raw, "t1")
        live = {rid: len(await raw.get(b"fg:resp:{t1}:r:" + rid) or b"") for rid in by_age}
        assert used == sum(held.values()) == sum(live.values()) <= bound
        assert held == live
        assert len(by_age) == len(await raw.keys("fg:resp:{t1}:r:*"))
        # The survivors are the newest in the order Redis ran the puts (insertion numbers
        # 1..60): each put evicted from the front, so they are the last few numbers, unbroken.
        scored: list[Any] = await raw.zrange("fg:resp:{t1}:age", 0, -1, withscores=True)
        numbers = [int(score) for _, score in scored]
        assert numbers == list(range(61 - len(numbers), 61))
        assert int(await raw.hget("fg:resp:{t1}:meta", "seq") or 0) == 60
    finally:
        for pod in pods:
            await pod.close()
        await raw.aclose()


async def test_tenants_are_isolated(redis_server: RedisServer) -> None:
    async with RedisResponseStore.from_url(redis_server.url, SETTINGS) as store:
        await store.put("a", "resp_1", b"a's", DAY, 100)
        assert await store.get("b", "resp_1") is None
        assert await store.delete("b", "resp_1") is False
        assert await store.get("a", "resp_1") == b"a's"
        await store.put("b", "resp_1", b"b's", DAY, 100)
        assert (await store.get("a", "resp_1"), await store.get("b", "resp_1")) == (b"a's", b"b's")


async def test_record_too_large_is_refused_before_redis(redis_server: RedisServer) -> None:
    raw = raw_client(redis_server)
    async with RedisResponseStore.from_url(redis_server.url, SETTINGS) as store:
        await store.put("t1", "r1", b"1" * 50, DAY, 100)
        with pytest.raises(RecordTooLarge):
            await store.put("t1", "r2", b"2" * 101, DAY, 100)
        assert await store.get("t1", "r1") == b"1" * 50
        assert (await index(raw, "t1"))[0] == 50
    await raw.aclose()


async def test_dead_redis_fails_within_the_deadline_and_recovers(redis_server: RedisServer) -> None:
    async with RedisResponseStore.from_url(redis_server.url, SETTINGS) as store:
        await store.put("t1", "r", b"v", DAY, 100)
        redis_server.kill()
        durations = []
        for _ in range(10):
            started = time.perf_counter()
            with pytest.raises(StoreUnavailableError):
                await store.get("t1", "r")
            durations.append(time.perf_counter() - started)
        # Every call is bounded by the deadline; once the breaker opened (3 failures), calls
        # fail without touching the network.
        assert max(durations) < TIMEOUT_MS / 1000 + SLACK_S
        assert max(durations[3:]) < 0.005
        assert store.degraded
        with pytest.raises(StoreUnavailableError) as caught:
            await store.put("t1", "r", b"v", DAY, 100)
        assert caught.value.reason == "circuit_open"

        redis_server.start()  # empty: no persistence, no scripts loaded
        await asyncio.sleep(COOLDOWN_S)
        deadline = time.monotonic() + 5
        while True:
            try:
                await store.put("t1", "r", b"again", DAY, 100)  # NOSCRIPT handled
                break
            except StoreUnavailableError:
                assert time.monotonic() < deadline
                await asyncio.sleep(COOLDOWN_S)
        assert not store.degraded
        assert await store.get("t1", "r") == b"again"
        assert await store.delete("t1", "r") is True


async def test_slow_redis_times_out_within_the_deadline(redis_server: RedisServer) -> None:
    raw = raw_client(redis_server)
    async with RedisResponseStore.from_url(redis_server.url, SETTINGS) as store:
        await store.put("t1", "r", b"v", DAY, 100)
        await raw.client_pause(1000, all=True)  # Redis stops answering for 1 s
        started = time.perf_counter()
        with pytest.raises(StoreUnavailableError) as caught:
            await store.get("t1", "r")
        assert time.perf_counter() - started < TIMEOUT_MS / 1000 + SLACK_S
        assert caught.value.reason == "timeout"
        assert isinstance(caught.value.__cause__, TimeoutError | aioredis.RedisError)
    await raw.aclose()


def _cluster_tools() -> bool:
    return all(os.access(b, os.X_OK) or shutil.which(b) is not None for b in (REDIS_BINARY, REDIS_CLI))


async def test_on_a_cluster_each_tenant_stays_on_one_slot() -> None:
    if not _cluster_tools():
        pytest.skip("no redis-server / redis-cli")
    # First calls open connections to each node: generous deadlines on a loaded machine.
    patient = SETTINGS.model_copy(update={"redis_timeout_ms": 5000})
    with LocalCluster() as cluster:
        async with RedisResponseStore.from_url(cluster.url, patient) as store:
            tenants = [f"tenant-{n}" for n in range(8)]
            assert len({cluster.master_of(store.keys(t).meta) for t in tenants}) > 1  # spread over shards
            for t in tenants:
                for n in range(4):
                    await store.put(t, f"r{n}", b"x" * 40, DAY, 100)  # bound 100: two survive
            for t in tenants:
                assert [await store.get(t, f"r{n}") is not None for n in range(4)] == [False, False, True, True]
                assert await store.delete(t, "r3") is True
                assert await store.get(t, "r3") is None
