"""Limit state in this process's memory: the embedded default, and the fail_open fallback.

It runs the same algorithm as ``limits/lua/admit.lua`` and ``settle.lua``, step for step
and in the same order (reclaim expired leases, roll quota windows, check caps, quotas,
buckets, then commit), so a test can drive both stores with one clock and compare every
decision. Nothing here awaits between reading and writing state, so on one event loop each
call is atomic without a lock.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from limits import gcra
from limits.decision import Lease, Outcome, RateView
from limits.gcra import BucketState, Verdict
from limits.plan import AdmissionPlan, BucketKind, BucketSpec
from limits.windows import day_window, month_window

# A settled lease id is remembered this long, so that a settle (or admit) retried after a
# lost reply is recognised and not applied twice. The Redis scripts keep the same tombstone.
SETTLED_TOMBSTONE_S = 10.0


@dataclass(slots=True)
class _LeaseRecord:
    expires: float
    reserve: int
    day: int | None
    month: int | None
    caps: tuple[str, ...]


@dataclass(slots=True)
class _Tenant:
    buckets: dict[str, BucketState] = field(default_factory=dict)
    counters: dict[str, int] = field(default_factory=dict)
    leases: dict[str, _LeaseRecord] = field(default_factory=dict)
    # Settled lease id -> when its tombstone may go.
    settled: dict[str, float] = field(default_factory=dict)
    # (expiry, lease id) of leases and tombstones; stale entries are skipped on pop.
    expiries: list[tuple[float, str]] = field(default_factory=list)
    day: int = -1
    day_used: int = 0
    day_reserved: int = 0
    month: int = -1
    month_used: int = 0
    month_reserved: int = 0

    def roll(self, now: float) -> None:
        day, month = day_window(now).index, month_window(now).index
        if self.day != day:
            self.day, self.day_used, self.day_reserved = day, 0, 0
        if self.month != month:
            self.month, self.month_used, self.month_reserved = month, 0, 0

    def release(self, record: _LeaseRecord) -> None:
        for cap in record.caps:
            count = self.counters.get(cap, 0) - 1
            if count > 0:
                self.counters[cap] = count
            else:
                self.counters.pop(cap, None)
        if record.day is not None and record.day == self.day:
            self.day_reserved = max(self.day_reserved - record.reserve, 0)
        if record.month is not None and record.month == self.month:
            self.month_reserved = max(self.month_reserved - record.reserve, 0)

    def reclaim(self, now: float) -> None:
        while self.expiries and self.expiries[0][0] <= now:
            _, lease_id = heapq.heappop(self.expiries)
            record = self.leases.get(lease_id)
            if record is None:
                tomb = self.settled.get(lease_id)
                if tomb is not None and tomb <= now:
                    del self.settled[lease_id]
                continue
            if record.expires > now:  # renewed since this entry was pushed
                heapq.heappush(self.expiries, (record.expires, lease_id))
                continue
            del self.leases[lease_id]
            self.release(record)


def _views(plan: AdmissionPlan, verdicts: list[Verdict]) -> tuple[RateView | None, RateView | None]:
    """The header figures: the most constraining bucket of each kind (first one on a tie)."""
    best: dict[BucketKind, tuple[BucketSpec, Verdict]] = {}
    for spec, verdict in zip(plan.buckets, verdicts, strict=True):
        seen = best.get(spec.kind)
        if seen is None or verdict.remaining < seen[1].remaining:
            best[spec.kind] = (spec, verdict)
    requests, tokens = best.get("requests"), best.get("tokens")
    return (
        RateView(requests[0].field, requests[1].remaining, requests[1].reset_after) if requests else None,
        RateView(tokens[0].field, tokens[1].remaining, tokens[1].reset_after) if tokens else None,
    )


# What a fallback bucket holds when it starts: one second of its rate, not its burst.
START_LOW_S = 1.0


class MemoryStore:
    """Buckets, counters, quotas and leases in dicts; exact within one process."""

    def __init__(self, clock: Callable[[], float] = time.time, *, start_low: bool = False) -> None:
        # Wall-clock seconds: quota windows are calendar days, so a monotonic clock won't do.
        self._clock = clock
        self._tenants: dict[str, _Tenant] = {}
        self._closed = False
        # A bucket this store has no state for starts holding only START_LOW_S seconds of
        # rate instead of its whole burst.
        self._start_low = start_low

    def _bucket(self, t: _Tenant, field: str, rate: gcra.Rate, now: float) -> gcra.BucketState:
        state = t.buckets.get(field)
        if state is None:
            if self._start_low:
                return gcra.BucketState(max(rate.tolerance - START_LOW_S, 0.0), now)
            return gcra.FULL
        return state

    def forget_buckets(self) -> None:
        """Drop every bucket's state (leases, caps and quotas stay)."""
        for t in self._tenants.values():
            t.buckets.clear()

    def _tenant(self, tenant: str) -> _Tenant:
        if self._closed:
            raise RuntimeError("MemoryStore is closed")
        state = self._tenants.get(tenant)
        if state is None:
            state = self._tenants[tenant] = _Tenant()
        return state

    async def admit(self, plan: AdmissionPlan, lease_id: str, lease_ttl_s: float) -> Outcome:
        return self.admit_now(plan, lease_id, lease_ttl_s)

    def admit_now(self, plan: AdmissionPlan, lease_id: str, lease_ttl_s: float) -> Outcome:
        """The synchronous body of ``admit`` (the fallback path calls it directly)."""
        now = self._clock()
        t = self._tenant(plan.tenant)
        if lease_id in t.leases or lease_id in t.settled:
            # Admitted already (a retry): a second slot would never be given back.
            return Outcome(True, "", 0.0, None, None, now)
        t.reclaim(now)
        quotas = plan.tokens_per_day is not None or plan.tokens_per_month is not None
        if quotas:
            t.roll(now)
        verdicts = [gcra.check(self._bucket(t, b.field, b.rate, now), plan.cost(b), now, b.rate) for b in plan.buckets]
        requests, tokens = _views(plan, verdicts)
        failed, retry = self._first_failure(plan, t, verdicts, now)
        if failed:
            return Outcome(False, failed, retry, requests, tokens, now)
        for spec, verdict in zip(plan.buckets, verdicts, strict=True):
            t.buckets[spec.field] = verdict.state
        for cap in plan.caps:
            t.counters[cap.field] = t.counters.get(cap.field, 0) + 1
        if plan.tokens_per_day is not None:
            t.day_reserved += plan.reserve
        if plan.tokens_per_month is not None:
            t.month_reserved += plan.reserve
        if not plan.holds_lease:
            # Nothing for an expiry to give back: no record (as admit.lua).
            return Outcome(True, "", 0.0, requests, tokens, now)
        expires = now + lease_ttl_s
        t.leases[lease_id] = _LeaseRecord(
            expires=expires,
            reserve=plan.reserve,
            day=t.day if plan.tokens_per_day is not None else None,
            month=t.month if plan.tokens_per_month is not None else None,
            caps=tuple(c.field for c in plan.caps),
        )
        heapq.heappush(t.expiries, (expires, lease_id))
        return Outcome(True, "", 0.0, requests, tokens, now)

    @staticmethod
    def _first_failure(plan: AdmissionPlan, t: _Tenant, verdicts: list[Verdict], now: float) -> tuple[str, float]:
        # Order matters only for which reason is reported: caps, then quotas, then rates.
        for cap in plan.caps:
            if t.counters.get(cap.field, 0) >= cap.cap:
                return cap.field, 0.0
        if plan.tokens_per_day is not None and (t.day_used + t.day_reserved + plan.reserve > plan.tokens_per_day):
            return "q|d", day_window(now).resets_at - now
        if plan.tokens_per_month is not None and (
            t.month_used + t.month_reserved + plan.reserve > plan.tokens_per_month
        ):
            return "q|m", month_window(now).resets_at - now
        failed, retry = "", 0.0
        for spec, verdict in zip(plan.buckets, verdicts, strict=True):
            if verdict.allowed:
                continue
            if verdict.retry_after < 0:  # can never fit: report that over any wait
                return spec.field, -1.0
            if not failed or verdict.retry_after > retry:
                failed, retry = spec.field, verdict.retry_after
        return failed, retry

    async def settle(self, lease: Lease, used_tokens: int | None) -> None:
        self.settle_now(lease, used_tokens)

    def settle_now(self, lease: Lease, used_tokens: int | None) -> None:
        now = self._clock()
        t = self._tenant(lease.tenant)
        if lease.id in t.settled:
            return  # settled before: a retry
        if lease.day_quota or lease.month_quota:
            t.roll(now)
        record = t.leases.pop(lease.id, None)
        if record is not None:
            t.release(record)
        t.settled[lease.id] = now + SETTLED_TOMBSTONE_S
        heapq.heappush(t.expiries, (now + SETTLED_TOMBSTONE_S, lease.id))
        used = max(used_tokens, 0) if used_tokens is not None else 0
        if lease.day_quota:
            t.day_used += used
        if lease.month_quota:
            t.month_used += used
        delta = used - lease.reserve
        if delta != 0:
            for spec in lease.token_buckets:
                state = self._bucket(t, spec.field, spec.rate, now)
                t.buckets[spec.field] = gcra.adjust(state, delta, now, spec.rate)

    async def renew(self, lease: Lease, lease_ttl_s: float) -> bool:
        now = self._clock()
        t = self._tenant(lease.tenant)
        record = t.leases.get(lease.id)
        if record is None or record.expires <= now:
            return False
        record.expires = now + lease_ttl_s
        heapq.heappush(t.expiries, (record.expires, lease.id))
        return True

    async def close(self) -> None:
        self._closed = True

    def quota_usage(self, tenant: str) -> tuple[int, int, int, int]:
        """(day used, day reserved, month used, month reserved), for tests and the admin API."""
        t = self._tenants.get(tenant)
        if t is None:
            return (0, 0, 0, 0)
        return (t.day_used, t.day_reserved, t.month_used, t.month_reserved)
