"""The interface both response stores implement, and the errors they raise.

A store keeps opaque records (bytes the caller made) under ``(tenant, response id)`` for a
TTL, and bounds each tenant by the total size of its live records: storing past the bound
evicts that tenant's oldest records, never another tenant's. A record is only ever found
under the tenant that stored it: asking for another tenant's id looks exactly like asking
for an unknown, expired or evicted one (``None``), so ids leak nothing across tenants.

``MemoryResponseStore`` keeps records in this process; ``RedisResponseStore`` shares them
between gateway pods and survives a gateway restart.
"""

from __future__ import annotations

from types import TracebackType
from typing import Protocol, Self


class StoreUnavailableError(Exception):
    """The store could not answer in time (connection refused, timeout, server error, breaker open).

    ``reason`` is ``timeout``, ``circuit_open`` or ``error``. Unlike the response cache, a
    stored response cannot be skipped: the caller turns this into a 503.
    """

    def __init__(self, message: str, *, reason: str = "error") -> None:
        super().__init__(message)
        self.reason = reason


class RecordTooLarge(ValueError):
    """One record is larger than the tenant's whole bound, so no eviction could make room."""

    def __init__(self, size: int, bound: int) -> None:
        super().__init__(f"record of {size} bytes exceeds the tenant's bound of {bound} bytes")
        self.size = size
        self.bound = bound


class ResponseStore(Protocol):
    """Where stored responses live."""

    async def put(self, tenant: str, response_id: str, record: bytes, ttl_s: float, max_tenant_bytes: int) -> None:
        """Keep ``record`` for ``ttl_s``, counted against the tenant's ``max_tenant_bytes``.

        The tenant's oldest records are evicted until it fits; a record stored again under
        its id replaces the old one (and becomes the newest). Raises ``RecordTooLarge`` when
        ``record`` alone exceeds ``max_tenant_bytes`` (nothing is changed then).
        """
        ...

    async def get(self, tenant: str, response_id: str) -> bytes | None:
        """The record, or None (unknown, expired, evicted or another tenant's: the same answer)."""
        ...

    async def delete(self, tenant: str, response_id: str) -> bool:
        """Forget the record; True if a live one was there."""
        ...

    async def close(self) -> None:
        """Release connections; the store refuses use afterwards."""
        ...

    async def __aenter__(self) -> Self: ...

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None: ...


def check_put(record: bytes, ttl_s: float, max_tenant_bytes: int) -> None:
    """The arguments every store refuses alike, before it changes anything."""
    if ttl_s <= 0:
        raise ValueError(f"ttl_s must be positive, not {ttl_s}")
    if max_tenant_bytes <= 0:
        raise ValueError(f"max_tenant_bytes must be positive, not {max_tenant_bytes}")
    if len(record) > max_tenant_bytes:
        raise RecordTooLarge(len(record), max_tenant_bytes)
