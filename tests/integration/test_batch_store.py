"""The batch stores' contract, the same for memory and a real redis-server: claims in order,
a result written once (and its tokens counted once), items handed back, expired leases
reaped, closed batches skipped."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable

import orjson
import pytest

from batch.memory_store import MemoryBatchStore
from batch.model import BatchRecord, Counts, Progress
from batch.redis_store import RedisBatchStore
from batch.store import BatchStore, Claim
from batch.usage import ZERO, Usage
from redisconn.factory import ClientOptions, connect
from tests.integration.redis_server import RedisServer

LEASE_S = 0.2


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


Expire = Callable[[], Awaitable[None]]


@pytest.fixture(params=["memory", "redis"])
async def store(request: pytest.FixtureRequest) -> AsyncIterator[tuple[BatchStore, Expire]]:
    """A store, and how to let its leases run out (the memory store's clock is ours; Redis's is its own)."""
    if request.param == "memory":
        clock = Clock()

        async def advance() -> None:
            clock.now += LEASE_S + 0.01

        yield MemoryBatchStore(clock), advance
        return
    server: RedisServer = request.getfixturevalue("redis_server")
    client = connect(server.url, ClientOptions(socket_timeout_s=2, connect_timeout_s=2))

    async def wait() -> None:
        await asyncio.sleep(LEASE_S + 0.05)

    async with RedisBatchStore(client, timeout_s=2) as redis_store:
        yield redis_store, wait


def running(batch_id: str, total: int, tenant: str = "t1", created_at: int = 100) -> BatchRecord:
    record = BatchRecord(batch_id, tenant, "/v1/chat/completions", "file-1", "24h", created_at, created_at + 86400)
    return record.moved("in_progress", created_at, counts=Counts(total=total))


async def test_claims_take_items_in_order_and_results_are_written_once(store: tuple[BatchStore, Expire]) -> None:
    s, _ = store
    await s.create(running("batch_a", 2))
    first = await s.claim("pod1", 60)
    second = await s.claim("pod2", 60)
    assert (first, second) == (Claim("batch_a", 0), Claim("batch_a", 1))
    assert await s.claim("pod1", 60) is None
    assert await s.progress("batch_a") == Progress(Counts(2, 0, 0), 2, ZERO)
    assert await s.complete("pod1", first, True, b'{"ok": 0}', Usage(12, 5, 8, 1)) is True
    # A second write of the same item (a run that raced a requeue) is refused and not counted.
    assert await s.complete("pod2", first, True, b'{"ok": "again"}', Usage(12, 6)) is False
    assert await s.complete("pod2", second, False, b'{"bad": 1}') is True
    assert await s.progress("batch_a") == Progress(Counts(2, 1, 1), 0, Usage(12, 5, 8, 1))
    results = {0: (True, b'{"ok": 0}'), 1: (False, b'{"bad": 1}')}
    assert await s.results("batch_a") == (results, Usage(12, 5, 8, 1))


async def test_a_released_item_comes_back(store: tuple[BatchStore, Expire]) -> None:
    s, _ = store
    await s.create(running("batch_a", 1))
    claim = await s.claim("pod1", 60)
    assert claim is not None
    await s.release("pod2", claim)  # not pod2's lease: nothing happens
    assert await s.claim("pod1", 60) is None
    await s.release("pod1", claim)
    assert await s.queue_depth() == 1
    assert await s.claim("pod2", 60) == claim


async def test_expired_leases_are_reaped_and_taken_again(store: tuple[BatchStore, Expire]) -> None:
    s, expire = store
    await s.create(running("batch_a", 2))
    dead = await s.claim("dead-pod", LEASE_S)
    alive = await s.claim("pod", LEASE_S)
    assert dead is not None and alive is not None
    await s.complete("pod", alive, True, b"x", Usage(3, 1))
    await expire()
    assert await s.reap() == 1
    assert await s.progress("batch_a") == Progress(Counts(2, 1, 0), 0, Usage(3, 1))
    assert await s.claim("pod", 60) == dead
    # The dead pod was only slow: its late result is still the one written, once, and its
    # tokens are counted once although the item ran twice.
    assert await s.complete("dead-pod", dead, True, b"late", Usage(4, 2)) is True
    assert await s.complete("pod", dead, True, b"second", Usage(4, 2)) is False
    assert await s.progress("batch_a") == Progress(Counts(2, 2, 0), 0, Usage(3 + 4, 1 + 2))


async def test_renewed_leases_are_not_reaped(store: tuple[BatchStore, Expire]) -> None:
    s, expire = store
    await s.create(running("batch_a", 1))
    claim = await s.claim("pod", LEASE_S)
    assert claim is not None
    await s.renew("pod", [claim], 60)
    await expire()
    assert await s.reap() == 0


async def test_a_requeued_item_that_got_its_result_is_skipped(store: tuple[BatchStore, Expire]) -> None:
    s, expire = store
    await s.create(running("batch_a", 1))
    claim = await s.claim("slow-pod", LEASE_S)
    assert claim is not None
    await expire()
    await s.reap()  # back in the queue...
    await s.complete("slow-pod", claim, True, b"done")  # ...but its slow pod finished it after all
    assert await s.claim("pod", 60) is None


async def test_closed_batches_give_no_items_and_older_batches_go_first(store: tuple[BatchStore, Expire]) -> None:
    s, _ = store
    await s.create(running("batch_old", 1, created_at=100))
    await asyncio.sleep(0.01)
    await s.create(running("batch_new", 1, created_at=200))
    assert await s.queue_depth() == 2
    await s.close("batch_old")
    assert await s.queue_depth() == 1
    assert await s.claim("pod", 60) == Claim("batch_new", 0)


async def test_records_are_the_tenants_and_replaced_only_from_the_expected_status(
    store: tuple[BatchStore, Expire],
) -> None:
    s, _ = store
    for i in range(5):
        await s.create(running(f"batch_{i}", 1, created_at=100 + i))
    await s.create(running("batch_other", 1, tenant="t2"))
    assert await s.get("t2", "batch_1") is None
    assert (await s.get("t1", "batch_1")) == running("batch_1", 1, created_at=101)
    page, more = await s.listing("t1", None, 2)
    assert [r.id for r in page] == ["batch_4", "batch_3"] and more
    page, more = await s.listing("t1", "batch_3", 10)
    assert [r.id for r in page] == ["batch_2", "batch_1", "batch_0"] and not more
    kept = running("batch_1", 1, created_at=101)
    cancelling = kept.moved("cancelling", 150)
    assert await s.replace(cancelling, "completed") is False
    assert await s.replace(cancelling, "in_progress") is True
    assert (await s.get_any("batch_1")) == cancelling


async def test_one_pod_holds_the_finishing_lock(store: tuple[BatchStore, Expire]) -> None:
    s, _ = store
    assert await s.lock("batch_a", "pod1", 60) is True
    assert await s.lock("batch_a", "pod2", 60) is False
    assert await s.lock("batch_a", "pod1", 60) is True
    await s.create(running("batch_a", 1))
    await s.forget("batch_a")
    assert await s.active() == [] and await s.claim("pod", 60) is None


async def test_usage_is_counted_once_per_item_under_concurrent_duplicates(store: tuple[BatchStore, Expire]) -> None:
    """Every item completed by three pods at once (a lease that lapsed twice): one result,
    one count, one item's tokens each."""
    s, _ = store
    await s.create(running("batch_a", 10))
    claims = [await s.claim("pod1", 60) for _ in range(10)]
    writes = [
        s.complete(pod, claim, True, f"{pod}-{claim.index}".encode(), Usage(10 + claim.index, 2, 1, 0))
        for claim in claims
        if claim is not None
        for pod in ("pod1", "pod2", "pod3")
    ]
    written = await asyncio.gather(*writes)
    assert sum(written) == 10
    expected = Usage(sum(10 + i for i in range(10)), 2 * 10, 1 * 10, 0)
    progress = await s.progress("batch_a")
    assert progress.counts == Counts(10, 10, 0) and progress.usage == expected
    results, usage = await s.results("batch_a")
    assert len(results) == 10 and usage == expected


