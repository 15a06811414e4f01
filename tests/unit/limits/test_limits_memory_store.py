"""The memory store with a hand-driven clock: every limit kind, leases and quotas."""

from __future__ import annotations

import math

from limits.config import ScopeLimits, TenantLimits
from limits.decision import Lease
from limits.memory_store import MemoryStore
from limits.plan import AdmissionPlan, Subject, build_plan

DAY = 86_400.0
T0 = 1_741_996_800.0  # 2025-03-15T00:00:00Z


class Clock:
    def __init__(self, now: float = T0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def lease_for(plan: AdmissionPlan, lease_id: str) -> Lease:
    return Lease.from_plan(lease_id, plan, "store")


def test_requests_per_minute_burst_and_refill() -> None:
    clock = Clock()
    store = MemoryStore(clock)
    plan = build_plan(Subject("a"), TenantLimits(requests_per_minute=60, request_burst=3), 0)
    assert [store.admit_now(plan, f"l{i}", 60).allowed for i in range(4)] == [1, 1, 1, 0]
    rejected = store.admit_now(plan, "l4", 60)
    assert rejected.failed == "t|rpm" and math.isclose(rejected.retry_after_s, 1.0)
    clock.now += 1.0  # one request per second
    assert store.admit_now(plan, "l5", 60).allowed
    assert not store.admit_now(plan, "l6", 60).allowed


def test_tokens_reserved_then_settled() -> None:
    clock = Clock()
    store = MemoryStore(clock)
    limits = TenantLimits(tokens_per_minute=6000)  # 100 tokens/s, burst 6000
    plan = build_plan(Subject("a"), limits, 4000)
    first = store.admit_now(plan, "a1", 60)
    assert first.allowed and first.tokens is not None and first.tokens.remaining == 2000
    assert store.admit_now(plan, "a2", 60).failed == "t|tpm"  # 4000 > 2000 left
    # The first request used only 1000 tokens: 3000 come back, 5000 free now.
    store.settle_now(lease_for(plan, "a1"), 1000)
    second = store.admit_now(plan, "a2", 60)
    assert second.allowed and second.tokens is not None and second.tokens.remaining == 1000
    # Released (errored): the whole reservation comes back.
    store.settle_now(lease_for(plan, "a2"), None)
    third = store.admit_now(plan, "a3", 60)
    assert third.tokens is not None and third.tokens.remaining == 1000


def test_usage_beyond_the_reservation_is_charged() -> None:
    clock = Clock()
    store = MemoryStore(clock)
    plan = build_plan(Subject("a"), TenantLimits(tokens_per_minute=6000), 1000)
    store.admit_now(plan, "a1", 60)
    store.settle_now(lease_for(plan, "a1"), 7000)  # 6000 more than reserved: empty + 1000
    small = build_plan(Subject("a"), TenantLimits(tokens_per_minute=6000), 1)
    out = store.admit_now(small, "a2", 60)
    # Debt 70 s against 60 s tolerance: the 1-token request waits 10.01 s.
    assert not out.allowed and math.isclose(out.retry_after_s, 10.01)


def test_concurrency_cap_and_release() -> None:
    store = MemoryStore(Clock())
    plan = build_plan(Subject("a"), TenantLimits(max_concurrent=2), 10)
    assert store.admit_now(plan, "c1", 60).allowed
    assert store.admit_now(plan, "c2", 60).allowed
    assert store.admit_now(plan, "c3", 60).failed == "t|c"
    store.settle_now(lease_for(plan, "c1"), 5)
    assert store.admit_now(plan, "c3", 60).allowed


def test_lease_expiry_returns_slots_of_a_dead_holder() -> None:
    clock = Clock()
    store = MemoryStore(clock)
    plan = build_plan(Subject("a"), TenantLimits(max_concurrent=1, tokens_per_day=1000), 600)
    assert store.admit_now(plan, "dead", 30).allowed  # the holder never settles
    assert store.quota_usage("a") == (0, 600, 0, 0)
    clock.now += 29.9
    assert store.admit_now(plan, "x", 30).failed == "t|c"
    clock.now += 0.1  # expiry reached: slot and reservation return
    assert store.admit_now(plan, "y", 30).allowed
    assert store.quota_usage("a") == (0, 600, 0, 0)
    # A late settle of the expired lease still charges what it used, once.
    store.settle_now(lease_for(plan, "dead"), 100)
    assert store.quota_usage("a") == (100, 600, 0, 0)


async def test_renew_keeps_a_long_request_alive() -> None:
    clock = Clock()
    store = MemoryStore(clock)
    plan = build_plan(Subject("a"), TenantLimits(max_concurrent=1), 0)
    store.admit_now(plan, "long", 30)
    lease = lease_for(plan, "long")
    for _ in range(5):
        clock.now += 20
        assert await store.renew(lease, 30)
    assert store.admit_now(plan, "other", 30).failed == "t|c"
    clock.now += 30
    assert not await store.renew(lease, 30)  # expired: renew is refused
    assert store.admit_now(plan, "other", 30).allowed


def test_daily_quota_counts_reservations_and_rolls_at_midnight() -> None:
    clock = Clock(T0 + DAY - 10)  # 23:59:50
    store = MemoryStore(clock)
    plan = build_plan(Subject("a"), TenantLimits(tokens_per_day=1000), 400)
    assert store.admit_now(plan, "q1", 60).allowed
    assert store.admit_now(plan, "q2", 60).allowed
    out = store.admit_now(plan, "q3", 60)  # 800 reserved + 400 > 1000
    assert out.failed == "q|d" and math.isclose(out.retry_after_s, 10.0)
    store.settle_now(lease_for(plan, "q1"), 100)  # used 100: 100 + 400 reserved
    assert store.admit_now(plan, "q3", 60).allowed  # 100 + 800 <= 1000
    assert store.quota_usage("a") == (100, 800, 0, 0)
    clock.now = T0 + DAY  # midnight UTC: a new day
    assert store.admit_now(plan, "q4", 60).allowed
    assert store.quota_usage("a")[:2] == (0, 400)
    # A request from yesterday settling today counts towards today.
    store.settle_now(lease_for(plan, "q2"), 50)
    assert store.quota_usage("a")[:2] == (50, 400)


def test_monthly_quota() -> None:
    clock = Clock(T0)
    store = MemoryStore(clock)
    plan = build_plan(Subject("a"), TenantLimits(tokens_per_month=500), 300)
    store.admit_now(plan, "m1", 60)
    store.settle_now(lease_for(plan, "m1"), 300)
    out = store.admit_now(plan, "m2", 60)
    assert out.failed == "q|m"
    assert math.isclose(out.retry_after_s, 17 * DAY)  # 15 March -> 1 April
    clock.now = T0 + 17 * DAY
    assert store.admit_now(plan, "m2", 60).allowed


def test_rejection_changes_nothing() -> None:
    store = MemoryStore(Clock())
    limits = TenantLimits(
        requests_per_minute=60,
        tokens_per_minute=1000,
        max_concurrent=5,
        per_model={"m": ScopeLimits(tokens_per_minute=100)},
    )
    plan = build_plan(Subject("a", model="m"), limits, 200)
    out = store.admit_now(plan, "r1", 60)
    assert out.failed == "m:m|tpm" and out.retry_after_s == -1  # larger than the burst
    ok = store.admit_now(build_plan(Subject("a"), limits, 200), "r2", 60)
    # Nothing was charged by the rejection: a full request bucket and token bucket.
    assert ok.requests is not None and ok.requests.remaining == 59
    assert ok.tokens is not None and ok.tokens.remaining == 800


def test_longest_wait_is_reported() -> None:
    store = MemoryStore(Clock())
    limits = TenantLimits(requests_per_minute=60, request_burst=1, per_key={"k": ScopeLimits(requests_per_minute=6)})
    plan = build_plan(Subject("a", key_id="k"), limits, 0)
    store.admit_now(plan, "1", 60)
    out = store.admit_now(plan, "2", 60)
    # Tenant: 1 s to wait; key (6 rpm, burst 6): still 5 left. Only the tenant fails.
    assert out.failed == "t|rpm"
    assert out.requests is not None and out.requests.field == "t|rpm"
