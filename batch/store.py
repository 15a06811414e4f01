"""Where batches and their work queue live: the ``BatchStore`` Protocol.

A batch's items are numbered 0..total-1 (the order of its input's lines). A pod takes an
item with ``claim``: the store hands out the next item of the oldest open batch (an item
given back first) under a lease that expires unless ``renew``\\ed. ``complete`` writes an
item's result once, and counts it and its tokens in the same step (a second write of the
same item is refused, so no item completes or counts twice), ``release`` hands an item
back untouched (admission said "later"), ``reap`` puts the items of expired leases (a pod
that died) back in their queue. Implementations: memory (one process) and Redis (every pod).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from batch.model import BatchRecord, Progress
from batch.usage import ZERO, Usage


class BatchStoreUnavailable(Exception):
    """The store could not answer (Redis down or slow)."""


@dataclass(frozen=True, slots=True)
class Claim:
    """An item this pod holds a lease on."""

    batch_id: str
    index: int

    @property
    def member(self) -> str:
        return f"{self.batch_id}|{self.index}"


class BatchStore(Protocol):
    async def __aenter__(self) -> BatchStore: ...

    async def __aexit__(self, *exc: object) -> None: ...

    async def create(self, record: BatchRecord) -> None:
        """Keep a new batch; an ``in_progress`` one opens its queue of ``counts.total`` items."""

    async def get(self, tenant: str, batch_id: str) -> BatchRecord | None: ...

    async def get_any(self, batch_id: str) -> BatchRecord | None:
        """A batch whatever its tenant (the runner's own bookkeeping, never a client's lookup)."""

    async def listing(self, tenant: str, after: str | None, limit: int) -> tuple[list[BatchRecord], bool]:
        """The tenant's batches, newest first, after the id ``after``; and whether more follow."""

    async def replace(self, record: BatchRecord, expect_status: str) -> bool:
        """Store ``record`` if the kept one's status is still ``expect_status`` (else False)."""

    async def close(self, batch_id: str) -> None:
        """No more claims of this batch's items."""

    async def active(self) -> list[str]:
        """Batches not yet ended."""

    async def claim(self, token: str, lease_s: float) -> Claim | None: ...

    async def renew(self, token: str, claims: list[Claim], lease_s: float) -> None: ...

    async def release(self, token: str, claim: Claim) -> None: ...

    async def complete(self, token: str, claim: Claim, ok: bool, line: bytes, usage: Usage = ZERO) -> bool:
        """Write the item's result unless it has one; count it and add ``usage`` to the
        batch's, in one atomic step. True if this call wrote it."""

    async def reap(self) -> int:
        """Requeue the items of expired leases; how many."""

    async def progress(self, batch_id: str) -> Progress:
        """The live counts (total, completed, failed), the items under lease, the usage so far."""

    async def results(self, batch_id: str) -> tuple[dict[int, tuple[bool, bytes]], Usage]:
        """Every result written (item -> 2xx or not, its output line) and the usage they
        added, read at one instant."""

    async def lock(self, batch_id: str, token: str, ttl_s: float) -> bool:
        """One pod finishes a batch (writes its files); the lock lapses if that pod dies."""

    async def forget(self, batch_id: str) -> None:
        """A finished batch's queue and results, dropped (its record stays)."""

    async def queue_depth(self) -> int:
        """Items of open batches not yet taken."""
