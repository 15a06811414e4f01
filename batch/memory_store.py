"""Batches in this process's memory (the embedded default: one gateway process)."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from batch.model import TERMINAL, BatchRecord, Counts, Progress
from batch.store import Claim
from batch.usage import ZERO, Usage


@dataclass
class _Queue:
    total: int
    next: int = 0
    open: bool = True
    retry: deque[int] = field(default_factory=deque)
    results: dict[int, tuple[bool, bytes]] = field(default_factory=dict)
    completed: int = 0
    failed: int = 0
    leased: int = 0
    usage: Usage = ZERO


class MemoryBatchStore:
    """``BatchStore`` over dicts; leases expire by the clock given (time passes in)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._records: dict[str, BatchRecord] = {}
        self._queues: dict[str, _Queue] = {}
        # member -> (token, expiry)
        self._leases: dict[str, tuple[str, float]] = {}
        self._locks: dict[str, tuple[str, float]] = {}

    async def __aenter__(self) -> MemoryBatchStore:
        return self

    async def __aexit__(self, *exc: object) -> None:
        return None

    async def create(self, record: BatchRecord) -> None:
        self._records[record.id] = record
        if record.status not in TERMINAL:
            self._queues[record.id] = _Queue(record.counts.total)

    async def get(self, tenant: str, batch_id: str) -> BatchRecord | None:
        record = self._records.get(batch_id)
        return record if record is not None and record.tenant == tenant else None

    async def get_any(self, batch_id: str) -> BatchRecord | None:
        return self._records.get(batch_id)

    async def listing(self, tenant: str, after: str | None, limit: int) -> tuple[list[BatchRecord], bool]:
        mine = sorted(
            (r for r in self._records.values() if r.tenant == tenant), key=lambda r: (r.created_at, r.id), reverse=True
        )
        if after is not None:
            ids = [r.id for r in mine]
            mine = mine[ids.index(after) + 1 :] if after in ids else []
        return mine[:limit], len(mine) > limit

    async def replace(self, record: BatchRecord, expect_status: str) -> bool:
        kept = self._records.get(record.id)
        if kept is None or kept.status != expect_status:
            return False
        self._records[record.id] = record
        return True

    async def close(self, batch_id: str) -> None:
        queue = self._queues.get(batch_id)
        if queue is not None:
            queue.open = False

    async def active(self) -> list[str]:
        return list(self._queues)

    async def claim(self, token: str, lease_s: float) -> Claim | None:
        for batch_id, queue in self._queues.items():
            if not queue.open:
                continue
            index = None
            while queue.retry:
                candidate = queue.retry.popleft()
                if candidate not in queue.results:
                    index = candidate
                    break
            if index is None and queue.next < queue.total:
                index = queue.next
                queue.next += 1
            if index is not None:
                claim = Claim(batch_id, index)
                self._leases[claim.member] = (token, self.clock() + lease_s)
                queue.leased += 1
                return claim
        return None

    async def renew(self, token: str, claims: list[Claim], lease_s: float) -> None:
        until = self.clock() + lease_s
        for claim in claims:
            held = self._leases.get(claim.member)
            if held is not None and held[0] == token:
                self._leases[claim.member] = (token, until)

    def _drop_lease(self, claim: Claim, token: str | None) -> bool:
        held = self._leases.get(claim.member)
        if held is None or (token is not None and held[0] != token):
            return False
        del self._leases[claim.member]
        queue = self._queues.get(claim.batch_id)
        if queue is not None:
            queue.leased -= 1
        return True

    async def release(self, token: str, claim: Claim) -> None:
        if self._drop_lease(claim, token):
            queue = self._queues.get(claim.batch_id)
            if queue is not None:
                queue.retry.append(claim.index)

    async def complete(self, token: str, claim: Claim, ok: bool, line: bytes, usage: Usage = ZERO) -> bool:
        # No await between the check and the counts: the result, its count and its usage
        # are written in one step of the event loop.
        queue = self._queues.get(claim.batch_id)
        written = False
        if queue is not None and claim.index not in queue.results:
            queue.results[claim.index] = (ok, line)
            if ok:
                queue.completed += 1
            else:
                queue.failed += 1
            queue.usage += usage
            written = True
        self._drop_lease(claim, token)
        return written

    async def reap(self) -> int:
        now = self.clock()
        expired = [member for member, (_, until) in self._leases.items() if until <= now]
        for member in expired:
            batch_id, _, index = member.rpartition("|")
            claim = Claim(batch_id, int(index))
            self._drop_lease(claim, None)
            queue = self._queues.get(batch_id)
            if queue is not None and claim.index not in queue.results:
                queue.retry.append(claim.index)
        return len(expired)

    async def progress(self, batch_id: str) -> Progress:
        queue = self._queues.get(batch_id)
        if queue is None:
            record = self._records.get(batch_id)
            if record is None:
                return Progress(Counts())
            return Progress(record.counts, 0, record.usage or ZERO)
        return Progress(Counts(queue.total, queue.completed, queue.failed), queue.leased, queue.usage)

    async def results(self, batch_id: str) -> tuple[dict[int, tuple[bool, bytes]], Usage]:
        queue = self._queues.get(batch_id)
        return (dict(queue.results), queue.usage) if queue is not None else ({}, ZERO)

    async def lock(self, batch_id: str, token: str, ttl_s: float) -> bool:
        now = self.clock()
        held = self._locks.get(batch_id)
        if held is not None and held[0] != token and held[1] > now:
            return False
        self._locks[batch_id] = (token, now + ttl_s)
        return True

    async def forget(self, batch_id: str) -> None:
        self._queues.pop(batch_id, None)
        self._locks.pop(batch_id, None)

    async def queue_depth(self) -> int:
        return sum(q.total - q.next + len(q.retry) for q in self._queues.values() if q.open)
