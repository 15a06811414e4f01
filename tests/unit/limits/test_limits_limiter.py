"""The limiter facade: fail policies, breaker, recovery, idempotent settle, metrics."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client import CollectorRegistry

from common.breaker import BreakerConfig
from limits.config import TenantLimits
from limits.decision import Lease, Outcome, Reason
from limits.limiter import Limiter, LimiterOptions
from limits.memory_store import MemoryStore
from limits.metrics import LimitsMetrics
from limits.plan import AdmissionPlan, Subject
from limits.store import StoreUnavailableError

T0 = 1_741_996_800.0


class Clock:
    def __init__(self, now: float = T0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


class FlakyStore:
    """A shared store stand-in: a memory store that can be switched off or made to hang."""

    def __init__(self, clock: Clock) -> None:
        self.inner = MemoryStore(clock)
        self.down = False
        self.hang: asyncio.Event | None = None
        self.calls = 0
        self.renews = 0
        self.peers = 1

    async def _gate(self) -> None:
        self.calls += 1
        if self.hang is not None:
            await self.hang.wait()
        if self.down:
            raise StoreUnavailableError("connection refused")

    async def admit(self, plan: AdmissionPlan, lease_id: str, lease_ttl_s: float) -> Outcome:
        await self._gate()
        return await self.inner.admit(plan, lease_id, lease_ttl_s)

    async def settle(self, lease: Lease, used_tokens: int | None) -> None:
        await self._gate()
        await self.inner.settle(lease, used_tokens)

    async def renew(self, lease: Lease, lease_ttl_s: float) -> bool:
        await self._gate()
        self.renews += 1
        return await self.inner.renew(lease, lease_ttl_s)

    async def heartbeat(self, instance_id: str, ttl_s: float) -> int:
        await self._gate()
        return self.peers

    async def close(self) -> None:
        await self.inner.close()


def make(store: object, clock: Clock, **kw: object) -> tuple[Limiter, LimitsMetrics]:
    metrics = LimitsMetrics(CollectorRegistry())
    options = LimiterOptions(background=False, breaker=BreakerConfig(failures=2, cooldown_s=5.0, trial_timeout_s=5.0))
    limiter = Limiter(
        store,  # type: ignore[arg-type]
        options=options,
        clock=clock,
        metrics=metrics,
        fallback=MemoryStore(clock),
        **kw,  # type: ignore[arg-type]
    )
    return limiter, metrics


def value(metrics: LimitsMetrics, name: str, **labels: str) -> float:
    return metrics.sample(name, **labels)


OPEN = TenantLimits(requests_per_minute=10, tokens_per_minute=10_000, max_concurrent=100)
CLOSED = OPEN.model_copy(update={"on_store_failure": "fail_closed"})


async def test_memory_admit_settle_and_metrics() -> None:
    clock = Clock()
    limiter, metrics = make(MemoryStore(clock), clock)
    d = await limiter.admit(Subject("acme"), OPEN, 300)
    assert d.allowed and d.lease is not None and d.lease.origin == "store"
    assert d.headers()["x-ratelimit-remaining-tokens"] == "9700"
    await limiter.settle(d.lease, 120)
    await limiter.settle(d.lease, 120)  # idempotent: counted once
    assert value(metrics, "fleetgate_limits_admissions_total", tenant="acme", store="store") == 1
    assert value(metrics, "fleetgate_limits_tokens_reserved_total", tenant="acme") == 300
    assert value(metrics, "fleetgate_limits_tokens_settled_total", tenant="acme") == 120
    nxt = await limiter.admit(Subject("acme"), OPEN, 0)
    assert nxt.tokens is not None and nxt.tokens.remaining == 10_000 - 120
    await limiter.close()
    with pytest.raises(RuntimeError):
        await limiter.admit(Subject("acme"), OPEN, 1)


async def test_unlimited_tenant_touches_no_store() -> None:
    clock = Clock()
    store = FlakyStore(clock)
    limiter, _ = make(store, clock)
    for limits in (None, TenantLimits()):
        d = await limiter.admit(Subject("free"), limits, 100)
        assert d.allowed and d.lease is not None and d.lease.origin == "none"
        await limiter.settle(d.lease, 5)
    assert store.calls == 0


async def test_fail_open_falls_back_to_a_share_of_the_limits() -> None:
    clock = Clock()
    store = FlakyStore(clock)
    limiter, metrics = make(store, clock, live_replicas=lambda: 2)
    store.down = True
    decisions = [await limiter.admit(Subject("acme"), OPEN, 10) for _ in range(7)]
    # 10 rpm split over 2 live gateways: this one admits 5, then rejects.
    assert [d.allowed for d in decisions] == [True] * 5 + [False] * 2
    assert all(d.degraded for d in decisions)
    assert decisions[5].reason is Reason.REQUESTS_PER_MINUTE
    assert decisions[0].headers()["x-ratelimit-limit-requests"] == "5"
    # Two failures opened the breaker: the rest never waited on the store.
    assert store.calls == 2 and limiter.degraded
    assert value(metrics, "fleetgate_limits_fallback_active") == 1
    assert value(metrics, "fleetgate_limits_store_failures_total", op="admit") == 2
    fallback = value(metrics, "fleetgate_limits_fallback_decisions_total", tenant="acme", policy="fail_open")
    assert fallback == 7
    # Fallback leases settle locally, without touching the store.
    lease = decisions[0].lease
    assert lease is not None and lease.origin == "fallback"
    await limiter.settle(lease, 3)
    assert store.calls == 2


async def test_fail_closed_rejects_with_503() -> None:
    clock = Clock()
    store = FlakyStore(clock)
    limiter, metrics = make(store, clock)
    store.down = True
    d = await limiter.admit(Subject("bank"), CLOSED, 10)
    assert not d.allowed and d.reason is Reason.STORE_UNAVAILABLE and d.status == 503
    rejected = value(metrics, "fleetgate_limits_rejections_total", tenant="bank", reason="store_unavailable")
    assert rejected == 1


async def test_recovers_after_the_cooldown() -> None:
    clock = Clock()
    store = FlakyStore(clock)
    limiter, metrics = make(store, clock)
    held = await limiter.admit(Subject("acme"), OPEN, 10)  # a lease in the store
    store.down = True
    await limiter.admit(Subject("acme"), OPEN, 10)
    await limiter.admit(Subject("acme"), OPEN, 10)
    assert limiter.degraded
    # Settling a store lease while the breaker is open: skipped, never raises.
    assert held.lease is not None
    await limiter.settle(held.lease, 10)
    store.down = False
    clock.now += 4.9
    assert (await limiter.admit(Subject("acme"), OPEN, 10)).degraded  # still cooling down
    clock.now += 0.1
    probe = await limiter.admit(Subject("acme"), OPEN, 10)
    assert probe.allowed and not probe.degraded and probe.lease is not None
    assert probe.lease.origin == "store"
    assert not limiter.degraded
    assert value(metrics, "fleetgate_limits_fallback_active") == 0


async def test_cancelled_probe_does_not_wedge_the_breaker() -> None:
    clock = Clock()
    store = FlakyStore(clock)
    limiter, _ = make(store, clock)
    store.down = True
    await limiter.admit(Subject("acme"), OPEN, 10)
    await limiter.admit(Subject("acme"), OPEN, 10)
    clock.now += 5
    store.down, store.hang = False, asyncio.Event()
    probe = asyncio.create_task(limiter.admit(Subject("acme"), OPEN, 10))
    await asyncio.sleep(0)  # the probe is now waiting inside the store
    probe.cancel()
    with pytest.raises(asyncio.CancelledError):
        await probe
    store.hang = None
    d = await limiter.admit(Subject("acme"), OPEN, 10)  # the next call probes at once
    assert not d.degraded and not limiter.degraded


async def test_heartbeat_learns_the_number_of_gateways() -> None:
    clock = Clock()
    store = FlakyStore(clock)
    store.peers = 5
    limiter, _ = make(store, clock)
    assert await limiter.heartbeat() == 5
    store.down = True
    d = await limiter.admit(Subject("acme"), OPEN, 10)
    assert d.degraded and d.requests is not None and d.requests.limit == 2  # 10 // 5


async def test_renew_goes_to_the_lease_origin() -> None:
    clock = Clock()
    store = FlakyStore(clock)
    limiter, _ = make(store, clock)
    d = await limiter.admit(Subject("acme"), OPEN, 10)
    assert d.lease is not None and await limiter.renew(d.lease)
    store.down = True
    assert not await limiter.renew(d.lease)  # unreachable: reported, not raised
    await limiter.settle(d.lease, None)
    assert not await limiter.renew(d.lease)  # settled: nothing to renew


async def test_maintenance_renews_held_leases_and_drops_forgotten_ones() -> None:
    clock = Clock()
    store = FlakyStore(clock)
    store.peers = 3
    limiter, _ = make(store, clock)  # lease TTL 60 s: renewed every 20 s
    d = await limiter.admit(Subject("acme"), OPEN, 10)
    assert d.lease is not None and d.lease.held
    await limiter.maintain()
    clock.now += 19
    await limiter.maintain()
    assert store.renews == 0  # not due yet
    for _ in range(4):  # 80 s on: past the 60 s TTL, alive only by renewal
        clock.now += 20
        await limiter.maintain()
    assert store.renews == 4
    blocked = await limiter.admit(Subject("acme"), TenantLimits(max_concurrent=1), 0)
    assert blocked.reason is Reason.CONCURRENCY
    assert await limiter.heartbeat() == 3
    # An hour after admission the lease is presumed forgotten: no more renewals.
    clock.now += limiter.options.max_hold_s
    await limiter.maintain()
    assert not await limiter.renew(d.lease)
    clock.now += 60
    assert (await limiter.admit(Subject("acme"), TenantLimits(max_concurrent=1), 0)).allowed
