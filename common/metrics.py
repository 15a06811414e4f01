"""The one way fleetgate's packages hold their Prometheus metrics.

Each package's metrics class (``GatewayMetrics``, ``RoutingMetrics``, ``CacheMetrics``,
``LimitsMetrics``) is a ``MetricSet``: its metrics live on the registry it is given, the
gateway's own, or on a private one when none is given (tests, benchmarks). Never implicitly
on prometheus_client's process-wide registry: several gateways can then share a process,
and a test sees only its own counts.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.metrics import MetricWrapperBase


class MetricSet:
    """A registry and the labelled children of its metrics, looked up once each."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        # labels() validates and locks on every call, and the request path asks for the same
        # few series all the time; label values come from configuration, so this is bounded.
        self._children: dict[tuple[object, ...], Any] = {}

    def series(self, metric: MetricWrapperBase, *labels: str) -> Any:
        """``metric.labels(*labels)``, remembered."""
        key = (id(metric), *labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*labels)
        return child

    def sample(self, name: str, **labels: str) -> float:
        """A current value, e.g. ``sample("fleetgate_limits_fallback_active")``; 0 if unset."""
        return self.registry.get_sample_value(name, labels) or 0.0
