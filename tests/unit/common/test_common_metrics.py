"""The metrics helper every package's metrics class shares."""

from __future__ import annotations

from prometheus_client import REGISTRY, CollectorRegistry, Counter

from cache.metrics import CacheMetrics
from common.metrics import MetricSet
from gateway.metrics import GatewayMetrics
from limits.metrics import LimitsMetrics
from routing.metrics import RoutingMetrics


def test_series_is_looked_up_once_per_label_values() -> None:
    metrics = MetricSet()
    c = Counter("fleetgate_test_things", "Things.", ["kind"], registry=metrics.registry)
    assert metrics.series(c, "a") is metrics.series(c, "a")
    assert metrics.series(c, "a") is not metrics.series(c, "b")
    metrics.series(c, "a").inc(2)
    assert metrics.sample("fleetgate_test_things_total", kind="a") == 2
    assert metrics.sample("fleetgate_test_things_total", kind="b") == 0


def test_every_package_lives_on_the_registry_it_is_given() -> None:
    registry = CollectorRegistry(auto_describe=True)
    sets = [
        GatewayMetrics(registry),
        RoutingMetrics(registry, "round_robin"),
        CacheMetrics(registry),
        LimitsMetrics(registry),
    ]
    assert all(m.registry is registry for m in sets)


def test_without_a_registry_each_gets_a_private_one() -> None:
    # Two of each side by side: a metric on the process-wide registry would clash.
    for _ in range(2):
        for m in (GatewayMetrics(), CacheMetrics(), LimitsMetrics(), RoutingMetrics(None, "round_robin")):
            assert m.registry is not REGISTRY