async def test_an_ended_batchs_usage_is_its_records(store: tuple[BatchStore, Expire]) -> None:
    s, _ = store
    record = running("batch_a", 1)
    await s.create(record)
    claim = await s.claim("pod", 60)
    assert claim is not None
    await s.complete("pod", claim, True, b"x", Usage(3, 1))
    done = record.moved("finalizing", 101).moved("completed", 102, counts=Counts(1, 1, 0), usage=Usage(3, 1))
    assert await s.replace(done, "in_progress")
    await s.forget("batch_a")
    assert await s.progress("batch_a") == Progress(Counts(1, 1, 0), 0, Usage(3, 1))
    assert (await s.get("t1", "batch_a")) == done
    assert await s.results("batch_a") == ({}, ZERO)


async def test_a_batch_kept_before_usage_was_counted_still_runs(redis_server: RedisServer) -> None:
    """A rolling upgrade: a record and a queue written by the version before ``model`` and
    ``usage`` load and run; the batch shows no usage (its first items were not counted)."""
    client = connect(redis_server.url, ClientOptions(socket_timeout_s=2, connect_timeout_s=2))
    async with RedisBatchStore(client, timeout_s=2, prefix="fg:batch:{old}:") as s:
        record = running("batch_old", 2)
        old_json = {k: v for k, v in orjson.loads(record.to_bytes()).items() if k not in ("model", "usage")}
        await client.set("fg:batch:{old}:rec:batch_old", orjson.dumps(old_json))
        await client.zadd("fg:batch:{old}:active", {"batch_old": 1})
        # The old queue hash, one item already answered by an old pod (no usage fields).
        old_queue = {"total": 2, "next": 1, "open": 1, "completed": 1, "failed": 0, "leased": 0}
        await client.hset("fg:batch:{old}:q:batch_old", mapping=old_queue)
        await client.hset("fg:batch:{old}:res:batch_old", "0", b"1" + b'{"old": 0}')
        kept = await s.get_any("batch_old")
        assert kept is not None and kept.model is None and kept.usage is None
        assert await s.progress("batch_old") == Progress(Counts(2, 1, 0), 0, ZERO)
        claim = await s.claim("pod", 60)
        assert claim == Claim("batch_old", 1)
        assert await s.complete("pod", claim, True, b'{"new": 1}', Usage(5, 2))
        assert (await s.progress("batch_old")).usage == Usage(5, 2)
        assert kept.to_openai(await s.progress("batch_old"))["usage"] is None
