"""The ``queue`` stage: the request's deadline, then a slot in its model's pool."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import orjson
from aiohttp import web

from dialects.base import Call
from gateway.errors import BadRequest, GatewayError, GatewayTimeout, RateLimited, ServiceUnavailable
from gateway.exchange import CACHE_HEADER, PRIORITY_HEADER, TIER_HEADER, TIMEOUT_HEADER, Exchange
from gateway.settings import Settings, TenantSettings
from gateway.stages import CONTINUE, Reply
from routing import saturation
from routing.admission import Admitted
from routing.bands import Bands
from routing.config import QueueWaitSettings
from routing.metrics import RoutingMetrics
from routing.route import Route
from routing.router import Router


@dataclass(frozen=True, slots=True)
class QueueRules:
    """The request's time bound (``upstream.request_timeout_s``) and the longest wait in a
    pool's queue: its band's (``bands[].max_wait_s``), else by priority (``routing.queue.max_wait_s``)."""

    request_timeout_s: float
    max_wait_s: QueueWaitSettings
    bands: Bands

    @classmethod
    def from_settings(cls, settings: Settings) -> QueueRules:
        return cls(
            settings.upstream.request_timeout_s, settings.routing.queue.max_wait_s, Bands.from_settings(settings.bands)
        )


class Queue:
    """The request's deadline, then a slot in its model's pool.

    While some replica of the pool has room this is a counter check. When every one is
    at capacity the tenant's degradation applies (overflow to a smaller tier, a
    ``max_tokens`` clamp), then the request waits in the pool's fair queue: until a slot
    frees up, or a 429 (its tenant's queue, or its band's, is full), 503 (waited its band's
    or priority's longest wait) or 504 (its own deadline passed), each with ``Retry-After``
    where retrying helps. Bands are served in order (``routing.band_queue``).
    """

    name = "queue"

    def __init__(
        self,
        rules: QueueRules,
        router: Router,
        tiers: Mapping[str, str],
        metrics: RoutingMetrics,
        clock: Callable[[], float],
    ) -> None:
        self.rules = rules
        self.router = router
        self.tiers = tiers
        self.metrics = metrics
        self.clock = clock

    async def __call__(self, ex: Exchange, request: web.Request) -> Reply:
        route, tenant = ex.route, ex.tenant
        assert route is not None and tenant is not None
        ex.headers[CACHE_HEADER] = "miss"  # whatever answers now, the cache did not
        bound = saturation.deadline(ex.started, self.rules.request_timeout_s, request.headers.get(TIMEOUT_HEADER))
        if bound is None:
            return BadRequest(f"The {TIMEOUT_HEADER} header must be a positive integer (milliseconds).")
        ex.deadline, ex.cut_at_deadline = bound
        now = self.clock()
        if not route.pool.admission.ready(now, route.band):
            self._degrade(ex, tenant, route, now)
            if not route.pool.admission.ready(now, route.band):
                refused = await self._wait(ex, tenant, route, request, now)
                if refused is not None:
                    return refused
        if ex.timeline is not None:
            ex.timeline.mark("queue", self.clock())
        return CONTINUE

    def _degrade(self, ex: Exchange, tenant: TenantSettings, route: Route, now: float) -> None:
        """The tenant's graceful degradation, when its request's pool is saturated (the
        route records it: ``Route.degraded``, and the answer is then not the cache's to keep)."""
        degrade = tenant.degrade
        rm = self.metrics
        if degrade.overflow and route.choice is not None:
            pools = self.router.pools
            smaller = saturation.overflow_model(
                self.router.tiers.smaller(route.choice.tier), lambda m: pools[m].admission.ready(now, route.band)
            )
            if smaller is not None:
                rm.series(rm.degraded, route.model, tenant.id, "overflow").inc()
                route.switch(smaller, "overflow")
                ex.headers[TIER_HEADER] = self.tiers[smaller]
                return
        # Only what generates tokens has a cap to lower (an audio form has no JSON to rewrite).
        limit = saturation.clamp(ex.call.max_tokens, degrade.max_tokens) if ex.call.dialect.generates else None
        if limit is not None:
            rm.series(rm.degraded, route.model, tenant.id, "max_tokens").inc()
            _clamp_max_tokens(ex.call, limit)
            route.clamp(limit)

    async def _wait(
        self, ex: Exchange, tenant: TenantSettings, route: Route, request: web.Request, now: float
    ) -> GatewayError | None:
        """Wait in the pool's fair queue: None once admitted, else the refusal."""
        assert ex.deadline is not None
        band = route.band
        wait_s = self.rules.bands.max_wait_s[band]
        if wait_s is None:
            level = saturation.priority(tenant.priority, request.headers.get(PRIORITY_HEADER))
            wait_s = self.rules.max_wait_s.for_priority(level)
        wait_until = min(now + wait_s, ex.deadline)
        outcome = await route.pool.admission.wait(tenant.id, route.cost, wait_until, band)
        rm = self.metrics
        band_name = self.rules.bands.names[band]
        if isinstance(outcome, Admitted):
            route.queued_s = outcome.waited_s
            rm.series(rm.queue_wait, route.model, band_name, tenant.id).observe(outcome.waited_s)
            return None
        route.queued_s = self.clock() - now
        reason = saturation.shed_reason(outcome.reason, wait_until, ex.deadline)
        rm.series(rm.shed, route.model, band_name, tenant.id, reason).inc()
        retry_after = {"Retry-After": str(max(1, math.ceil(outcome.retry_after_s)))}
        if reason == saturation.QUEUE_FULL:
            return RateLimited(
                f"Too many of your requests are waiting for '{route.model}'; retry later.",
                code="queue_full",
                headers=retry_after,
            )
        if reason == saturation.BAND_FULL:
            return RateLimited(
                f"Too many '{band_name}'-band requests are waiting for '{route.model}'; retry later.",
                code="band_full",
                headers=retry_after,
            )
        if reason == saturation.DEADLINE:
            return GatewayTimeout(
                "The request's deadline passed while it waited for a free replica.", code="deadline_exceeded"
            )
        return ServiceUnavailable(
            f"Every replica of '{route.model}' stayed busy for {wait_s:g} s; retry later.",
            code="queue_timeout",
            headers=retry_after,
        )


def _clamp_max_tokens(call: Call, limit: int) -> None:
    """Lower the request's max_tokens to ``limit`` (graceful degradation), in the forwarded body too."""
    body = dict(call.body)
    fields = call.dialect.max_tokens_fields
    body[next((f for f in fields if f in body), fields[-1])] = limit
    call.body = body
    call.max_tokens = limit
    call.raw = orjson.dumps(body)
