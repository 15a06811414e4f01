"""The memory semantic store's bounds, and applying the shared log's events to an index."""

from __future__ import annotations

import numpy as np

from cache.semantic.index import SemanticEntry, SemanticIndex
from cache.semantic.redis_store import Event
from cache.semantic.store import MemorySemanticStore
from cache.semantic.sync import apply_events

DIM = 8


def entry(n: int, tenant: str = "t1", expires_at: float = 0.0) -> SemanticEntry:
    vector = np.zeros(DIM, dtype=np.float32)
    vector[n % DIM] = 1.0
    return SemanticEntry(f"id{n}", f"{tenant}:scope", f"q{n}", vector, f"{tenant}:id{n}", expires_at)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_memory_store_bounds_each_tenant_on_its_own() -> None:
    clock = Clock()
    store = MemorySemanticStore(clock)
    for n in range(3):
        assert store.put_now(entry(n), ttl_s=60, max_entries=3).evicted == ()
    store.put_now(entry(0, "t2"), ttl_s=60, max_entries=1)
    put = store.put_now(entry(3), ttl_s=60, max_entries=3)
    assert put.evicted == ("id0",) and put.evicted_live == 1
    assert put.expires_at == 1060.0 and put.seq is None
    assert len(store) == 4  # t2's entry untouched


async def test_memory_store_touch_delays_eviction_and_expired_evictions_are_not_counted() -> None:
    clock = Clock()
    store = MemorySemanticStore(clock)
    store.put_now(entry(0), ttl_s=10, max_entries=2)
    store.put_now(entry(1), ttl_s=100, max_entries=2)
    await store.touch(entry(0))
    clock.now += 20  # entry 0 has expired by now
    put = store.put_now(entry(2), ttl_s=100, max_entries=2)
    assert put.evicted == ("id1",) and put.evicted_live == 1
    put = store.put_now(entry(3), ttl_s=100, max_entries=2)
    assert put.evicted == ("id0",) and put.evicted_live == 0
    await store.delete(entry(3))
    assert len(store) == 1


def add(seq: int, n: int, expires_at: float = 100.0) -> Event:
    return Event(f"{seq}-0", seq, "add", f"id{n}", entry(n, expires_at=expires_at))


def delete(seq: int, n: int) -> Event:
    return Event(f"{seq}-0", seq, "del", f"id{n}")


def test_events_apply_in_order() -> None:
    index = SemanticIndex(DIM)
    done = apply_events(index, [add(6, 1), add(7, 2), delete(8, 1), add(9, 3, expires_at=5.0)], 5, now=10.0)
    assert (done.seq, done.stream_id, done.applied, done.gap) == (9, "9-0", 4, False)
    assert "id2" in index and "id1" not in index
    assert "id3" not in index  # arrived already expired


def test_a_missing_event_is_a_gap() -> None:
    index = SemanticIndex(DIM)
    done = apply_events(index, [add(6, 1), add(8, 2)], 5, now=0.0)
    assert (done.seq, done.applied, done.gap) == (6, 1, True)
    assert "id2" not in index
    # After Redis lost its data the counter starts again: also a gap.
    assert apply_events(index, [add(1, 4)], 6, now=0.0).gap
