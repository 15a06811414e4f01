"""The response cache in this process's memory: per-tenant LRU with a TTL.

The embedded default when no ``redis_url`` is set. Each scope has its own ordered map, so
one tenant filling its bound evicts only its own entries. Expired entries are dropped when
read or when they reach the least-recently-used end; there is no background sweeper, since
every scope is bounded by ``max_entries`` anyway, expired or not. Trimming costs one pop per
entry removed, never a scan.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable

from cache.keys import split_key


class MemoryStore:
    """Per-scope LRU maps of ``key -> (expires_at, value)``, on an injected clock."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._scopes: dict[str, OrderedDict[str, tuple[float, bytes]]] = {}
        self._closed = False
        # Entries removed to respect a size bound (expiry is not eviction).
        self.evictions = 0

    def __len__(self) -> int:
        return sum(len(entries) for entries in self._scopes.values())

    def count(self, scope: str) -> int:
        """Entries held for one (escaped) scope, expired ones included until touched."""
        entries = self._scopes.get(scope)
        return len(entries) if entries is not None else 0

    def _check(self) -> None:
        if self._closed:
            raise RuntimeError("MemoryStore is closed")

    async def get(self, key: str) -> bytes | None:
        return self.get_now(key)

    def get_now(self, key: str) -> bytes | None:
        """``get`` without the event loop (tests, benchmarks)."""
        self._check()
        scope, _ = split_key(key)
        entries = self._scopes.get(scope)
        if entries is None:
            return None
        item = entries.get(key)
        if item is None:
            return None
        expires_at, value = item
        if self._clock() >= expires_at:
            del entries[key]
            return None
        entries.move_to_end(key)
        return value

    async def set(self, key: str, value: bytes, *, ttl_s: float, max_entries: int) -> int:
        return self.set_now(key, value, ttl_s=ttl_s, max_entries=max_entries)

    def set_now(self, key: str, value: bytes, *, ttl_s: float, max_entries: int) -> int:
        """``set`` without the event loop (tests, benchmarks)."""
        self._check()
        scope, _ = split_key(key)
        entries = self._scopes.setdefault(scope, OrderedDict())
        now = self._clock()
        entries[key] = (now + ttl_s, value)
        entries.move_to_end(key)
        evicted = 0
        while len(entries) > max_entries:
            # Least recently used first; one that had already expired is not an eviction.
            _, (expires_at, _) = entries.popitem(last=False)
            if expires_at > now:
                evicted += 1
        self.evictions += evicted
        return evicted

    async def close(self) -> None:
        self._closed = True
        self._scopes.clear()
