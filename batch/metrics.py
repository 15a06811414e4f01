"""The Batch API's metrics, on the gateway's registry (``fleetgate_batch_*``)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

from common.metrics import MetricSet


class BatchMetrics(MetricSet):
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        super().__init__(registry)
        self.items = Counter(
            "fleetgate_batch_items_total",
            "Batch items this pod ran to a result (completed: 2xx, failed: otherwise), or handed back "
            "(retried: admission said later, or the gateway could not be reached).",
            ["outcome"],
            registry=self.registry,
        )
        self.batches_ended = Counter(
            "fleetgate_batch_batches_total",
            "Batches this pod created (status=created) or brought to an end, by their final status.",
            ["status"],
            registry=self.registry,
        )
        self.active = Gauge(
            "fleetgate_batch_active",
            "Batches not yet ended, by status (as the last maintenance pass saw them).",
            ["status"],
            registry=self.registry,
        )
        self.queue_depth = Gauge(
            "fleetgate_batch_queue_depth",
            "Items of open batches not yet taken by any pod.",
            registry=self.registry,
        )
        self.running = Gauge("fleetgate_batch_items_running", "Items this pod is running.", registry=self.registry)
