"""The memory response store on a hand-driven clock: TTL, tenant isolation, bounds, bytes."""

from __future__ import annotations

import pytest

from conversations.factory import create_response_store
from conversations.memory_store import MemoryResponseStore
from conversations.store import RecordTooLarge, ResponseStore

T0 = 1_000.0
DAY = 86_400.0


class Clock:
    def __init__(self, now: float = T0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_put_get_delete() -> None:
    store = MemoryResponseStore(Clock())
    assert store.get_now("a", "resp_1") is None
    store.put_now("a", "resp_1", b'{"id":"resp_1"}', DAY, 1000)
    assert store.get_now("a", "resp_1") == b'{"id":"resp_1"}'
    assert store.delete_now("a", "resp_1") is True
    assert store.get_now("a", "resp_1") is None
    assert store.delete_now("a", "resp_1") is False
    assert store.used_bytes("a") == 0 and store.count("a") == 0


def test_ttl_expires_on_read() -> None:
    clock = Clock()
    store = MemoryResponseStore(clock)
    store.put_now("a", "r", b"v", 60, 1000)
    clock.now += 59.9
    assert store.get_now("a", "r") == b"v"
    clock.now += 0.1  # exactly 60 s after the put
    assert store.get_now("a", "r") is None
    assert store.used_bytes("a") == 0  # the read freed it


def test_delete_of_an_expired_record_says_false_and_frees_it() -> None:
    clock = Clock()
    store = MemoryResponseStore(clock)
    store.put_now("a", "r", b"12345", 60, 1000)
    clock.now += 61
    assert store.used_bytes("a") == 5  # not swept yet
    assert store.delete_now("a", "r") is False
    assert store.used_bytes("a") == 0


def test_put_sweeps_expired_records_whatever_their_place() -> None:
    clock = Clock()
    store = MemoryResponseStore(clock)
    store.put_now("a", "long", b"L" * 100, 3600, 1000)  # the oldest, but lives longest
    store.put_now("a", "short", b"S" * 200, 60, 1000)
    store.put_now("b", "other", b"O" * 50, 60, 1000)
    assert store.used_bytes("a") == 300
    clock.now += 60
    store.put_now("a", "new", b"N" * 10, 3600, 1000)
    # "short" expired behind the live "long": swept all the same; 100 + 10 left.
    assert store.used_bytes("a") == 110
    assert store.count("a") == 2
    # Another tenant's expired records go at any put too.
    assert store.used_bytes("b") == 0 and store.count("b") == 0


def test_tenants_are_isolated() -> None:
    store = MemoryResponseStore(Clock())
    store.put_now("a", "resp_1", b"a's", DAY, 1000)
    assert store.get_now("b", "resp_1") is None
    assert store.delete_now("b", "resp_1") is False
    assert store.get_now("a", "resp_1") == b"a's"
    # The same id under two tenants: two records.
    store.put_now("b", "resp_1", b"b's", DAY, 1000)
    assert store.get_now("a", "resp_1") == b"a's"
    assert store.get_now("b", "resp_1") == b"b's"
    assert (store.used_bytes("a"), store.used_bytes("b")) == (3, 3)


def test_eviction_takes_the_oldest_first_with_exact_bytes() -> None:
    clock = Clock()
    store = MemoryResponseStore(clock)
    bound = 100
    store.put_now("a", "r1", b"1" * 30, DAY, bound)
    store.put_now("a", "r2", b"2" * 30, DAY, bound)
    store.put_now("a", "r3", b"3" * 30, DAY, bound)
    store.put_now("b", "x", b"x" * 90, DAY, bound)
    assert store.used_bytes("a") == 90
    # 90 + 10 = 100 fits exactly: nothing goes.
    store.put_now("a", "r4", b"4" * 10, DAY, bound)
    assert store.used_bytes("a") == 100 and store.count("a") == 4
    # 100 + 25 > 100: r1 (30) goes, 70 + 25 = 95.
    store.put_now("a", "r5", b"5" * 25, DAY, bound)
    assert store.get_now("a", "r1") is None
    assert store.used_bytes("a") == 95
    # 95 + 60 > 100: r2 (30) then r3 (30) go, 35 + 60 = 95.
    store.put_now("a", "r6", b"6" * 60, DAY, bound)
    assert [store.get_now("a", r) is not None for r in ("r2", "r3", "r4", "r5", "r6")] == [
        False,
        False,
        True,
        True,
        True,
    ]
    assert store.used_bytes("a") == 10 + 25 + 60
    # Never another tenant's.
    assert store.get_now("b", "x") == b"x" * 90 and store.used_bytes("b") == 90


def test_a_record_stored_again_replaces_the_old_one_and_becomes_the_newest() -> None:
    store = MemoryResponseStore(Clock())
    store.put_now("a", "r1", b"1" * 40, DAY, 100)
    store.put_now("a", "r2", b"2" * 40, DAY, 100)
    store.put_now("a", "r1", b"1" * 20, DAY, 100)  # 80 - 40 + 20 = 60
    assert store.used_bytes("a") == 60 and store.count("a") == 2
    store.put_now("a", "r3", b"3" * 50, DAY, 100)  # 60 + 50 > 100: r2 is the oldest now
    assert store.get_now("a", "r2") is None
    assert store.get_now("a", "r1") == b"1" * 20
    assert store.used_bytes("a") == 70


def test_a_replaced_record_keeps_only_its_new_ttl() -> None:
    clock = Clock()
    store = MemoryResponseStore(clock)
    store.put_now("a", "r", b"old", 10, 100)
    store.put_now("a", "r", b"new", 100, 100)
    clock.now += 50  # past the first put's expiry
    store.put_now("a", "other", b"o", 100, 100)  # sweeps: the stale expiry must not remove "r"
    assert store.get_now("a", "r") == b"new"
    assert store.used_bytes("a") == 4


def test_record_larger_than_the_bound_is_refused_and_changes_nothing() -> None:
    store = MemoryResponseStore(Clock())
    store.put_now("a", "r1", b"1" * 50, DAY, 100)
    store.put_now("a", "r2", b"2" * 100, DAY, 100)  # exactly the bound: fits once r1 is evicted
    assert store.get_now("a", "r1") is None and store.used_bytes("a") == 100
    with pytest.raises(RecordTooLarge) as caught:
        store.put_now("a", "r3", b"3" * 101, DAY, 100)
    assert (caught.value.size, caught.value.bound) == (101, 100)
    assert store.get_now("a", "r2") == b"2" * 100 and store.used_bytes("a") == 100


def test_bad_arguments_are_refused() -> None:
    store = MemoryResponseStore(Clock())
    with pytest.raises(ValueError):
        store.put_now("a", "r", b"v", 0, 100)
    with pytest.raises(ValueError):
        store.put_now("a", "r", b"v", 60, 0)


def test_stale_expiry_entries_do_not_pile_up() -> None:
    store = MemoryResponseStore(Clock())
    for n in range(1000):
        store.put_now("a", f"r{n}", b"x" * 10, DAY, 100)  # each put evicts one: a stale entry each
    assert store.count("a") == 10 and store.used_bytes("a") == 100
    assert len(store._tenants["a"].expiries) <= 2 * 10 + 16 + 1


async def test_async_api_and_lifecycle() -> None:
    store: ResponseStore = create_response_store(None)
    assert isinstance(store, MemoryResponseStore)
    async with store:
        await store.put("a", "r", b"v", DAY, 100)
        assert await store.get("a", "r") == b"v"
        assert await store.delete("a", "r") is True
    with pytest.raises(RuntimeError):
        await store.get("a", "r")
