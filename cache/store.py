"""The interface both response-cache stores implement, and the one error they raise.

A store maps a key made by ``cache.keys.exact_key`` (``<scope>:<digest>``) to the bytes of
a ``CachedCompletion``. Each scope (tenant) is bounded on its own: storing past
``max_entries`` evicts that tenant's least recently used entries, never another tenant's.
``MemoryStore`` keeps entries in this process; ``RedisStore`` shares them between gateway
processes and survives a gateway restart.
"""

from __future__ import annotations

from typing import Protocol


class CacheUnavailable(Exception):
    """The store could not answer in time (connection refused, timeout, breaker open).

    ``ResponseCache`` catches it, counts it, and lets the request go on uncached; it never
    reaches a client. ``reason`` is ``timeout``, ``circuit_open`` or ``error``.
    """

    def __init__(self, message: str, *, reason: str = "error") -> None:
        super().__init__(message)
        self.reason = reason


class CacheStore(Protocol):
    """Where cached answers live."""

    async def get(self, key: str) -> bytes | None:
        """The value under ``key`` (and mark it recently used), or None."""
        ...

    async def set(self, key: str, value: bytes, *, ttl_s: float, max_entries: int) -> int:
        """Keep ``value`` for ``ttl_s``; returns how many of the scope's entries were evicted."""
        ...

    async def close(self) -> None:
        """Release connections; the store refuses use afterwards."""
        ...
