"""Prometheus metrics of routing, all prefixed ``fleetgate_``, on the gateway's registry.

Label values come from configuration or fixed sets: ``model`` and ``fallback`` are model
names, ``tenant`` a tenant id, ``tier`` a tier name, ``policy`` one of the four policy
names, ``reason`` a policy's decision reason (``affinity``, ``affinity_spill``, ``stall_spill``,
``affinity_history``, ``session``, ``new_prefix``, ``no_prefix``, ``least_tokens``, ``least_requests``,
``round_robin``),
a tier reason (``classified``, ``forced``, ``force_denied``) or a shed
reason (``queue_full``, ``band_full``, ``wait_exceeded``, ``deadline``); ``band`` a
configured priority band's name; ``head`` and ``fallback`` the
classifier's fixed sets. Retries are the gateway's
``fleetgate_retries_total``; this module adds the budget that stops them.

Queue depth is read from the queues at scrape time (``QueueCollector``): nothing to keep up
to date on the request path. Queue wait is observed only for requests that waited, so
its count is the number of queued requests, not of all requests.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from common.metrics import MetricSet

# Queue waits range from a poll interval to the longest allowed wait (30 s by default).
WAIT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class RoutingMetrics(MetricSet):
    """Counters and histograms the router and the admission queues update."""

    def __init__(self, registry: CollectorRegistry | None, policy: str) -> None:
        super().__init__(registry)
        self.policy = policy
        r = self.registry
        self.decisions = Counter(
            "fleetgate_routing_decisions",
            "Replica choices by model, policy and reason.",
            ["model", "policy", "reason"],
            registry=r,
        )
        self.affinity_hits = Counter(
            "fleetgate_routing_affinity_hits",
            "Requests sent to their prefix's home replica (prefix_affinity).",
            ["model"],
            registry=r,
        )
        self.tiers = Counter(
            "fleetgate_routing_tiers",
            "Classified requests by tier and how it was chosen (classified, forced, force_denied).",
            ["tier", "reason"],
            registry=r,
        )
        self.classifier_heads = Counter(
            "fleetgate_routing_classifier_heads",
            "Classified requests by the classifier head that scored them (embedding, static) and why "
            "the embedding head did not when it was asked to (none, unavailable, timeout, error, mismatch).",
            ["head", "fallback"],
            registry=r,
        )
        self.fallbacks = Counter(
            "fleetgate_routing_fallbacks",
            "Requests served by a model of the fallback chain instead of the one asked for.",
            ["model", "fallback"],
            registry=r,
        )
        self.retry_budget_exhausted = Counter(
            "fleetgate_retry_budget_exhausted",
            "Retries not attempted because the model's retry budget was spent.",
            ["model"],
            registry=r,
        )
        self.queue_wait = Histogram(
            "fleetgate_queue_wait_seconds",
            "Time spent in the fair queue by requests that had to wait, by model, priority band and tenant.",
            ["model", "band", "tenant"],
            buckets=WAIT_BUCKETS,
            registry=r,
        )
        self.shed = Counter(
            "fleetgate_shed",
            "Requests refused by the fair queue, by model, priority band, tenant and reason "
            "(queue_full, band_full, wait_exceeded, deadline).",
            ["model", "band", "tenant", "reason"],
            registry=r,
        )
        self.degraded = Counter(
            "fleetgate_degraded",
            "Requests degraded under pressure, by model, tenant and how (overflow, max_tokens).",
            ["model", "tenant", "how"],
            registry=r,
        )

    def decided(self, model: str, reason: str) -> None:
        self.series(self.decisions, model, self.policy, reason).inc()
        if reason == "affinity":
            self.series(self.affinity_hits, model).inc()


class QueueCollector(Collector):
    """Queue depth by model, priority band and tenant, read from the admission queues at scrape time."""

    def __init__(self, depths: Callable[[], Mapping[str, Mapping[str, Mapping[str, int]]]]) -> None:
        self._depths = depths

    def collect(self) -> Iterator[Metric]:
        family = GaugeMetricFamily(
            "fleetgate_queue_depth",
            "Requests waiting in the fair queue, by model, priority band and tenant.",
            labels=["model", "band", "tenant"],
        )
        for model, bands in self._depths().items():
            for band, tenants in bands.items():
                for tenant, n in tenants.items():
                    family.add_metric([model, band, tenant], n)
        yield family

    def describe(self) -> Iterator[Metric]:
        return iter(())
