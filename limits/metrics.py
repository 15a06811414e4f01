"""Prometheus metrics of the limits package, all prefixed ``fleetgate_limits_``.

Label values are bounded: ``tenant`` comes from the configuration, ``reason`` from
``limits.decision.Reason``, ``op`` and ``store`` from fixed sets here. The gateway builds
``LimitsMetrics`` on its own registry (``common.metrics``); without one, a private registry.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from common.metrics import MetricSet

# Redis answers an EVALSHA in well under a millisecond on a LAN; the buckets resolve that
# and stretch to the 100 ms timeout so slow calls are visible before they fail.
LATENCY_BUCKETS = (0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25)


@dataclass(frozen=True, slots=True)
class TenantSeries:
    """One tenant's children of the per-request counters, looked up once (``labels`` is slow)."""

    admitted: Any
    admitted_fallback: Any
    tokens_reserved: Any
    tokens_settled: Any
    releases: Any


class LimitsMetrics(MetricSet):
    """The counters, histogram and gauge the limiter updates."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        super().__init__(registry)
        registry = self.registry
        self._tenants: dict[str, TenantSeries] = {}
        self.admissions = Counter(
            "fleetgate_limits_admissions_total",
            "Requests admitted, by tenant and by where the decision was taken.",
            ["tenant", "store"],
            registry=registry,
        )
        self.rejections = Counter(
            "fleetgate_limits_rejections_total",
            "Requests rejected, by tenant and limit.",
            ["tenant", "reason"],
            registry=registry,
        )
        self.tokens_reserved = Counter(
            "fleetgate_limits_tokens_reserved_total",
            "Tokens reserved at admission.",
            ["tenant"],
            registry=registry,
        )
        self.tokens_settled = Counter(
            "fleetgate_limits_tokens_settled_total",
            "Tokens actually used, as settled when responses ended.",
            ["tenant"],
            registry=registry,
        )
        self.releases = Counter(
            "fleetgate_limits_releases_total",
            "Leases released without usage (request failed or was cancelled).",
            ["tenant"],
            registry=registry,
        )
        self.store_latency = Histogram(
            "fleetgate_limits_store_seconds",
            "Latency of shared-store calls, by operation.",
            ["op"],
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.store_failures = Counter(
            "fleetgate_limits_store_failures_total",
            "Shared-store calls that failed or timed out, by operation.",
            ["op"],
            registry=registry,
        )
        self.fallback_active = Gauge(
            "fleetgate_limits_fallback_active",
            "1 while the shared store is bypassed (breaker open or half-open).",
            registry=registry,
        )
        self.fallback_decisions = Counter(
            "fleetgate_limits_fallback_decisions_total",
            "Admissions decided without the shared store, by tenant and policy.",
            ["tenant", "policy"],
            registry=registry,
        )

    def tenant(self, tenant: str) -> TenantSeries:
        """The per-request series of ``tenant`` (tenant ids come from config: bounded)."""
        series = self._tenants.get(tenant)
        if series is None:
            series = self._tenants[tenant] = TenantSeries(
                self.admissions.labels(tenant, "store"),
                self.admissions.labels(tenant, "fallback"),
                self.tokens_reserved.labels(tenant),
                self.tokens_settled.labels(tenant),
                self.releases.labels(tenant),
            )
        return series
