"""The limiter the gateway calls: admit, settle, renew; breaker, fail policy, metrics.

    decision = await limiter.admit(Subject(tenant, key_id, model), tenant.limits, reserve)
    if not decision.allowed: -> 429 (503 for store_unavailable) with decision.headers()
    try: ... proxy ...
    finally: await limiter.settle(decision.lease, used_tokens)  # None: usage unknown

With a shared store (Redis), every call goes through a circuit breaker. While the store is
unreachable, each tenant's ``on_store_failure`` applies: ``fail_open`` decides in a local
``MemoryStore`` with the limits divided by the number of live gateways (learnt from
heartbeats in Redis, or given), quotas unenforced; ``fail_closed`` rejects with
``store_unavailable``. The breaker half-opens after its cool-down and recovers on its own.

A background task renews held leases every third of the lease TTL, so a long stream keeps
its slot while a dead gateway's leases expire within one TTL, and it heartbeats the shared
store so fallback limits know how many gateways share them.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from common.breaker import BreakerConfig, BreakerState, CircuitBreaker
from common.tasks import stop
from limits.config import TenantLimits
from limits.decision import Decision, Lease, LeaseOrigin, Outcome, decide, unavailable
from limits.memory_store import MemoryStore
from limits.metrics import LimitsMetrics
from limits.plan import AdmissionPlan, PlanCache, Subject, build_plan
from limits.redis_store import DEFAULT_MAX_CONNECTIONS, DEFAULT_TIMEOUT_S, RedisStore
from limits.store import LimitStore, StoreUnavailableError
from redisconn.config import RedisSecurity

log = logging.getLogger("fleetgate.limits")
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class LimiterOptions:
    """Tuning of the limiter; the defaults suit a gateway next to its Redis."""

    # A dead gateway's slots and reservations return within this; live requests are
    # renewed every third of it, so it need not exceed the longest request.
    lease_ttl_s: float = 60.0
    # How often a gateway announces itself; peers unseen for 3 beats count as gone.
    heartbeat_s: float = 10.0
    # Renewal stops after this long, so a lease the gateway forgot to settle (a bug) still
    # frees its slot one TTL later instead of being kept alive forever.
    max_hold_s: float = 3600.0
    # Retry-After for a concurrency rejection: slots free as requests end, not on a clock.
    concurrency_retry_s: float = 1.0
    breaker: BreakerConfig = field(default_factory=BreakerConfig)
    redis_timeout_s: float = DEFAULT_TIMEOUT_S
    redis_max_connections: int = DEFAULT_MAX_CONNECTIONS
    # Run the renew/heartbeat task (tests that drive time by hand turn it off).
    background: bool = True


@dataclass(slots=True)
class _Held:
    lease: Lease
    admitted: float
    renewed: float


class _Skip:
    """The shared store was not called or did not answer."""


_SKIP = _Skip()


class Limiter:
    """Admission control for every request; one per gateway process."""

    def __init__(
        self,
        store: LimitStore,
        *,
        options: LimiterOptions | None = None,
        fallback: MemoryStore | None = None,
        live_replicas: Callable[[], int] | None = None,
        clock: Callable[[], float] = time.monotonic,
        new_id: Callable[[], str] | None = None,
        metrics: LimitsMetrics | None = None,
    ) -> None:
        self.options = options or LimiterOptions()
        self._store = store
        # A memory store cannot fail: no breaker, no fallback.
        self._shared = not isinstance(store, MemoryStore)
        # Fallback buckets start nearly empty at every outage (one second of rate): the
        # shared buckets' burst may be spent already, so during an outage the gateways
        # together admit the rate (each its share) plus one second of it, never a second burst.
        self._fallback = fallback or MemoryStore(start_low=True)
        self._store_ok = True
        self._live_replicas = live_replicas
        self._peers = 1
        self._clock = clock
        # Lease ids: this process's random prefix and a counter (unique across gateways,
        # and cheaper per request than fresh random bytes).
        prefix = secrets.token_hex(8)
        serial = itertools.count(1)
        self._new_id = new_id or (lambda: f"{prefix}.{next(serial)}")
        self._instance = prefix if new_id is None else new_id()
        self.metrics = metrics or LimitsMetrics()
        self.breaker = CircuitBreaker(self.options.breaker)
        # Leases not yet settled: for renewal, and to make settle idempotent.
        self._live: dict[str, _Held] = {}
        self._plans = PlanCache()
        self._task: asyncio.Task[None] | None = None
        self._last_beat = float("-inf")
        self._closed = False

    # -- the request path ------------------------------------------------------------

    async def admit(self, subject: Subject, limits: TenantLimits | None, reserve_tokens: int) -> Decision:
        """Check and charge every limit that applies to ``subject`` for one request."""
        if self._closed:
            raise RuntimeError("Limiter is closed")
        if limits is None:
            return Decision(True, lease=Lease("", subject.tenant, 0, "none"))
        plan = self._plans.plan(subject, limits, reserve_tokens)
        if plan.empty:
            return Decision(True, lease=Lease("", subject.tenant, 0, "none"))
        self._start_background()
        lease_id = self._new_id()
        ttl = self.options.lease_ttl_s
        if not self._shared:
            assert isinstance(self._store, MemoryStore)
            return self._conclude(plan, self._store.admit_now(plan, lease_id, ttl), lease_id, "store")
        result = await self._call("admit", lambda: self._store.admit(plan, lease_id, ttl))
        if not isinstance(result, _Skip):
            return self._conclude(plan, result, lease_id, "store")
        policy = limits.on_store_failure
        self.metrics.fallback_decisions.labels(subject.tenant, policy).inc()
        if policy == "fail_closed":
            decision = unavailable()
            self.metrics.rejections.labels(subject.tenant, decision.reason).inc()
            return decision
        share = self._live_replicas() if self._live_replicas is not None else self._peers
        local = build_plan(subject, limits, reserve_tokens, fallback_share=max(share, 1))
        outcome = self._fallback.admit_now(local, lease_id, ttl)
        return self._conclude(local, outcome, lease_id, "fallback")

    async def settle(self, lease: Lease | None, used_tokens: int | None) -> None:
        """End a request: ``used_tokens`` is the real usage, None releases the reservation.

        Idempotent; never raises for a store failure (the lease then expires on its own).
        """
        if self.settle_locally(lease, used_tokens) or lease is None:
            return
        self._count_settle(lease, used_tokens)
        await self._call("settle", lambda: self._store.settle(lease, used_tokens))

    def settle_locally(self, lease: Lease | None, used_tokens: int | None) -> bool:
        """``settle`` without awaiting, when it involves no shared store; True if done.

        The memory store and the fallback settle synchronously, so the hot path need not
        schedule a task for them. False means: call ``settle`` (a shared-store lease).
        """
        if lease is None or lease.origin == "none" or lease.id not in self._live:
            return True
        if lease.origin != "fallback" and self._shared:
            return False
        self._count_settle(lease, used_tokens)
        store = self._fallback if lease.origin == "fallback" else self._store
        assert isinstance(store, MemoryStore)
        store.settle_now(lease, used_tokens)
        return True

    def _count_settle(self, lease: Lease, used_tokens: int | None) -> None:
        self._live.pop(lease.id, None)
        series = self.metrics.tenant(lease.tenant)
        if used_tokens is None:
            series.releases.inc()
        else:
            series.tokens_settled.inc(max(used_tokens, 0))

    async def renew(self, lease: Lease) -> bool:
        """Extend a held lease by one TTL; False if it expired or the store is unreachable."""
        if not lease.held or lease.id not in self._live:
            return False
        ttl = self.options.lease_ttl_s
        if lease.origin == "fallback":
            ok = await self._fallback.renew(lease, ttl)
        elif not self._shared:
            ok = await self._store.renew(lease, ttl)
        else:
            result = await self._call("renew", lambda: self._store.renew(lease, ttl))
            ok = result is True
        held = self._live.get(lease.id)
        if ok and held is not None:
            held.renewed = self._clock()
        return ok

    @property
    def degraded(self) -> bool:
        """True while decisions are taken without the shared store."""
        return self._shared and self.breaker.degraded

    # -- internals -------------------------------------------------------------------

    def _conclude(self, plan: AdmissionPlan, outcome: Outcome, lease_id: str, origin: LeaseOrigin) -> Decision:
        lease: Lease | None = None
        if outcome.allowed:
            series = self.metrics.tenant(plan.tenant)
            lease = Lease.from_plan(lease_id, plan, origin)
            if lease.origin != "none":
                now = self._clock()
                self._live[lease_id] = _Held(lease, now, now)
                series.tokens_reserved.inc(plan.reserve)
            (series.admitted_fallback if origin == "fallback" else series.admitted).inc()
        decision = decide(
            plan,
            outcome,
            lease,
            degraded=origin == "fallback",
            concurrency_retry_s=self.options.concurrency_retry_s,
        )
        if not decision.allowed and decision.reason is not None:
            self.metrics.rejections.labels(plan.tenant, decision.reason).inc()
        return decision

    async def _call(self, op: str, fn: Callable[[], Awaitable[T]]) -> T | _Skip:
        """One shared-store call through the breaker; ``_SKIP`` when unavailable."""
        if not self.breaker.allow(self._clock()):
            if op == "settle":
                # The lease expires in the store; its usage is not charged there.
                self.metrics.store_failures.labels(op).inc()
            return _SKIP
        trial = self.breaker.trial  # this call's number if it is the half-open trial
        started = time.perf_counter()
        try:
            result = await fn()
        except StoreUnavailableError as exc:
            self.metrics.store_failures.labels(op).inc()
            if self._store_ok:
                self._store_ok = False
                self._fallback.forget_buckets()
            if self.breaker.record_failure(self._clock()):
                self.metrics.fallback_active.set(1)
                log.warning(
                    "limit store unreachable (%s); fail_open tenants now use local limits "
                    "per gateway, fail_closed tenants get 503",
                    exc,
                )
            return _SKIP
        except BaseException:
            # Cancelled mid-call (the client left): no verdict on the store's health.
            if trial is not None:
                self.breaker.abandon_trial(trial)
            raise
        self.metrics.store_latency.labels(op).observe(time.perf_counter() - started)
        self._store_ok = True
        if self.breaker.record_success():
            self.metrics.fallback_active.set(0)
            log.warning("limit store reachable again; shared limits back in force")
        return result

    def _start_background(self) -> None:
        if self._task is None and self.options.background:
            self._task = asyncio.get_running_loop().create_task(self._maintain(), name="fleetgate-limits-maintain")

    async def _maintain(self) -> None:
        # The first round runs at once: until this gateway has counted its peers, a
        # fallback decision would take the whole limit for itself.
        tick = min(self.options.lease_ttl_s / 3, self.options.heartbeat_s)
        while True:
            try:
                await self.maintain()
            except Exception:  # the task must outlive any one bad round
                log.exception("limits maintenance round failed")
            await asyncio.sleep(tick)

    async def maintain(self) -> None:
        """One round of upkeep: heartbeat when due, renew held leases, drop forgotten ones.

        The background task calls it every tick; tests call it with a hand-driven clock.
        """
        now = self._clock()
        if self._shared and now - self._last_beat >= self.options.heartbeat_s:
            self._last_beat = now
            await self.heartbeat()
        renew_every = self.options.lease_ttl_s / 3
        for held in list(self._live.values()):
            if now - held.admitted >= self.options.max_hold_s:
                # Forgotten (never settled): let it expire in the store, stop tracking it.
                self._live.pop(held.lease.id, None)
            elif held.lease.held and now - held.renewed >= renew_every:
                await self.renew(held.lease)

    async def heartbeat(self) -> int:
        """Announce this gateway to the shared store; returns the live gateway count."""
        beat = getattr(self._store, "heartbeat", None)
        if beat is None:
            return self._peers
        ttl = 3 * self.options.heartbeat_s
        result: Any = await self._call("heartbeat", lambda: beat(self._instance, ttl))
        if isinstance(result, int) and result > 0:
            self._peers = result
        return self._peers

    async def close(self) -> None:
        """Stop the background task and close the stores; idempotent."""
        if self._closed:
            return
        self._closed = True
        await stop(self._task)
        beat = getattr(self._store, "heartbeat", None)
        if beat is not None and self.breaker.state is BreakerState.CLOSED:
            with contextlib.suppress(StoreUnavailableError, RuntimeError):
                await beat(self._instance, 0.0)
        await self._store.close()
        await self._fallback.close()

    async def __aenter__(self) -> Limiter:
        # Announce this gateway and learn how many share the store before the first request.
        self._start_background()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


def create_limiter(
    redis_url: str | None,
    *,
    options: LimiterOptions | None = None,
    live_replicas: Callable[[], int] | None = None,
    metrics: LimitsMetrics | None = None,
    security: RedisSecurity | None = None,
) -> Limiter:
    """A limiter on Redis at ``redis_url`` (any ``redisconn`` scheme), or in memory when None."""
    options = options or LimiterOptions()
    store: LimitStore
    if redis_url is None:
        store = MemoryStore()
    else:
        store = RedisStore.from_url(
            redis_url,
            timeout_s=options.redis_timeout_s,
            max_connections=options.redis_max_connections,
            security=security,
        )
    return Limiter(store, options=options, live_replicas=live_replicas, metrics=metrics)
