"""The memory store on a hand-driven clock: LRU order, TTL, per-tenant bounds."""

from __future__ import annotations

import pytest

from cache.memory_store import MemoryStore

T0 = 1_000.0
HOUR = 3600.0


class Clock:
    def __init__(self, now: float = T0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def k(scope: str, n: int) -> str:
    return f"{scope}:{n:064x}"


def test_get_returns_what_was_set() -> None:
    store = MemoryStore(Clock())
    assert store.get_now(k("a", 1)) is None
    assert store.set_now(k("a", 1), b"one", ttl_s=HOUR, max_entries=10) == 0
    assert store.get_now(k("a", 1)) == b"one"
    store.set_now(k("a", 1), b"uno", ttl_s=HOUR, max_entries=10)  # overwrite, still one entry
    assert store.get_now(k("a", 1)) == b"uno" and len(store) == 1


def test_ttl_expires_entries() -> None:
    clock = Clock()
    store = MemoryStore(clock)
    store.set_now(k("a", 1), b"v", ttl_s=60, max_entries=10)
    clock.now += 59.9
    assert store.get_now(k("a", 1)) == b"v"
    clock.now += 0.1  # exactly 60 s after the store
    assert store.get_now(k("a", 1)) is None
    assert len(store) == 0  # dropped on read


def test_reads_do_not_extend_the_ttl() -> None:
    clock = Clock()
    store = MemoryStore(clock)
    store.set_now(k("a", 1), b"v", ttl_s=60, max_entries=10)
    for _ in range(5):
        clock.now += 11
        assert store.get_now(k("a", 1)) == b"v"
    clock.now += 5  # 60 s since the store, however often it was read
    assert store.get_now(k("a", 1)) is None


def test_least_recently_used_is_evicted_first() -> None:
    store = MemoryStore(Clock())
    for n in range(3):
        store.set_now(k("a", n), b"%d" % n, ttl_s=HOUR, max_entries=3)
    assert store.get_now(k("a", 0)) == b"0"  # 0 is now the most recently used; 1 the least
    assert store.set_now(k("a", 3), b"3", ttl_s=HOUR, max_entries=3) == 1
    assert store.get_now(k("a", 1)) is None
    assert [store.get_now(k("a", n)) for n in (0, 2, 3)] == [b"0", b"2", b"3"]
    assert store.evictions == 1


def test_bounds_are_per_tenant() -> None:
    store = MemoryStore(Clock())
    for n in range(5):
        store.set_now(k("small", n), b"x", ttl_s=HOUR, max_entries=2)
        store.set_now(k("big", n), b"x", ttl_s=HOUR, max_entries=100)
    # 5 stores into a bound of 2: 3 evictions, all from "small"; "big" keeps everything.
    assert store.count("small") == 2 and store.count("big") == 5
    assert store.evictions == 3
    assert store.get_now(k("big", 0)) == b"x"


def test_same_digest_in_two_tenants_is_two_entries() -> None:
    store = MemoryStore(Clock())
    store.set_now(k("a", 1), b"for a", ttl_s=HOUR, max_entries=10)
    assert store.get_now(k("b", 1)) is None
    store.set_now(k("b", 1), b"for b", ttl_s=HOUR, max_entries=10)
    assert (store.get_now(k("a", 1)), store.get_now(k("b", 1))) == (b"for a", b"for b")


def test_expired_entries_trimmed_are_not_evictions() -> None:
    clock = Clock()
    store = MemoryStore(clock)
    store.set_now(k("a", 0), b"old", ttl_s=10, max_entries=2)
    clock.now += 20  # entry 0 expired, still held
    store.set_now(k("a", 1), b"x", ttl_s=HOUR, max_entries=2)
    assert store.set_now(k("a", 2), b"y", ttl_s=HOUR, max_entries=2) == 0
    assert store.evictions == 0 and store.count("a") == 2


async def test_async_interface_and_close() -> None:
    store = MemoryStore(Clock())
    assert await store.set(k("a", 1), b"v", ttl_s=HOUR, max_entries=1) == 0
    assert await store.get(k("a", 1)) == b"v"
    await store.close()
    with pytest.raises(RuntimeError):
        await store.get(k("a", 1))
