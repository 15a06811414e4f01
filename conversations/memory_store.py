"""Stored responses in this process's memory: the embedded default when no ``redis_url`` is set.

Each tenant has its own insertion-ordered map (oldest first, which is the eviction order)
and a heap of expiry times, so that records with different TTLs still leave the tenant's
byte count the moment they expire, whatever their place in the map. It is the same model
as ``redis_store``'s index (an age order and an expiry order), step for step: sweep the
expired, replace a record stored again, evict the oldest until the new one fits, add it.

Expiry is checked on every read; a put sweeps every tenant's expired records (the check
is one heap peek per tenant, and tenants come from the configuration, so there are few),
so an idle tenant's memory is given back too. Nothing here awaits, so on one event loop
each call is atomic without a lock.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from types import TracebackType

from conversations.store import check_put


@dataclass(slots=True)
class _Record:
    data: bytes
    expires_at: float
    # Which put made it: an expiry entry of an earlier record under the same id is stale.
    seq: int


@dataclass(slots=True)
class _Tenant:
    # Insertion order is age: the first record is the oldest, the first to be evicted.
    records: dict[str, _Record] = field(default_factory=dict)
    # (expires_at, seq, response id); entries of removed or replaced records are skipped.
    expiries: list[tuple[float, int, str]] = field(default_factory=list)
    bytes: int = 0

    def remove(self, response_id: str) -> _Record | None:
        record = self.records.pop(response_id, None)
        if record is not None:
            self.bytes -= len(record.data)
        return record

    def sweep(self, now: float) -> None:
        while self.expiries and self.expiries[0][0] <= now:
            _, seq, response_id = heapq.heappop(self.expiries)
            record = self.records.get(response_id)
            if record is not None and record.seq == seq:
                self.remove(response_id)
        if len(self.expiries) > 2 * len(self.records) + _HEAP_SLACK:
            # Evictions and deletes leave stale entries behind: rebuild rather than grow.
            self.expiries = [(r.expires_at, r.seq, rid) for rid, r in self.records.items()]
            heapq.heapify(self.expiries)


# Stale heap entries tolerated beyond twice the live records before the heap is rebuilt.
_HEAP_SLACK = 16


class MemoryResponseStore:
    """Per-tenant ordered maps of ``response id -> record``, on an injected clock."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._tenants: dict[str, _Tenant] = {}
        self._seq = itertools.count()
        self._closed = False

    def _check(self) -> None:
        if self._closed:
            raise RuntimeError("MemoryResponseStore is closed")

    def used_bytes(self, tenant: str) -> int:
        """The sizes of the tenant's records summed (expired ones until swept or read)."""
        state = self._tenants.get(tenant)
        return state.bytes if state is not None else 0

    def count(self, tenant: str) -> int:
        """The tenant's records held (expired ones until swept or read)."""
        state = self._tenants.get(tenant)
        return len(state.records) if state is not None else 0

    async def put(self, tenant: str, response_id: str, record: bytes, ttl_s: float, max_tenant_bytes: int) -> None:
        self.put_now(tenant, response_id, record, ttl_s, max_tenant_bytes)

    def put_now(self, tenant: str, response_id: str, record: bytes, ttl_s: float, max_tenant_bytes: int) -> None:
        """``put`` without the event loop (tests)."""
        self._check()
        check_put(record, ttl_s, max_tenant_bytes)
        now = self._clock()
        for name, other in list(self._tenants.items()):
            other.sweep(now)
            if not other.records and name != tenant:
                del self._tenants[name]
        state = self._tenants.setdefault(tenant, _Tenant())
        state.remove(response_id)  # stored again: the old one goes, the new one is the newest
        while state.bytes + len(record) > max_tenant_bytes:
            state.remove(next(iter(state.records)))  # the oldest; never empty here (check_put)
        seq = next(self._seq)
        state.records[response_id] = _Record(record, now + ttl_s, seq)
        state.bytes += len(record)
        heapq.heappush(state.expiries, (now + ttl_s, seq, response_id))

    async def get(self, tenant: str, response_id: str) -> bytes | None:
        return self.get_now(tenant, response_id)

    def get_now(self, tenant: str, response_id: str) -> bytes | None:
        """``get`` without the event loop (tests)."""
        self._check()
        state = self._tenants.get(tenant)
        record = state.records.get(response_id) if state is not None else None
        if state is None or record is None:
            return None
        if self._clock() >= record.expires_at:
            self._forget(tenant, state, response_id)
            return None
        return record.data

    async def delete(self, tenant: str, response_id: str) -> bool:
        return self.delete_now(tenant, response_id)

    def delete_now(self, tenant: str, response_id: str) -> bool:
        """``delete`` without the event loop (tests)."""
        self._check()
        state = self._tenants.get(tenant)
        if state is None or response_id not in state.records:
            return False
        record = self._forget(tenant, state, response_id)
        return record is not None and self._clock() < record.expires_at

    def _forget(self, tenant: str, state: _Tenant, response_id: str) -> _Record | None:
        record = state.remove(response_id)
        if not state.records:
            del self._tenants[tenant]
        return record

    async def close(self) -> None:
        self._closed = True
        self._tenants.clear()

    async def __aenter__(self) -> MemoryResponseStore:
        self._check()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()
