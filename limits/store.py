"""The interface both limit stores implement, and the one error they raise.

A store keeps buckets, concurrency counters, quota counters and leases per tenant, and
applies an ``AdmissionPlan`` atomically: every check passes and every change is made, or
nothing changes. ``MemoryStore`` does it in one process; ``RedisStore`` does it in one Lua
script per call, so every gateway process sharing the Redis sees one consistent state.
"""

from __future__ import annotations

from typing import Protocol

from limits.decision import Lease, Outcome
from limits.plan import AdmissionPlan


class StoreUnavailableError(Exception):
    """The store could not answer in time (connection refused, timeout, server error).

    The limiter catches it, counts it towards the circuit breaker, and applies the
    tenant's ``on_store_failure`` policy; it never reaches the gateway.
    """


class LimitStore(Protocol):
    """Where limit state lives."""

    async def admit(self, plan: AdmissionPlan, lease_id: str, lease_ttl_s: float) -> Outcome:
        """Check every limit in ``plan``; if all pass, charge them and record the lease."""
        ...

    async def settle(self, lease: Lease, used_tokens: int | None) -> None:
        """Free the lease's slots and true its reservation up to ``used_tokens``.

        ``None`` releases the reservation without charging any tokens (the request failed
        or was cancelled before usage was known). Settling an unknown or expired lease
        still charges ``used_tokens`` to the quotas and token buckets.
        """
        ...

    async def renew(self, lease: Lease, lease_ttl_s: float) -> bool:
        """Push the lease's expiry to ``lease_ttl_s`` from now; False if it already expired."""
        ...

    async def close(self) -> None:
        """Release connections; the store refuses use afterwards."""
        ...
