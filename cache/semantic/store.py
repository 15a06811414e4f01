"""Where the semantic cache's entries are kept for every process: the interface, and memory.

The answers themselves stay in the exact cache's store, under their exact keys; a semantic
entry is the question (scope, text, vector) and the key of its answer. A store bounds each
tenant on its own (``max_entries``; the oldest-used entries go first) and expires entries
``ttl_s`` after they were stored, like the exact cache.

``MemorySemanticStore`` is the embedded default (no ``redis_url``): it only keeps the
bounds, since this process's ``SemanticIndex`` is the one copy of the entries.
``RedisSemanticStore`` (``cache.semantic.redis_store``) shares them between processes.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from cache.keys import split_key
from cache.semantic.index import SemanticEntry


@dataclass(frozen=True, slots=True)
class PutResult:
    """What storing an entry did.

    ``expires_at`` is wall-clock seconds by the store's clock. ``seq`` is the entry's place
    in the shared event stream (None for memory), so a process that already applied the
    events after it does not re-add an entry another process removed since. ``evicted``
    lists ids removed to respect the tenant's bound; ``evicted_live`` counts those that had
    not expired yet (the eviction metric).
    """

    expires_at: float
    seq: int | None
    evicted: tuple[str, ...] = ()
    evicted_live: int = 0


class SemanticStore(Protocol):
    """The shared side of the semantic cache; the local side is a ``SemanticIndex``."""

    @property
    def available(self) -> bool:
        """False while calls would fail at once (Redis breaker open): skip the work before them."""
        ...

    async def put(self, entry: SemanticEntry, *, ttl_s: float, max_entries: int) -> PutResult:
        """Keep ``entry`` (its ``expires_at`` is ignored: the store sets it)."""
        ...

    async def delete(self, entry: SemanticEntry) -> None:
        """Drop ``entry`` everywhere (its answer is gone)."""
        ...

    async def touch(self, entry: SemanticEntry) -> None:
        """Mark ``entry`` recently used (it answered a request)."""
        ...

    async def close(self) -> None: ...


class MemorySemanticStore:
    """Per-tenant LRU order and expiry of this process's semantic entries."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self._tenants: dict[str, OrderedDict[str, float]] = {}
        self._closed = False

    @property
    def available(self) -> bool:
        return not self._closed

    def __len__(self) -> int:
        return sum(len(ids) for ids in self._tenants.values())

    async def put(self, entry: SemanticEntry, *, ttl_s: float, max_entries: int) -> PutResult:
        return self.put_now(entry, ttl_s=ttl_s, max_entries=max_entries)

    def put_now(self, entry: SemanticEntry, *, ttl_s: float, max_entries: int) -> PutResult:
        """``put`` without the event loop."""
        self._check()
        ids = self._tenants.setdefault(_tenant(entry), OrderedDict())
        now = self._clock()
        ids[entry.id] = now + ttl_s
        ids.move_to_end(entry.id)
        evicted: list[str] = []
        live = 0
        while len(ids) > max_entries:
            gone, expires_at = ids.popitem(last=False)
            evicted.append(gone)
            live += expires_at > now
        return PutResult(now + ttl_s, None, tuple(evicted), live)

    async def delete(self, entry: SemanticEntry) -> None:
        self._check()
        ids = self._tenants.get(_tenant(entry))
        if ids is not None:
            ids.pop(entry.id, None)

    async def touch(self, entry: SemanticEntry) -> None:
        self._check()
        ids = self._tenants.get(_tenant(entry))
        if ids is not None and entry.id in ids:
            ids.move_to_end(entry.id)

    async def close(self) -> None:
        self._closed = True
        self._tenants.clear()

    def _check(self) -> None:
        if self._closed:
            raise RuntimeError("MemorySemanticStore is closed")


def _tenant(entry: SemanticEntry) -> str:
    return split_key(entry.scope)[0]
